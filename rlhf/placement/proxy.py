"""A role called like the role itself, in every placement: the proxy's methods are built from the
role class's `@dispatch` declarations (rlhf/roles/dispatch.py), so no role has a hand-written
wrapper, and a call is cut into its ranks' shares and their results put back together by the same
code (`dispatch.spread`) whether the ranks are Ray actors or role objects in this process. Only
how a share runs differs:

    ray_proxy     on each rank's host (rlhf/placement/host.py), every rank at once; arguments
                  that every rank gets the same (`@dispatch(ALL)`) travel once through Ray's
                  object store
    local_proxy   a call of the role object in this process (the local placement has one rank;
                  more objects, one per rank, run their shares one after another)

The placements hand the trainer each proxy typed as its role's protocol (`as_role`, rlhf/roles/
__init__.py), so the type checker holds every call on a role to what the protocol declares.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Type, TypeVar, cast

import torch

from rlhf.batch import Batch
from rlhf.profiling import open_phase
from rlhf.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole, Roles
from rlhf.roles.dispatch import ALL, Spread, dispatched_methods, spread

R = TypeVar("R")


class Pending:
    """A role call under way (`RoleProxy.submit`): `result()` waits for it and returns what the
    call returns; `submitted` is when it started (time.perf_counter())."""

    def __init__(self, wait: Callable[[], Any]):
        self.submitted = time.perf_counter()
        self._wait = wait

    def result(self) -> Any:
        return self._wait()


class RoleProxy:
    def __init__(self, name: str, role_cls: type, world_size: int,
                 start: Callable[[str, Spread], Callable[[], List[Any]]] | None = None,
                 local_roles: Sequence[object] = (), run: Callable[[str, Spread], List[Any]] | None = None):
        """`start(method, spread)` sets each of `spread.calls` going and returns a function that
        waits for their results, in that order; `run(method, spread)` runs them and returns the
        results (default: start, then wait). `local_roles`: the role objects of the ranks when they
        live in this process (none on Ray)."""
        self.name = name
        self.world_size = world_size
        self.start = start
        self.run = run or self._start_and_wait
        self.local_roles = list(local_roles)
        self.methods = dispatched_methods(role_cls)
        for method, mode in self.methods.items():
            setattr(self, method, functools.partial(self._invoke, method, mode))

    def _start_and_wait(self, method: str, shares: Spread) -> List[Any]:
        return self._starter()(method, shares)()

    def _starter(self) -> Callable[[str, Spread], Callable[[], List[Any]]]:
        if self.start is None:
            raise TypeError(f"{self!r} has no way to start a call")
        return self.start

    def _invoke(self, method: str, mode, *args, **kwargs):
        shares = spread(mode, self.world_size, args, kwargs, f"{self.name}.{method}")
        return shares.collect(self.run(method, shares))

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """Starts the call `method(*args, **kwargs)` and returns at once: the caller goes on with
        other roles while it runs (on Ray in the ranks' processes, in this process on a thread of
        the proxy's own). Calls of one proxy run one at a time, in the order given."""
        shares = spread(self.methods[method], self.world_size, args, kwargs, f"{self.name}.{method}")
        wait = self._starter()(method, shares)
        return Pending(lambda: shares.collect(wait()))

    def __repr__(self) -> str:
        return f"RoleProxy({self.name}, {self.world_size} ranks)"


def submit(role: object, method: str, *args, **kwargs) -> Pending:
    """Starts `method` on `role`, a proxy typed as its protocol (`as_role`), and returns at once
    (`RoleProxy.submit`): a placement's way to run two roles at once, not a method of any role."""
    if not isinstance(role, RoleProxy):
        raise TypeError(f"{role!r} is not a role proxy: only a placement's proxy can submit a call")
    return role.submit(method, *args, **kwargs)


def protocol_methods(protocol: type) -> List[str]:
    """The methods a role protocol (rlhf/roles/__init__.py) declares, its protocol bases' included."""
    return [m for m in dir(protocol) if not m.startswith("_") and callable(getattr(protocol, m))]


def as_role(proxy: RoleProxy, protocol: Type[R]) -> R:
    """`proxy` typed as the protocol of its role, so the type checker reports a call of a method the
    protocol does not declare, or with arguments it does not take. The proxy must have each of the
    protocol's methods, from its role's `@dispatch` declarations."""
    missing = [m for m in protocol_methods(protocol) if m not in proxy.methods]
    if missing:
        raise TypeError(f"{proxy!r} lacks {missing} of {protocol.__name__}: declare them with @dispatch")
    return cast(R, proxy)


def proxied_roles(proxies: Mapping[str, RoleProxy], *, placement: dict, device_report: Callable[[], Dict[str, float]],
                  close: Callable[[], None], freeze_heap: Callable[[], None] = lambda: None) -> Roles:
    """The trainer's `Roles` from a placement's proxies, each typed as its protocol. Without a
    reference of its own (LoRA) the reference is the actor's base with its adapter off; the reward
    phase (`Roles.reward`) is the controller's, set by rlhf/placement/__init__.py `build_roles`."""
    from rlhf.roles.reference import AdapterOffReference
    actor = as_role(proxies["actor"], ActorRole)
    critic: Optional[CriticRole] = as_role(proxies["critic"], CriticRole) if "critic" in proxies else None
    reference = (as_role(proxies["reference"], ReferenceRole) if "reference" in proxies
                 else AdapterOffReference(actor))
    reward_model: Optional[RewardModelRole] = (as_role(proxies["reward_model"], RewardModelRole)
                                               if "reward_model" in proxies else None)
    return Roles(actor=actor, critic=critic, reference=reference, reward=None, reward_model=reward_model,
                 placement=placement, device_report=device_report, close=close, freeze_heap=freeze_heap)


def _shared(value: Any) -> Any:
    """Big arguments go to the object store once, not once per rank."""
    import ray
    if isinstance(value, (Batch, dict, torch.Tensor)):
        return ray.put(value)
    return value


def ray_proxy(name: str, role_cls: type, hosts: list) -> RoleProxy:
    """The role `name` on Ray ranks: rank r is `hosts[r]`, which holds the role built from its spec."""
    def start(method: str, shares: Spread) -> Callable[[], List[Any]]:
        import ray
        calls = shares.calls
        if shares.mode is ALL and len(hosts) > 1:
            args = tuple(_shared(a) for a in calls[0][1])
            kwargs = {k: _shared(v) for k, v in calls[0][2].items()}
            calls = tuple((rank, args, kwargs) for rank, _, _ in calls)
        phase = open_phase()  # the ranks measure the phase's memory (rlhf/gpu_monitor.py `PhaseMemory`)
        refs = [hosts[rank].call_in_phase.remote(phase, name, method, *args, **kwargs) for rank, args, kwargs in calls]
        return lambda: ray.get(refs)

    return RoleProxy(name, role_cls, len(hosts), start)


def local_proxy(name: str, roles: Sequence[object]) -> RoleProxy:
    """The role `name` in this process: rank r is the object `roles[r]` (the local placement builds
    one). Each rank's share is a call of its object, in rank order; a submitted call runs on the
    proxy's one worker thread."""
    def run(method: str, shares: Spread) -> List[Any]:
        return [getattr(roles[rank], method)(*args, **kwargs) for rank, args, kwargs in shares.calls]

    worker: List[ThreadPoolExecutor] = []

    def start(method: str, shares: Spread) -> Callable[[], List[Any]]:
        if not worker:
            worker.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-calls"))
        return worker[0].submit(run, method, shares).result

    return RoleProxy(name, type(roles[0]), len(roles), start, local_roles=roles, run=run)

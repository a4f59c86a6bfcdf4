"""The PPO loop's roles, one class each, written once for every placement:

    actor.Actor           the trained policy and its rollout engine
    critic.Critic         the value model (GAE only)
    reference.Reference   the frozen starting policy (with LoRA: AdapterOffReference, the
                          actor's base with its adapter off)
    reward_model.RewardModel   a reward model (one-output sequence classifier), on the device
    reward.Reward         the reward phase in the controller: the rule, the reward model or both

A role receives a context (rlhf/placement/context.py) saying where it runs and declares on each
method how a call is spread over ranks (rlhf/roles/dispatch.py). `rlhf/placement/` builds the
roles in this process or on Ray ranks from the same `RoleSpec`s; the trainer sees the `Roles`
below either way, typed by the protocols here. A protocol lists every method that the trainer,
the checkpoints and the placements call on that role: the placements hand out each role's proxy
typed as its protocol (rlhf/placement/proxy.py `as_role`), so the type checker (basedpyright)
reports a call the protocol does not declare; `PlacedRole` is what a placement asks of every role
it builds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from rlhf.batch import Batch
from rlhf.rollout import SamplingParams


class PlacedRole(Protocol):
    """What a placement asks of every role it builds, in the role's own process (not through its
    proxy): the state it holds on its device, which the memory plan measures and offloading moves
    (rlhf/memory/runtime.py `state_bytes`, rlhf/memory/offload.py `Offloader`)."""

    def device_state(self) -> tuple[list, list]: ...


class TrainedState(Protocol):
    """Checkpoint state of a trained role, in the one-process layout (rlhf/checkpoint.py)."""

    def model_files(self) -> Dict[str, bytes]: ...

    def model_state(self) -> Dict[str, torch.Tensor]: ...

    def load_model_state(self, state: Dict[str, torch.Tensor], strict: bool = True) -> tuple[list, list]: ...

    def optimizer_state(self) -> dict: ...

    def load_optimizer_state(self, state: dict) -> None: ...

    def scheduler_state(self) -> dict: ...

    def load_scheduler_state(self, state: dict) -> None: ...


class ActorRole(TrainedState, Protocol):
    def compute_logprobs(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def compute_reference_logprobs(self, batch: Batch) -> torch.Tensor: ...

    def update(self, batch: Batch, shuffle_seed: int, kl_coef: float) -> Dict[str, object]: ...

    def generate(self, requests: Sequence[Tuple[List[str], int]], sampling: SamplingParams) -> List[Batch]: ...

    def release_memory(self) -> None: ...

    def set_rollout_sleep(self, enabled: bool) -> None: ...

    def rollout_asleep_bytes(self) -> int: ...

    def sync_weights(self) -> None: ...


class CriticRole(TrainedState, Protocol):
    def compute_values(self, batch: Batch) -> torch.Tensor: ...

    def update(self, batch: Batch, shuffle_seed: int) -> Dict[str, float]: ...


class ReferenceRole(Protocol):
    def compute_logprobs(self, batch: Batch) -> torch.Tensor: ...


class RewardRole(Protocol):
    def score(self, batch: Batch, update: bool = True) -> Dict[str, torch.Tensor]: ...

    def model_scores(self, batch: Batch) -> torch.Tensor: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RewardModelRole(Protocol):
    def score(self, batch: Batch) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """What builds one role anywhere: its class ("module:Class") and picklable keyword arguments.
    `extra` holds what only an in-process build can take (already-built models, tokenizers)."""

    name: str
    cls: str
    kwargs: dict
    extra: dict = dataclasses.field(default_factory=dict)

    def role_class(self) -> type:
        import importlib
        module, name = self.cls.split(":")
        return getattr(importlib.import_module(module), name)


@dataclasses.dataclass
class Roles:
    actor: ActorRole
    critic: Optional[CriticRole]
    reference: ReferenceRole
    reward: Optional[RewardRole]
    """The reward phase, in the controller (set by rlhf/placement/__init__.py `build_roles`)."""
    placement: dict
    """Where each role runs (recorded in provenance.json)."""
    device_report: Callable[[], Dict[str, float]] = lambda: {}
    """Device memory and utilisation since the last call, over every process holding a role
    (`perf/max_memory_allocated_gb`, `perf/gpu_utilization`; {} on CPU)."""
    close: Callable[[], None] = lambda: None
    freeze_heap: Callable[[], None] = lambda: None
    """Freezes the long-lived heap (rlhf/heap.py) of every other process holding a role (the ranks on Ray)."""
    reward_model: Optional["RewardModelRole"] = None
    """The reward model (reward.kind 'model' or 'combined'), which `reward` calls."""

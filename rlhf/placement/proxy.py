"""A role on Ray ranks, called like the role itself: the proxy's methods are built from the
role class's `@dispatch` declarations (rlhf/roles/dispatch.py), so no role has a hand-written
wrapper. Forward-only phases send each rank a share of the rows; collectives send every rank
the same arguments (a large argument travels once through Ray's object store)."""

from __future__ import annotations

import functools
from typing import Any, List

import torch

from rlhf.batch import Batch
from rlhf.roles.dispatch import (ALL, CALLS, ROWS, calls_per_rank, dispatched_methods, gather_rows, split_rows,
                                 take_rows)


def _shared(value: Any) -> Any:
    """Big arguments go to the object store once, not once per rank."""
    import ray
    if isinstance(value, (Batch, dict, torch.Tensor)):
        return ray.put(value)
    return value


class RoleProxy:
    def __init__(self, name: str, role_cls: type, hosts: list):
        self.name = name
        self.hosts = hosts
        self.world_size = len(hosts)
        self.methods = dispatched_methods(role_cls)
        for method, mode in self.methods.items():
            setattr(self, method, functools.partial(self._invoke, method, mode))

    def _invoke(self, method: str, mode, *args, **kwargs):
        import ray
        if mode is ROWS:
            batch, rest = args[0], args[1:]
            n, extra = len(batch), (-len(batch)) % self.world_size
            if extra:  # sharded models need equal shares: pad with copies of the last row, drop their results
                batch = batch.select(list(range(n)) + [n - 1] * extra)
            parts = split_rows(batch, self.world_size, f"{self.name}.{method}")
            out = gather_rows(ray.get([h.call.remote(self.name, method, part, *rest, **kwargs)
                                       for h, part in zip(self.hosts, parts)]))
            return take_rows(out, n) if extra else out
        if mode is CALLS:
            requests, rest = args[0], args[1:]
            per_rank = calls_per_rank(len(requests), self.world_size)
            busy = [(h, calls) for h, calls in zip(self.hosts, per_rank) if calls]
            results = ray.get([h.call.remote(self.name, method, [requests[i] for i in calls], *rest, **kwargs)
                               for h, calls in busy])
            out: List[Any] = [None] * len(requests)
            for (_, calls), result in zip(busy, results):
                for i, item in zip(calls, result):
                    out[i] = item
            return out
        assert mode is ALL, mode
        if self.world_size > 1:
            args = tuple(_shared(a) for a in args)
            kwargs = {k: _shared(v) for k, v in kwargs.items()}
        return ray.get([h.call.remote(self.name, method, *args, **kwargs) for h in self.hosts])[0]

    def __repr__(self) -> str:
        return f"RoleProxy({self.name}, {self.world_size} ranks)"

"""How a role's method is spread over the ranks of its group, declared once on the method.

    @dispatch(ROWS)   the first argument is a `Batch`; rank r gets the r-th contiguous share of
                      its rows, and the results (a tensor, or a tuple or dict of tensors) are
                      concatenated back in row order. Forward-only phases (log-probs, values,
                      reward-model scores); rows that do not split evenly are padded with copies
                      of the last row, whose results are dropped.
    @dispatch(ALL)    every rank gets the same arguments (a `Batch` travels once through Ray's
                      object store) and runs the call; rank 0's result is returned. Anything
                      with a collective inside (updates, weight gathers, checkpoint state).
    @dispatch(CALLS)  the first argument is a list of independent requests; request i runs on
                      rank i mod world_size and the results come back in request order.
                      Generation: each request carries its own seed, so which rank runs it does
                      not change what it samples.

Every placement calls a role through a proxy built from these declarations
(`rlhf/placement/proxy.py`): `spread` cuts a call into its ranks' shares and `Spread.collect`
puts their results back together, the same in this process (one rank) as on Ray ranks
(rlhf/placement/ray_roles.py), so a new role method is written once, on the role.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from rlhf.batch import Batch


class Dispatch(enum.Enum):
    ROWS = "rows"
    ALL = "all"
    CALLS = "calls"


ROWS, ALL, CALLS = Dispatch.ROWS, Dispatch.ALL, Dispatch.CALLS


def dispatch(mode: Dispatch) -> Callable:
    """Marks a role method as callable through a placement, with how its call is spread."""
    if not isinstance(mode, Dispatch):
        raise TypeError(f"dispatch mode must be one of {[m.name for m in Dispatch]}, got {mode!r}")

    def mark(fn: Callable) -> Callable:
        fn.__dispatch__ = mode
        return fn

    return mark


def dispatched_methods(cls: type) -> Dict[str, Dispatch]:
    """Name -> mode of every method of `cls` (and its bases) declared with `@dispatch`."""
    return {name: fn.__dispatch__ for name, fn in inspect.getmembers(cls, callable)
            if isinstance(getattr(fn, "__dispatch__", None), Dispatch)}


def even_shares(n: int, world_size: int, what: str) -> List[range]:
    """Contiguous equal row ranges, one per rank. Sharded models need every rank to run the same
    number of forward passes, so uneven shares are an error rather than a slow path."""
    if n % world_size:
        raise ValueError(f"{what}: {n} rows cannot be split evenly over ppo.world_size = {world_size}")
    per = n // world_size
    return [range(r * per, (r + 1) * per) for r in range(world_size)]


def split_rows(batch: Batch, world_size: int, what: str) -> List[Batch]:
    return [batch.select(rows) for rows in even_shares(len(batch), world_size, what)]


def gather_rows(parts: Sequence[Any]) -> Any:
    """Concatenates per-rank results along the batch dimension, keeping their structure."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    if isinstance(first, tuple):
        return tuple(gather_rows([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: gather_rows([p[k] for p in parts]) for k in first}
    if isinstance(first, list):
        return [x for p in parts for x in p]
    raise TypeError(f"cannot gather rows of a {type(first).__name__}")


def take_rows(result: Any, n: int) -> Any:
    """The first `n` rows of a gathered result (same structures as `gather_rows`)."""
    if isinstance(result, torch.Tensor):
        return result[:n]
    if isinstance(result, tuple):
        return tuple(take_rows(r, n) for r in result)
    if isinstance(result, dict):
        return {k: take_rows(v, n) for k, v in result.items()}
    return result[:n]


def calls_per_rank(n: int, world_size: int) -> List[List[int]]:
    """Request indices of each rank: request i on rank i mod world_size."""
    return [list(range(r, n, world_size)) for r in range(world_size)]


@dataclasses.dataclass(frozen=True)
class Spread:
    """One call spread over a role's ranks as its method declares (`spread`): `calls` holds the
    (rank, args, kwargs) of every rank with work, in rank order, and `collect` makes the call's
    result from theirs, given in that order."""

    mode: Dispatch
    calls: Tuple[Tuple[int, tuple, dict], ...]
    size: int = 0
    """ROWS: the caller's row count; CALLS: its request count."""
    padded: bool = False
    """ROWS: the shares carry copies of the last row, whose results `collect` drops."""
    requests: Tuple[List[int], ...] = ()
    """CALLS: the request indices each of `calls` runs."""

    def collect(self, results: Sequence[Any]) -> Any:
        if self.mode is ROWS:
            out = gather_rows(results)
            return take_rows(out, self.size) if self.padded else out
        if self.mode is CALLS:
            out: List[Any] = [None] * self.size
            for indices, result in zip(self.requests, results):
                for i, item in zip(indices, result):
                    out[i] = item
            return out
        return results[0]


def spread(mode: Dispatch, world_size: int, args: tuple, kwargs: dict, what: str) -> Spread:
    """The shares of one call of a method declared `mode` (`what` names it in errors)."""
    if mode is ROWS:
        batch, rest = args[0], args[1:]
        n, extra = len(batch), (-len(batch)) % world_size
        if extra:  # sharded models need equal shares: pad with copies of the last row, drop their results
            batch = batch.select(list(range(n)) + [n - 1] * extra)
        parts = split_rows(batch, world_size, what)
        return Spread(mode, tuple((rank, (part, *rest), kwargs) for rank, part in enumerate(parts)), size=n,
                      padded=bool(extra))
    if mode is CALLS:
        requests, rest = args[0], args[1:]
        busy = [(rank, calls) for rank, calls in enumerate(calls_per_rank(len(requests), world_size)) if calls]
        return Spread(mode, tuple((rank, ([requests[i] for i in calls], *rest), kwargs) for rank, calls in busy),
                      size=len(requests), requests=tuple(calls for _, calls in busy))
    assert mode is ALL, mode
    return Spread(mode, tuple((rank, args, kwargs) for rank in range(world_size)))

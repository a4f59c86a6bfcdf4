"""The update's statistics: token-weighted means of what each micro-batch reports, read from the
device once, and summed over the ranks."""

from __future__ import annotations

import math
from typing import Dict, List, Mapping

import torch


class StatAccumulator:
    """Token-weighted means of per-micro-batch statistics. Values and weights may be tensors on
    the device: they are kept as they are and read in one transfer when the sums are first
    needed (reading each as it comes would make the host wait for the GPU every micro-batch).
    The sums are then formed on the host in float64, in the order the values were added."""

    def __init__(self):
        self._pending: List[tuple] = []
        self._sums: Dict[str, float] = {}
        self._weights: Dict[str, float] = {}

    def add(self, stats: Mapping[str, object], weight) -> None:
        def keep(v):  # never an autograd graph
            return v.detach() if isinstance(v, torch.Tensor) else v

        self._pending.append(({k: keep(v) for k, v in stats.items()}, keep(weight)))

    def _settle(self) -> None:
        if not self._pending:
            return
        tensors = [v for stats, w in self._pending for v in (*stats.values(), w) if isinstance(v, torch.Tensor)]
        by_device: Dict[torch.device, list] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        host = {}
        for group in by_device.values():  # one transfer per device
            values = torch.stack([t.reshape(()).double() for t in group]).tolist()
            host.update({id(t): v for t, v in zip(group, values)})

        def read(v) -> float:
            return host[id(v)] if isinstance(v, torch.Tensor) else float(v)

        for stats, weight in self._pending:
            weight = read(weight)
            for k, v in stats.items():
                self._sums[k] = self._sums.get(k, 0.0) + read(v) * weight
                self._weights[k] = self._weights.get(k, 0.0) + weight
        self._pending = []

    @property
    def sums(self) -> Dict[str, float]:
        self._settle()
        return self._sums

    @property
    def weights(self) -> Dict[str, float]:
        self._settle()
        return self._weights

    def means(self) -> Dict[str, float]:
        sums, weights = self.sums, self.weights
        return {k: sums[k] / weights[k] if weights[k] else math.nan for k in sums}


def global_stats(stats: StatAccumulator, ranks) -> Dict[str, float]:
    """Token-weighted means over every rank's micro-batches."""
    if ranks.world_size == 1:
        return stats.means()
    keys = sorted(stats.sums)
    packed = ranks.sum(torch.tensor([[stats.sums[k] for k in keys], [stats.weights[k] for k in keys]],
                                    dtype=torch.float64))
    return {k: float(packed[0, i] / packed[1, i]) if packed[1, i] else math.nan for i, k in enumerate(keys)}

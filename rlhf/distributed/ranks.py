"""A worker's view of its role group: which rows of a mini-batch are its own, and sums over ranks.

The local workers (`rlhf/workers/`) take a `ranks` object; in one process it is
`workers.common.SingleRank`. Here it is backed by torch.distributed. Shares are contiguous, so
with `micro_batch_size = mini_batch_size / world_size` rank r runs exactly the forward pass the
single process runs as its r-th micro-batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.batch import Batch


def even_shares(n: int, world_size: int, what: str) -> list[range]:
    """Contiguous equal row ranges, one per rank. Sharded models need every rank to run the same
    number of forward passes, so uneven shares are an error rather than a slow path."""
    if n % world_size:
        raise ValueError(f"{what}: {n} rows cannot be split evenly over ppo.world_size = {world_size}")
    per = n // world_size
    return [range(r * per, (r + 1) * per) for r in range(world_size)]


class ProcessGroupRanks:
    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank = rank
        self.world_size = world_size
        self.device = device  # where collectives run (NCCL needs CUDA tensors)

    def share(self, batch: Batch) -> Batch:
        return batch.select(even_shares(len(batch), self.world_size, "a mini-batch")[self.rank])

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(tensor.device)

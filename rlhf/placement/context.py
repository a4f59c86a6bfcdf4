"""Where a role runs, as the role sees it: its device, its ranks, and how its models are placed.

A role builds its models and hands them to `ctx.place(model)`; everything that depends on the
placement (sharding, gathering full states for checkpoints and weight sync, moving state off
and onto the device) goes through the context, so the role is written once:

    DeviceContext   one device, no sharding: one process, or one Ray rank at world size 1
                    (a one-rank FSDP group would only add copies)
    FSDPContext     a rank of a torch.distributed group (gloo on CPU, NCCL on GPU) whose
                    models are sharded with FSDP2
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from rlhf.batch import Batch
from rlhf.roles.dispatch import even_shares


class SingleRank:
    """The ranks a role shares each mini-batch with, when there is only itself."""

    rank = 0
    world_size = 1

    def share(self, batch: Batch) -> Batch:
        return batch

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class ProcessGroupRanks:
    """A rank of a torch.distributed group. Shares are contiguous, so with `micro_batch_size =
    mini_batch_size / world_size` rank r runs exactly the forward pass the single process runs
    as its r-th micro-batch."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank = rank
        self.world_size = world_size
        self.device = device  # where collectives run (NCCL needs CUDA tensors)

    def share(self, batch: Batch) -> Batch:
        rows = even_shares(len(batch), self.world_size, "a mini-batch")[self.rank]
        return batch.slice(rows.start, rows.stop)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(tensor.device)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise max over ranks (micro-batch counts every rank must run)."""
        out = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out.to(tensor.device)


class DeviceContext:
    sharded = False

    def __init__(self, device: torch.device, autocast_dtype: Optional[torch.dtype] = None, ranks=None):
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.ranks = ranks or SingleRank()

    @property
    def is_rank0(self) -> bool:
        return self.ranks.rank == 0

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def full_model_state(self, model: torch.nn.Module, rank0_cpu: bool = True,
                         only: Optional[List[str]] = None) -> Dict[str, torch.Tensor]:
        """The unsharded state dict; `rank0_cpu`: on CPU (checkpoints), else on the device (weight
        sync); `only`: just these names (a LoRA model's adapters, without copying its frozen base)."""
        state = model.state_dict()
        if only is not None:
            state = {k: state[k] for k in only}
        return {k: v.detach().cpu() for k, v in state.items()} if rank0_cpu else state

    def load_model_state(self, model: torch.nn.Module, state: Dict[str, torch.Tensor], strict: bool):
        result = model.load_state_dict(state, strict=strict)
        return list(result.missing_keys), list(result.unexpected_keys)

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


class FSDPContext(DeviceContext):
    """Sharding and full states are collectives: every rank of the group calls them at once."""

    sharded = True

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        from rlhf.placement import fsdp
        return fsdp.shard(model.to(self.device), self.device.type, self.ranks.world_size)

    def full_model_state(self, model, rank0_cpu: bool = True, only: Optional[List[str]] = None):
        from rlhf.placement import fsdp
        state = fsdp.full_model_state(model, rank0_cpu=rank0_cpu)  # a collective: every rank gathers
        return {k: state[k] for k in only} if only is not None and state else state

    def load_model_state(self, model, state, strict: bool):
        from rlhf.placement import fsdp
        result = fsdp.load_full_model_state(model, state, strict)
        return list(result.missing_keys), list(result.unexpected_keys)

    def optimizer_state(self, model, optimizer) -> dict:
        from rlhf.placement import fsdp
        return fsdp.full_optimizer_state(model, optimizer)

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        from rlhf.placement import fsdp
        fsdp.load_full_optimizer_state(model, optimizer, state)


def context_for(device: torch.device, autocast_dtype, ranks) -> DeviceContext:
    """FSDP2 only where there is more than one rank to shard over."""
    if ranks is None or ranks.world_size == 1:
        return DeviceContext(device, autocast_dtype, ranks)
    return FSDPContext(device, autocast_dtype, ranks)


"""The trained roles' optimizer and LR schedule from the `ppo.*` bindings, and the gradient
clipping after each mini-batch."""

from __future__ import annotations

from typing import Iterable, List

import torch
from torch.distributed.tensor import DTensor

from rlhf.config import PPOConfig
from rlhf.lr_schedule import lr_schedule
from rlhf.models import adamw


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, cfg: PPOConfig) -> torch.optim.Optimizer:
    """AdamW with `ppo.adam_beta1`, `adam_beta2`, `adam_eps` and `weight_decay`."""
    return adamw(params, lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: PPOConfig, total_optimizer_steps: int):
    """`ppo.lr_schedule` after `ppo.lr_warmup_steps` of warmup from LR 0, over the run's optimizer steps."""
    return lr_schedule(optimizer, cfg.lr_schedule, cfg.lr_warmup_steps, max(total_optimizer_steps, 1), warmup_offset=0)


def clip_grad(params, max_norm: float) -> torch.Tensor:
    """Clips to `max_norm` (0: no clipping) and returns the gradient norm before clipping, a 0-d
    tensor on the gradients' device (read it with float() when the value is needed: reading it
    makes the host wait for the GPU). With FSDP2 the gradients are DTensor shards and the norm is
    the global one over every rank."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    if max_norm > 0:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        total = torch.norm(torch.stack([p.grad.detach().norm() for p in params]))
    if isinstance(total, DTensor):  # sharded gradients: reduce the partial norms over the ranks
        total = total.full_tensor()
    return total.detach()


def mean_grad_norm(grad_norms: List[torch.Tensor]) -> float:
    """The mean of an update's pre-clip norms (`clip_grad`), read from the device once, after the last step."""
    norms = [float(n) for n in grad_norms]
    return sum(norms) / max(len(norms), 1)

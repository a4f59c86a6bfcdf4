"""Helpers shared by the model-holding roles: the sequence forward, optimizers, schedules."""

from __future__ import annotations

import math
from typing import Dict, Iterable, List

import torch
from transformers import get_scheduler

from rlhf.batch import Batch
from rlhf.models import position_ids_from_mask


def sequence_inputs(batch: Batch, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """prompt + response ids and mask on `device`, and the prompt width P."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1).to(device)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1).to(device)
    return ids, mask, batch["prompt_ids"].shape[1]


def response_logits(model, batch: Batch, device, temperature: float = 1.0, autocast_dtype=None) -> torch.Tensor:
    """Logits that predict each response token, [B, R, V], divided by the sampling temperature
    so log-probs are those of the distribution the rollout sampled from."""
    ids, mask, P = sequence_inputs(batch, device)
    R = batch["response_ids"].shape[1]
    with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    logits = out.logits[:, P - 1:P - 1 + R].float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    return logits


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, cfg) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, foreach=False)


def build_scheduler(optimizer, cfg, total_optimizer_steps: int):
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.lr_warmup_steps,
                         num_training_steps=max(total_optimizer_steps, 1))


def minibatch_indices(n: int, mini_batch_size: int, seed: int) -> List[torch.Tensor]:
    """A seeded shuffle of range(n) cut into mini-batches."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    return [perm[i:i + mini_batch_size] for i in range(0, n, mini_batch_size)]


class StatAccumulator:
    """Token-weighted means of per-micro-batch statistics."""

    def __init__(self):
        self.sums: Dict[str, float] = {}
        self.weights: Dict[str, float] = {}

    def add(self, stats: Dict[str, float], weight: float) -> None:
        for k, v in stats.items():
            v = float(v)
            self.sums[k] = self.sums.get(k, 0.0) + v * weight
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def means(self) -> Dict[str, float]:
        return {k: self.sums[k] / self.weights[k] if self.weights[k] else math.nan for k in self.sums}


def clip_grad(params, max_norm: float) -> float:
    params = [p for p in params if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.norm(torch.stack([p.grad.detach().norm() for p in params]))) if params else 0.0

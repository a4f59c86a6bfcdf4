"""The learning-rate schedule of every model the engine trains: the actor and the critic
(rlhf/roles/optimizer.py), the reward model (rlhf/reward_model/bradley_terry.py) and the tiny SFT warm
start (rlhf/tiny.py). Linear warmup, then a constant, linear or cosine factor over the rest of
the run, as a `LambdaLR` whose factor is `lr_factor`.

The trainers differ in one convention only, which `warmup_offset` names: the engine's warmup
starts its first optimizer step at LR 0 (transformers' `get_scheduler` convention,
factor step / warmup_steps), the reward model and the SFT warm start at lr / warmup_steps
(factor (step + 1) / warmup_steps).
"""

from __future__ import annotations

import functools
import math

import torch

SCHEDULES = ("constant", "linear", "cosine")
"""The factor after warmup: 1; falling linearly to 0 at `total_steps`; half a cosine from 1 to 0."""


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, warmup_offset: int) -> float:
    """The factor on the base LR at optimizer step `step` (0-based, the number of steps taken).
    Warmup: (step + warmup_offset) / warmup_steps for step < warmup_steps. After it, over the
    `total_steps - warmup_steps` steps left: 1 ('constant'), (total_steps - step) / (steps left)
    floored at 0 ('linear'), or 0.5 (1 + cos(pi * progress)) with progress capped at 1 ('cosine')."""
    if step < warmup_steps:
        return (step + warmup_offset) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    raise ValueError(f"unknown LR schedule {schedule!r}: one of {SCHEDULES}")


def lr_schedule(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int,
                warmup_offset: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`optimizer`'s LR scheduler: `lr_factor` with these settings (step it after each optimizer
    step). The factor is a `functools.partial` of a module function, so the scheduler pickles."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown LR schedule {schedule!r}: one of {SCHEDULES}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps, warmup_offset=warmup_offset))

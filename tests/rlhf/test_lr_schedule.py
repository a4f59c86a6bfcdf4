"""The one LR schedule (rlhf/lr_schedule.py): the engine's factors are transformers' `get_scheduler`
ones bit for bit over a run, the reward model's and the tiny SFT's warm up from lr / warmup_steps,
and every trainer builds its scheduler with it."""

import functools
import math

import pytest
import torch
from transformers import get_scheduler

from rlhf.config import PPOConfig
from rlhf.lr_schedule import lr_factor, lr_schedule
from rlhf.roles.optimizer import build_scheduler


def sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def lrs(scheduler, steps):
    out = [scheduler.get_last_lr()[0]]
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup, total", [(0, 1), (0, 12), (3, 12), (5, 37), (20, 20)])
def test_engine_schedule_is_transformers_bit_for_bit(schedule, warmup, total):
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[schedule]
    reference = get_scheduler(name, sgd(), num_warmup_steps=warmup, num_training_steps=total)
    cfg = PPOConfig(lr_schedule=schedule, lr_warmup_steps=warmup)
    assert lrs(build_scheduler(sgd(), cfg, total), total) == lrs(reference, total)


def test_warmup_offset_one_starts_at_lr_over_warmup_and_cosine_stops_at_zero():
    factor = functools.partial(lr_factor, schedule="cosine", warmup_steps=4, total_steps=10, warmup_offset=1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == 1.0 and factor(10) == 0.0 and factor(15) == 0.0  # capped after the run's last step
    assert factor(7) == 0.5 * (1 + math.cos(math.pi * 3 / 6))
    tiny = functools.partial(lr_factor, schedule="constant", warmup_steps=20, total_steps=500, warmup_offset=1)
    assert [tiny(s) for s in range(600)] == [min(1.0, (s + 1) / 20) for s in range(600)]
    linear = functools.partial(lr_factor, schedule="linear", warmup_steps=0, total_steps=4, warmup_offset=0)
    assert [linear(s) for s in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_scheduler_state_round_trips_and_unknown_schedules_are_refused():
    a = lr_schedule(sgd(), "cosine", 2, 10, warmup_offset=1)
    lrs(a, 5)
    b = lr_schedule(sgd(), "cosine", 2, 10, warmup_offset=1)
    b.load_state_dict(a.state_dict())
    assert lrs(b, 5) == lrs(a, 5)  # both continue from step 5
    with pytest.raises(ValueError, match="unknown LR schedule 'step'"):
        lr_schedule(sgd(), "step", 0, 10, warmup_offset=0)


def test_every_trainer_builds_its_schedule_with_lr_schedule():
    """The engine's roles, the reward-model trainer and the tiny SFT: one builder, no schedule of their own."""
    import inspect

    import rlhf.reward_model.bradley_terry as rm_train
    import rlhf.roles.optimizer as optimizer
    import rlhf.tiny as tiny
    for module in (optimizer, rm_train, tiny):
        source = inspect.getsource(module)
        assert "lr_schedule(" in source and "LambdaLR" not in source and "get_scheduler" not in source, module

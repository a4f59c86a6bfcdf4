"""The rule reward: a registered rule function applied to decoded responses. It holds no model,
so every placement runs it in the controller's process."""

from __future__ import annotations

import torch

from rlhf.batch import Batch
from rlhf.config import TaskConfig
from rlhf.rewards import REWARD_FUNCTIONS
from rlhf.roles.common import Role
from rlhf.roles.dispatch import ROWS, dispatch


class RuleReward(Role):
    name = "reward"
    on_device = False

    def __init__(self, ctx, task: TaskConfig):
        super().__init__(ctx)
        self.fn = REWARD_FUNCTIONS[task.reward_fn]
        self.params = dict(format_reward=task.format_reward, missing_eos_penalty=task.missing_eos_penalty)

    @dispatch(ROWS)
    def score(self, batch: Batch) -> dict:
        """Scores [B] (float), correct [B] and well_formed [B] (bool) from `responses`, `answers`, `finished`."""
        results = [self.fn(r, a, bool(f), **self.params)
                   for r, a, f in zip(batch["responses"], batch["answers"], batch["finished"].tolist())]
        return {
            "scores": torch.tensor([r.reward for r in results], dtype=torch.float32),
            "correct": torch.tensor([r.correct for r in results], dtype=torch.bool),
            "well_formed": torch.tensor([r.well_formed for r in results], dtype=torch.bool),
        }

"""The reward phase, in the controller's process for every placement and `reward.kind`: the
task's rule (gold accuracy whenever the task has ground truth), the reward model's raw scores when
there is one (the device role `rlhf/roles/reward_model.py`), and what the policy trains on
(rlhf/rewards.py: weights, normalisation over the whole batch, clipping, the missing-EOS penalty).
It runs in the controller so batch and running normalisation see every row."""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.batch import Batch
from rlhf.config import RewardConfig, TaskConfig
from rlhf.rewards import RewardCombiner
from rlhf.roles import RewardModelRole
from rlhf.roles.role import Role


class Reward(Role):
    name = "reward"

    def __init__(self, ctx, task: TaskConfig, reward: RewardConfig,
                 reward_model: Optional[RewardModelRole] = None):
        super().__init__(ctx)
        if reward.uses_model and reward_model is None:
            raise ValueError(f"reward.kind = {reward.kind!r} needs the reward-model role")
        self.combiner = RewardCombiner(task, reward)
        self.reward_model = reward_model if reward.uses_model else None

    def score(self, batch: Batch, update: bool = True) -> dict:
        """scores [B] (what the policy trains on), correct / well_formed [B] (the rule's) and, with a
        reward model, rm_scores [B] (its raw score). `update=False` (evaluation) leaves the running
        normalisation as it is."""
        rm = None
        if self.reward_model is not None:
            rm = batch["rm_scores"] if "rm_scores" in batch else self.model_scores(batch)
        sources = batch.meta["data_sources"] if "data_sources" in batch else None
        return self.combiner.combine(batch["responses"], batch["answers"], batch["finished"], rm, update, sources)

    def model_scores(self, batch: Batch) -> torch.Tensor:
        """The reward model's raw scores [B] (the trainer times this as its own phase)."""
        if self.reward_model is None:
            raise ValueError("model_scores needs the reward-model role (reward.kind 'model' or 'combined')")
        return self.reward_model.score(batch).float()

    def state_dict(self) -> dict:
        return self.combiner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.combiner.load_state_dict(state)

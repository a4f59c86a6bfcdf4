"""The reward model, and the reward phase that combines it with the task's rule.

    RewardModel   a device role: a local AutoModelForSequenceClassification with one output, its
                  own tokenizer and chat template (rlhf/reward_model/score.py), scoring each
                  sequence at its last real token in micro-batches (bf16 on a GPU). Rows are
                  spread over its ranks (`@dispatch(ROWS)`); with more than one rank the model is
                  sharded with FSDP2 like the reference.
    Reward        the controller's reward phase for every `reward.kind`: the rule's results
                  (gold accuracy whenever the task has ground truth), the reward model's raw
                  scores when there is one, and what the policy trains on (rlhf/rewards.py:
                  weights, normalisation over the whole batch, clipping, the missing-EOS penalty).
                  It runs in the controller so batch and running normalisation see every row.
"""

from __future__ import annotations

import torch

from rlhf.batch import Batch
from rlhf.chat import PromptRenderer
from rlhf.config import RewardConfig, TaskConfig
from rlhf.reward_model.score import RewardModelScorer
from rlhf.rewards import RewardCombiner
from rlhf.roles.common import Role
from rlhf.roles.dispatch import ROWS, dispatch


def check_reward_model(reward: RewardConfig, task: TaskConfig) -> None:
    """The reward model's checkpoint, tokenizer and chat template, checked where the run starts
    (config.json and the tokenizer only, no weights): each problem is a one-line ConfigError."""
    from rlhf.reward_model.score import check_reward_checkpoint, load_reward_tokenizer
    check_reward_checkpoint(reward.model_path)
    tokenizer = load_reward_tokenizer(reward.tokenizer_path or reward.model_path,
                                      "reward.tokenizer_path" if reward.tokenizer_path else "reward.model_path")
    PromptRenderer(tokenizer, reward.chat_template, task.system_prompt, task.instruction_suffix,
                   binding="reward.chat_template")


class RewardModel(Role):
    name = "reward_model"

    def __init__(self, ctx, reward: RewardConfig, task: TaskConfig, policy_tokenizer_dir: str,
                 policy_tokenizer=None, log=print):
        super().__init__(ctx)
        from rlhf.models import load_tokenizer
        policy_tokenizer = policy_tokenizer if policy_tokenizer is not None else load_tokenizer(policy_tokenizer_dir)
        self.scorer = RewardModelScorer(
            reward.model_path, reward.tokenizer_path, reward.chat_template, policy_tokenizer=policy_tokenizer,
            policy_renderer=PromptRenderer.from_task(policy_tokenizer, task), system_prompt=task.system_prompt,
            instruction_suffix=task.instruction_suffix, micro_batch_size=reward.micro_batch_size, device=self.device,
            place=ctx.place, log=log if ctx.is_rank0 else None)
        self.model = self.scorer.model

    def device_state(self) -> tuple[list, list]:
        return [self.model], []

    @dispatch(ROWS)
    @torch.no_grad()
    def score(self, batch: Batch) -> torch.Tensor:
        """The reward model's raw score of each row [B] (float32, on CPU)."""
        return self.scorer.score_batch(batch)


class Reward(Role):
    name = "reward"
    on_device = False

    def __init__(self, ctx, task: TaskConfig, reward: RewardConfig, reward_model=None):
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
        return self.combiner.combine(batch["responses"], batch["answers"], batch["finished"], rm, update)

    def model_scores(self, batch: Batch) -> torch.Tensor:
        """The reward model's raw scores [B] (the trainer times this as its own phase)."""
        # Ranks take equal shares: pad with copies of the last row, then drop their scores.
        n, extra = len(batch), (-len(batch)) % getattr(self.reward_model, "world_size", 1)
        rows = batch if not extra else batch.select(list(range(n)) + [n - 1] * extra)
        return self.reward_model.score(rows)[:n].float()

    def state_dict(self) -> dict:
        return self.combiner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.combiner.load_state_dict(state)

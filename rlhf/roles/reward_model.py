"""The reward model: a device role holding a local AutoModelForSequenceClassification with one
output, its own tokenizer and chat template (rlhf/reward_model/score.py), scoring each sequence at
its last real token in micro-batches (bf16 on a GPU). Rows are spread over its ranks
(`@dispatch(ROWS)`); with more than one rank the model is sharded with FSDP2 like the reference.
The reward phase that combines its scores with the task's rule is `rlhf/roles/reward.py`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhf.batch import Batch
from rlhf.chat import PromptRenderer
from rlhf.config import RewardConfig, TaskConfig
from rlhf.reward_model.score import RewardModelScorer
from rlhf.roles.dispatch import ROWS, dispatch
from rlhf.roles.role import Role


def check_reward_model(reward: RewardConfig, task: TaskConfig, examples: Sequence = ()) -> None:
    """The reward model's checkpoint, tokenizer and chat template, checked where the run starts
    (config.json, the weights' safetensors headers, the tokenizer and that its ids fit the model's
    embedding; no weights load), and each of `examples` encoded once as it will be scored (its
    conversation with an empty response): each problem is a one-line ConfigError."""
    from rlhf.chat import check_rows
    from rlhf.checkpoint import check_weights
    from rlhf.models import check_vocab_fits
    from rlhf.reward_model.score import (
        check_reward_checkpoint,
        check_tokenizer_probe,
        encode_conversation,
        load_reward_tokenizer,
    )
    check_reward_checkpoint(reward.model_path)
    check_weights(reward.model_path, "reward.model_path")
    tokenizer_binding = "reward.tokenizer_path" if reward.tokenizer_path else "reward.model_path"
    tokenizer = load_reward_tokenizer(reward.tokenizer_path or reward.model_path, tokenizer_binding)
    check_vocab_fits(tokenizer, tokenizer_binding, reward.tokenizer_path or reward.model_path, "reward.model_path",
                     reward.model_path)
    check_tokenizer_probe(tokenizer, reward.model_path, tokenizer_binding)
    renderer = PromptRenderer(tokenizer, reward.chat_template, task.system_prompt, task.instruction_suffix,
                              binding="reward.chat_template")
    check_rows(examples, lambda prompt: encode_conversation(renderer, prompt, ""), "reward.chat_template")


class RewardModel(Role):
    name = "reward_model"

    def __init__(self, ctx, reward: RewardConfig, task: TaskConfig, policy_tokenizer_dir: str,
                 policy_tokenizer=None, log=print):
        super().__init__(ctx)
        from rlhf.models import load_tokenizer
        policy_tokenizer = policy_tokenizer if policy_tokenizer is not None else load_tokenizer(policy_tokenizer_dir)
        self.scorer = RewardModelScorer(
            reward.model_path, reward.tokenizer_path, reward.chat_template, policy_tokenizer=policy_tokenizer,
            system_prompt=task.system_prompt, instruction_suffix=task.instruction_suffix,
            micro_batch_size=reward.micro_batch_size, device=self.device, place=ctx.place,
            log=log if ctx.is_rank0 else None)
        self.model = self.scorer.model

    def device_state(self) -> tuple[list, list]:
        return [self.model], []

    @dispatch(ROWS)
    @torch.no_grad()
    def score(self, batch: Batch) -> torch.Tensor:
        """The reward model's raw score of each row [B] (float32, on CPU)."""
        return self.scorer.score_batch(batch)

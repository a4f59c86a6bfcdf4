"""The direction of one real `Actor.update` on a tiny policy: tokens with a positive advantage
become more likely and tokens with a negative one less; a KL term in the loss pulls the policy
toward the reference and is absent when the KL is in the reward."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.placement.context import DeviceContext
from rlhf.roles.actor import Actor
from tests.rlhf.test_grad_accumulation import parts  # noqa: F401  (the tiny double-precision policy, a fixture)

CPU = DeviceContext(torch.device("cpu"))
N, P, R = 8, 4, 3


def actor(parts, **ppo) -> Actor:
    tok, model = parts
    cfg = PPOConfig(rollout_micro_batch_size=N, num_rollout_batches=1, mini_batch_size=N, micro_batch_size=N,
                    ppo_epochs=1, actor_learning_rate=1e-3, entropy_coef=0.0, max_grad_norm=1e6, **ppo)
    return Actor(CPU, cfg, start_dir="", tokenizer_dir="", total_updates=1, model=copy.deepcopy(model), tokenizer=tok)


def rollout(tok) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch({"prompt_ids": torch.randint(4, len(tok), (N, P), generator=g),
                  "prompt_mask": torch.ones(N, P, dtype=torch.long),
                  "response_ids": torch.randint(4, len(tok), (N, R), generator=g),
                  "response_mask": torch.ones(N, R, dtype=torch.long)})


def test_one_update_raises_positive_and_lowers_negative_advantage_tokens(parts):
    """Half the sequences +1, half -1, on-policy ratios (old log-probs = the policy's): after one
    step every token's log-prob moved the way its advantage says."""
    a = actor(parts)
    batch = rollout(parts[0])
    before, _ = a.compute_logprobs(batch)
    sign = torch.tensor([1.0, -1.0] * (N // 2))[:, None].expand(N, R)
    batch["old_logprobs"] = before
    batch["advantages"] = sign.clone()
    a.update(batch, shuffle_seed=0, kl_coef=0.0)
    moved = a.compute_logprobs(batch)[0] - before
    assert (moved[sign > 0] > 0).all() and (moved[sign < 0] < 0).all(), moved


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_a_kl_loss_pulls_toward_the_reference_and_the_reward_mode_adds_none(parts, estimator):
    """Zero advantages, no entropy bonus: the only gradient is kl_coef x KL in the loss. With k1
    (mean log r) every sampled token's log-prob falls; with k3 each token moves toward the
    reference (up where the reference is likelier, down where it is less likely). With the KL in
    the reward (kl_mode 'reward') the same update changes no weight."""
    batch = rollout(parts[0])
    reference_higher = torch.tensor([1.0, -1.0] * (N // 2))[:, None].expand(N, R)
    a = actor(parts, kl_mode="loss", kl_estimator=estimator)
    before, _ = a.compute_logprobs(batch)
    batch["old_logprobs"] = before
    batch["advantages"] = torch.zeros(N, R)
    batch["ref_logprobs"] = before + 0.5 * reference_higher
    a.update(batch, shuffle_seed=0, kl_coef=0.5)
    moved = a.compute_logprobs(batch)[0] - before
    if estimator == "k1":
        assert (moved < 0).all(), moved
    else:
        assert (moved[reference_higher > 0] > 0).all() and (moved[reference_higher < 0] < 0).all(), moved
    in_reward = actor(parts, kl_mode="reward", kl_estimator=estimator)
    weights = [p.detach().clone() for p in in_reward.model.parameters()]
    in_reward.update(batch, shuffle_seed=0, kl_coef=0.5)
    assert all(torch.equal(w, p) for w, p in zip(weights, in_reward.model.parameters()))

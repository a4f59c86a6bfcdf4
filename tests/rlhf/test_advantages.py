"""Every branch of the advantage computation against numbers worked out by hand: the KL in the
reward or in the loss, each KL estimator, the adaptive coefficient, GAE with the config's gamma and
lambda, GRPO with and without its std, whitening, the reward model's normalisation and clipping,
and responses that end at an EOS inside the limit or run to it. Each docstring shows the sums."""

from __future__ import annotations

import math
import types

import pytest
import torch

from rlhf import algos
from rlhf.batch import Batch
from rlhf.config import PPOConfig, RewardConfig, TaskConfig
from rlhf.rewards import RewardCombiner
from rlhf.rollout.base import response_mask_from_ids
from rlhf.trainer import PPOTrainer

T = lambda rows: torch.tensor(rows, dtype=torch.float32)  # noqa: E731
GAE = dict(gamma=0.9, lam=0.8, whiten_advantages=False)
GRPO = dict(adv_estimator="grpo", samples_per_prompt=2, whiten_advantages=False)


def advantages(ppo: PPOConfig, *, scores, mask, values=None, logprobs=None, ref_logprobs=None, group_ids=None,
               kl_coef=None) -> algos.Advantages:
    mask = T(mask)
    kl = algos.token_kl(None if logprobs is None else T(logprobs), None if ref_logprobs is None else T(ref_logprobs),
                        mask, ppo.kl_estimator)
    return algos.compute_advantages(scores=T(scores), mask=mask, values=None if values is None else T(values),
                                    group_ids=torch.tensor(group_ids or list(range(len(scores)))), kl=kl,
                                    kl_coef=ppo.kl_coef if kl_coef is None else kl_coef, ppo=ppo)


def trainer(ppo: PPOConfig, kl_ctl) -> types.SimpleNamespace:
    """What `PPOTrainer.compute_advantages` reads of a trainer, without models: its config and KL controller."""
    t = types.SimpleNamespace(ppo=ppo, kl_ctl=kl_ctl, critic=None)
    t.token_kl = lambda b: PPOTrainer.token_kl(t, b)
    t.kl_metrics = lambda b: PPOTrainer.kl_metrics(t, b)
    return t


# Log-probs of 3 valid tokens and one of padding (garbage there): log r = 0.1, -0.2, 0.3.
LOGP = [[-1.0, -2.0, -0.5, 0.0]]
REF = [[-1.1, -1.8, -0.8, 5.0]]
MASK = [[1, 1, 1, 0]]
VALUES = [[0.5, 0.4, 0.3, 9.0]]


def test_kl_in_the_reward_gae_by_hand():
    """k1 KL 0.1, -0.2, 0.3 at kl_coef 0.5; score 1: rewards -0.05, 0.1, -0.15 + 1 = 0.85.
    gamma 0.9, lambda 0.8: deltas -0.05 + 0.36 - 0.5 = -0.19, 0.1 + 0.27 - 0.4 = -0.03, 0.85 - 0.3 = 0.55;
    A2 = 0.55, A1 = -0.03 + 0.72 x 0.55 = 0.366, A0 = -0.19 + 0.72 x 0.366 = 0.07352; returns A + V."""
    out = advantages(PPOConfig(kl_coef=0.5, **GAE), scores=[1.0], mask=MASK, values=VALUES, logprobs=LOGP,
                     ref_logprobs=REF)
    assert out.token_rewards.tolist()[0] == pytest.approx([-0.05, 0.1, 0.85, 0.0], abs=1e-6)
    assert out.advantages.tolist()[0] == pytest.approx([0.07352, 0.366, 0.55, 0.0], abs=1e-6)
    assert out.returns is not None and out.returns.tolist()[0] == pytest.approx([0.57352, 0.766, 0.85, 0.0], abs=1e-6)


def test_kl_in_the_loss_leaves_the_reward_alone():
    """kl_mode 'loss': rewards 0, 0, 1; deltas -0.14, -0.13, 0.7; A = 0.12928, 0.374, 0.7 (the KL
    goes to the actor's loss: tests/rlhf/test_update_direction.py)."""
    out = advantages(PPOConfig(kl_coef=0.5, kl_mode="loss", **GAE), scores=[1.0], mask=MASK, values=VALUES,
                     logprobs=LOGP, ref_logprobs=REF)
    assert out.token_rewards.tolist()[0] == pytest.approx([0.0, 0.0, 1.0, 0.0], abs=1e-6)
    assert out.advantages.tolist()[0] == pytest.approx([0.12928, 0.374, 0.7, 0.0], abs=1e-6)


@pytest.mark.parametrize("estimator, kl", [
    ("k1", [0.5, -1.0]),                                      # log r
    ("k2", [0.125, 0.5]),                                     # (log r)^2 / 2
    ("k3", [math.expm1(-0.5) + 0.5, math.expm1(1.0) - 1.0]),  # exp(-log r) - 1 + log r
])
def test_each_kl_estimator_in_the_reward(estimator, kl):
    """log r = 0.5, -1; kl_coef 1, score 0: each token's reward is minus its KL estimate."""
    ppo = PPOConfig(kl_coef=1.0, kl_estimator=estimator, **GAE)
    out = advantages(ppo, scores=[0.0], mask=[[1, 1]], values=[[0.0, 0.0]], logprobs=[[-1.0, -2.0]],
                     ref_logprobs=[[-1.5, -1.0]])
    assert out.token_rewards.tolist()[0] == pytest.approx([-k for k in kl], abs=1e-6)


def test_the_trainer_uses_its_estimator_and_its_adaptive_coefficient():
    """GRPO without std, one group of two, score 1 each; k2 KL per token 0.5 x 0.4^2 = 0.08 on
    row 0's two tokens, 0 on row 1's: sequence rewards 1 - 0.16 c and 1, advantages -/+ 0.08 c.
    The controller starts at c = 0.2; a KL of 0.1 against target 0.05 (error clipped to 0.2) over
    50 samples of a horizon of 100 makes it 0.2 x 1.1 = 0.22."""
    ppo = PPOConfig(kl_coef=0.2, kl_estimator="k2", adaptive_kl=True, kl_target=0.05, kl_horizon=100,
                    grpo_normalize_std=False, **GRPO)
    t = trainer(ppo, algos.AdaptiveKLController(ppo.kl_coef, ppo.kl_target, ppo.kl_horizon))
    batch = lambda: Batch({"response_mask": torch.ones(2, 2), "scores": T([1.0, 1.0]),  # noqa: E731
                           "group_ids": torch.tensor([0, 0]), "old_logprobs": T([[-1.0, -1.0], [-1.0, -1.0]]),
                           "ref_logprobs": T([[-1.4, -0.6], [-1.0, -1.0]])})
    first = batch()
    stats = PPOTrainer.compute_advantages(t, first)
    assert stats["kl_coef"] == pytest.approx(0.2) and stats["kl_divergence"] == pytest.approx(0.04)
    assert first["advantages"].tolist() == [pytest.approx([-0.016] * 2, abs=1e-6), pytest.approx([0.016] * 2, abs=1e-6)]
    t.kl_ctl.update(0.1, 50)
    second = batch()
    assert PPOTrainer.compute_advantages(t, second)["kl_coef"] == pytest.approx(0.22)
    assert second["advantages"][:, 0].tolist() == pytest.approx([-0.0176, 0.0176], abs=1e-6)


def test_gae_takes_the_configs_default_lambda():
    """The defaults gamma 1, lambda 0.95, no KL; score 1 at the last of 3 tokens, values 0.5, 0.4, 0.3:
    deltas -0.1, -0.1, 0.7; A2 = 0.7, A1 = -0.1 + 0.95 x 0.7 = 0.565, A0 = -0.1 + 0.95 x 0.565 = 0.43675
    (lambda 1 would give 0.5, 0.6, 0.7)."""
    out = advantages(PPOConfig(kl_coef=0.0, whiten_advantages=False), scores=[1.0], mask=MASK, values=VALUES)
    assert out.advantages.tolist()[0] == pytest.approx([0.43675, 0.565, 0.7, 0.0], abs=1e-6)


@pytest.mark.parametrize("normalize, expected", [
    # sequence rewards 1 - 0.5 x 0.2 = 0.9, 0, 0.5 - 0.5 x 0.4 = 0.3: mean 0.4, centred 0.5, -0.4, -0.1
    (False, [0.5, -0.4, -0.1, 0.0, 0.0]),
    # / the group's sample std sqrt((0.25 + 0.16 + 0.01) / 2) = sqrt(0.21); a tied group stays 0
    (True, [0.5 / math.sqrt(0.21), -0.4 / math.sqrt(0.21), -0.1 / math.sqrt(0.21), 0.0, 0.0]),
])
def test_grpo_with_the_kl_in_the_reward_with_and_without_std(normalize, expected):
    """Groups of 3 and 2; k1 KL 0.1 per token on row 0, 0 on row 1, 0.2 on row 2 (kl_coef 0.5)."""
    ppo = PPOConfig(kl_coef=0.5, grpo_normalize_std=normalize, **GRPO)
    logp = [[-1.0, -1.0]] * 5
    ref = [[-1.1, -1.1], [-1.0, -1.0], [-1.2, -1.2], [-1.0, -1.0], [-1.0, -1.0]]
    out = advantages(ppo, scores=[1.0, 0.0, 0.5, 0.7, 0.7], mask=[[1, 1]] * 4 + [[1, 0]], logprobs=logp,
                     ref_logprobs=ref, group_ids=[0, 0, 0, 1, 1])
    assert out.returns is None
    assert out.advantages[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert out.advantages[4, 1].item() == 0.0  # padding


def test_whitening_over_valid_tokens():
    """GRPO advantages 0.5, 0.5 (row 0) and -0.5 (row 1, one token): mean 1/6, sample variance
    (1/9 + 1/9 + 4/9) / 2 = 1/3, so whitened 1/sqrt(3), 1/sqrt(3), -2/sqrt(3); padding 0."""
    ppo = PPOConfig(**{**GRPO, "whiten_advantages": True}, grpo_normalize_std=False)
    out = advantages(ppo, scores=[1.0, 0.0], mask=[[1, 1], [1, 0]], group_ids=[0, 0])
    r = 1 / math.sqrt(3)
    assert out.advantages.tolist() == [pytest.approx([r, r], abs=1e-5), pytest.approx([-2 * r, 0.0], abs=1e-5)]


def test_an_eos_inside_the_limit_and_a_response_at_the_limit():
    """Ids [5, EOS, pad, pad] and [5, 6, 7, 8] (no EOS: cut at the limit) give masks 1100 and 1111;
    scores 1 and 2 land on the EOS and on the last token. Row 0 (garbage values after its EOS):
    deltas 0.36 - 0.5 = -0.14, 1 - 0.4 = 0.6 (nothing bootstrapped past the EOS): A = 0.292, 0.6.
    Row 1, values 0.1 .. 0.4: deltas 0.08, 0.07, 0.06, 1.6: A3 = 1.6, A2 = 1.212, A1 = 0.94264,
    A0 = 0.7587008."""
    eos, pad = 2, 0
    mask, finished = response_mask_from_ids(torch.tensor([[5, eos, pad, pad], [5, 6, 7, 8]]), eos)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and finished.tolist() == [True, False]
    out = advantages(PPOConfig(kl_coef=0.0, **GAE), scores=[1.0, 2.0], mask=mask.tolist(),
                     values=[[0.5, 0.4, 7.0, 7.0], [0.1, 0.2, 0.3, 0.4]])
    assert out.token_rewards.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]]
    assert out.advantages.tolist() == [pytest.approx([0.292, 0.6, 0.0, 0.0], abs=1e-6),
                                       pytest.approx([0.7587008, 0.94264, 1.212, 1.6], abs=1e-6)]


# ---------------------------------------------------------------- the reward model's score
def combiner(**reward) -> RewardCombiner:
    return RewardCombiner(TaskConfig(), RewardConfig(kind="model", model_path="rm", **reward))


def test_reward_model_score_batch_normalised_then_clipped():
    """Raw 1, 2, 3, 6: mean 3, population std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5); clipped to 1.5."""
    s = math.sqrt(3.5)
    raw = T([1.0, 2.0, 3.0, 6.0])
    assert combiner(normalize="batch").model_term(raw, update=True).tolist() == pytest.approx(
        [-2 / s, -1 / s, 0.0, 3 / s], abs=1e-5)
    assert combiner(normalize="batch", clip=1.5).model_term(raw, update=True).tolist() == pytest.approx(
        [-2 / s, -1 / s, 0.0, 1.5], abs=1e-5)
    assert combiner(clip=2.5).model_term(raw, update=True).tolist() == [1.0, 2.0, 2.5, 2.5]


def test_reward_model_score_running_normalisation_over_every_batch():
    """Batches 0, 2 then 4, 6: after the first the running mean is 1, std 1 (population): (x - 1) / 1;
    after the second mean 3, std sqrt(5): the second batch becomes 1/sqrt(5), 3/sqrt(5). Evaluation
    (update=False) reads the statistics without moving them."""
    c = combiner(normalize="running")
    assert c.model_term(T([0.0, 2.0]), update=True).tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert c.model_term(T([4.0, 6.0]), update=True).tolist() == pytest.approx([1 / math.sqrt(5), 3 / math.sqrt(5)],
                                                                              abs=1e-5)
    assert c.model_term(T([3.0]), update=False).tolist() == pytest.approx([0.0], abs=1e-5)
    assert (c.running.count, c.running.mean) == (4, pytest.approx(3.0))

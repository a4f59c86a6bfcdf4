"""PPO math as pure functions. Shapes: B = sequences, T = response tokens; `mask[b, t]` is 1 on
valid response tokens (up to and including EOS). Each function is tested against a naive loop
in tests/rlhf/test_algos.py; `compute_advantages`, every branch, against hand computations in
tests/rlhf/test_advantages.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x where mask is 1 (over all elements, or along `dim`)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked elements; masked-out positions are returned as 0."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(actor || reference) from samples of the actor, [B, T].

    k1: log r, with log r = logp - ref_logp (unbiased, can be negative);
    k2: (log r)^2 / 2 (biased, low variance);
    k3: (exp(-log r) - 1) + log r (unbiased, always >= 0; Schulman 2020).
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards: -kl_coef * KL at every valid token, plus the sequence score at the last
    valid token. scores [B], kl [B, T], mask [B, T] -> [B, T]."""
    rewards = -kl_coef * kl * mask
    last = (mask.long().cumsum(-1).argmax(-1))  # index of the last valid token
    has_token = mask.sum(-1) > 0
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows[has_token], last[has_token]] += scores[has_token].to(rewards.dtype)
    return rewards


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float, lam: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last valid token is 0);
    A_t = delta_t + gamma * lam * A_{t+1}. Returns (advantages, returns = A + V), both [B, T],
    zero where mask is 0. Assumes the mask is a prefix (valid tokens then padding)."""
    values = values * mask
    rewards = rewards * mask
    T = rewards.shape[1]
    last_gae = torch.zeros_like(rewards[:, 0])
    adv = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae * (mask[:, t + 1] if t + 1 < T else 0.0)
        adv[:, t] = last_gae
    adv = adv * mask
    return adv, (adv + values) * mask


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                    normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Critic-free, group-relative advantages: (score - mean of its group) [/ std of its group],
    broadcast over the sequence's valid tokens. scores [B], group_ids [B] -> [B, T]."""
    scores = scores.float()
    adv = torch.zeros_like(scores)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        group = scores[idx]
        centred = group - group.mean()
        if normalize_std:
            std = group.std(unbiased=True) if group.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + eps)
        adv[idx] = centred
    return adv[:, None] * mask


# ------------------------------------------------------------------ advantage estimators
@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads from a scored rollout: B sequences, T response tokens."""

    token_rewards: torch.Tensor
    """[B, T]: the sequence's score at its last valid token, minus kl_coef x KL at every token when
    the KL is in the reward (`ppo.kl_mode = 'reward'`; `token_rewards`)."""
    sequence_rewards: torch.Tensor
    """[B]: the score minus kl_coef x the sequence's summed KL (in the reward), else the score."""
    values: Optional[torch.Tensor]
    """[B, T]: the critic's values; None when the estimator uses no critic."""
    group_ids: torch.Tensor
    """[B]: the prompt each sequence answers (its `ppo.samples_per_prompt` samples share one)."""
    mask: torch.Tensor
    """[B, T]: 1 on valid response tokens."""


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """One value of `ppo.adv_estimator`: what the engine builds for it and how it computes
    advantages. The config's choices, whether a critic is built, trained, checkpointed and counted
    in the memory plan, and the rollout's group size all read this entry."""

    compute: Callable[[AdvantageInputs, Any], Tuple[torch.Tensor, Optional[torch.Tensor]]]
    """(inputs, ppo) -> (advantages [B, T], returns [B, T] for the critic, or None without one)."""
    uses_critic: bool
    """A value model is built and trained beside the policy; `inputs.values` holds its values."""
    min_samples_per_prompt: int = 1
    """The fewest `ppo.samples_per_prompt` it accepts (a group baseline needs a group of 2)."""


def _gae(inputs: AdvantageInputs, ppo) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """GAE on the critic's values, with `ppo.gamma` and `ppo.lam`."""
    assert inputs.values is not None, "GAE needs the critic's values"
    return gae_advantages(inputs.token_rewards, inputs.values, inputs.mask, ppo.gamma, ppo.lam)


def _grpo(inputs: AdvantageInputs, ppo) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Group-relative: each sequence's reward against its prompt's group (`ppo.grpo_normalize_std`)."""
    return grpo_advantages(inputs.sequence_rewards, inputs.group_ids, inputs.mask, ppo.grpo_normalize_std), None


ADVANTAGE_ESTIMATORS: Dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(_gae, uses_critic=True),
    "grpo": AdvantageEstimator(_grpo, uses_critic=False, min_samples_per_prompt=2),
}
"""`ppo.adv_estimator` name -> its estimator. A new estimator is one entry here (a pure function
of `AdvantageInputs` and its test in tests/rlhf/test_algos.py); the config, the trainer, the roles
and the memory plan read what they need from the entry."""


def token_kl(logprobs: Optional[torch.Tensor], ref_logprobs: Optional[torch.Tensor], mask: torch.Tensor,
             estimator: str) -> torch.Tensor:
    """KL(actor || reference) per response token, [B, T] (0 on padding), by `estimator`
    (`kl_penalty`) from the actor's log-probs of the sampled tokens; zeros while there are none (an
    on-policy update computes them, and its KL is not in the reward)."""
    if logprobs is None or ref_logprobs is None:
        return torch.zeros_like(mask)
    return kl_penalty(logprobs, ref_logprobs, estimator) * mask


@dataclasses.dataclass(frozen=True)
class Advantages:
    """What `compute_advantages` gives the update: B sequences, T response tokens."""

    advantages: torch.Tensor
    """[B, T]: the estimator's advantages (whitened when `ppo.whiten_advantages`), 0 on padding."""
    returns: Optional[torch.Tensor]
    """[B, T]: the critic's targets, or None for an estimator without a critic."""
    token_rewards: torch.Tensor
    """[B, T]: the rewards the estimator read (`AdvantageInputs.token_rewards`)."""


def compute_advantages(*, scores: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                       values: Optional[torch.Tensor], kl: torch.Tensor, kl_coef: float, ppo) -> Advantages:
    """The rewards and advantages of one scored rollout under `ppo` (a `PPOConfig`).

    scores [B]: each sequence's reward; mask [B, T]: 1 on valid response tokens (float);
    group_ids [B]: the prompt each sequence answers; values [B, T]: the critic's, or None;
    kl [B, T]: `token_kl` under `ppo.kl_estimator`; kl_coef: this step's coefficient (adapted
    when `ppo.adaptive_kl`). With `ppo.kl_mode = 'reward'` every token's reward is -kl_coef x its
    KL and the sequence's score lands on its last valid token (`token_rewards`); with 'loss' the
    KL is left to the actor's loss. The advantages are `ppo.adv_estimator`'s
    (`ADVANTAGE_ESTIMATORS`), then whitened over valid tokens when `ppo.whiten_advantages`."""
    reward_kl = kl if ppo.kl_mode == "reward" else torch.zeros_like(kl)
    rewards = token_rewards(scores, reward_kl, mask, kl_coef)
    inputs = AdvantageInputs(token_rewards=rewards, sequence_rewards=scores - kl_coef * reward_kl.sum(-1),
                             values=values, group_ids=group_ids, mask=mask)
    adv, returns = ppo.estimator.compute(inputs, ppo)
    if ppo.whiten_advantages:
        adv = masked_whiten(adv, mask)
    return Advantages(advantages=adv, returns=returns, token_rewards=rewards)


def aggregate(loss_per_token: torch.Tensor, mask: torch.Tensor, mode: str,
              normalizer: float | None = None) -> torch.Tensor:
    """Reduces a [B, T] loss. token_mean: sum over valid tokens / token count; seq_mean: sum of
    per-sequence means / sequence count. With gradient accumulation, pass the whole mini-batch's
    count as `normalizer` so that the micro-batch losses add up to the mini-batch loss."""
    if mode == "token_mean":
        denom = mask.sum().clamp(min=1) if normalizer is None else normalizer
        return masked_sum(loss_per_token, mask) / denom
    if mode == "seq_mean":
        valid = mask.sum(-1) > 0
        per_seq = masked_mean(loss_per_token, mask, dim=-1) * valid
        denom = valid.sum().clamp(min=1) if normalizer is None else normalizer
        return per_seq.sum() / denom
    raise ValueError(f"unknown loss aggregation {mode!r}")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_range: float, dual_clip: float = 0.0,
                aggregation: str = "token_mean", normalizer: float | None = None
                ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped surrogate: max(-A r, -A clip(r, 1-c, 1+c)), optionally dual-clipped at -A * dual_clip
    for A < 0. Returns (loss, stats). Clip fractions follow the tuning guide's reading of the ratio
    histogram: lower = share of tokens with r < 1-c, upper = r > 1+c, clip_fraction = their sum;
    `pg_clipfrac` is the share where the clip is active (the token's gradient is cut)."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(loss1, loss2)
    if dual_clip > 1.0:
        loss3 = -advantages * dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
    with torch.no_grad():
        lower = (ratio < 1.0 - clip_range).float()
        upper = (ratio > 1.0 + clip_range).float()
        stats = {
            "clip_fraction": masked_mean(lower + upper, mask),
            "clip_fraction_lower": masked_mean(lower, mask),
            "clip_fraction_upper": masked_mean(upper, mask),
            "pg_clipfrac": masked_mean((loss2 > loss1).float(), mask),
            "approx_kl": masked_mean(0.5 * log_ratio.square(), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
        if dual_clip > 1.0:
            stats["dual_clip_fraction"] = masked_mean(((advantages < 0) & (loss1 > loss3)).float(), mask)
    return aggregate(loss, mask, aggregation, normalizer), stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float, aggregation: str = "token_mean", normalizer: float | None = None
               ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2); no clipping when clip_range is 0."""
    unclipped = (values - returns).square()
    if clip_range > 0:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        loss = 0.5 * torch.maximum(unclipped, clipped)
        frac = masked_mean((clipped > unclipped).float(), mask).detach()
    else:
        loss = 0.5 * unclipped
        frac = torch.zeros(())
    return aggregate(loss, mask, aggregation, normalizer), {"value_clip_fraction": frac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution per position: logits [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens) under logits: [B, T, V], [B, T] -> [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens (1 is perfect, <= 0 is no better than a constant)."""
    var_r = masked_var(returns, mask)
    return 1.0 - masked_var(returns - values, mask) / var_r.clamp(min=1e-8)


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_samples: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Ziegler et al. (2019): proportional error clipped to +-0.2, scaled by n / horizon."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]

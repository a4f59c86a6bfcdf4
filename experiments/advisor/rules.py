"""The rules of the tuning guide (docs/tuning_guide.md) as declared objects: each reads a `Window`
and proposes one change.

Each rule is a frozen dataclass whose fields are the guide's thresholds and steps (base.py says
what a rule is and returns). `RULES` lists every rule the advisor applies: the guide's, in the
guide's order, then those on signals the guide does not read (drift.py: entropy collapse and
blow-up, over-optimisation of the reward model against held-out gold).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional, Tuple

import numpy as np

from experiments.advisor.drift import EntropyBlowUp, EntropyCollapse, OverOptimisation
from experiments.advisor.rule_api import (
    GROUPS,
    GUIDE_KL_STEP,
    HEALTH,
    STABILITY,
    THROUGHPUT,
    KLScaling,
    Rule,
    Suggestion,
    excess,
    reward_trend,
    significant,
)
from experiments.advisor.window import Window

__all__ = ["GROUPS", "HEALTH", "RULES", "STABILITY", "THROUGHPUT", "Rule", "Suggestion", "reward_trend",
           "significant"]

# ------------------------------------------------------------------------------------------ KL
@dataclasses.dataclass(frozen=True)
class KLTooHigh(KLScaling, Rule):
    """KL above the healthy band: the policy drifts from the reference (reward hacking risk)."""

    name: ClassVar[str] = "kl_high"
    reads: ClassVar[Tuple[str, ...]] = ("kl_divergence", "reward_mean")
    parameter: ClassVar[str] = "ppo.kl_coef"
    rationale: ClassVar[str] = ("KL above the healthy 0.03-0.08 band: the policy drifts from the reference; "
                                "a larger kl_coef holds it closer")
    kl_max: float = 0.15
    """Mean KL above this raises kl_coef on its own (the guide's 0.15)."""
    band_high: float = 0.08
    """Mean KL above the healthy band's top (0.08) raises kl_coef when the reward also swings."""
    swing_std: float = 0.1
    """Detrended std of reward_mean above which the reward 'swings' (ours: the guide gives no number)."""
    factor: float = GUIDE_KL_STEP
    """The guide's step: kl_coef 0.1 -> 0.12."""

    def check(self, window):
        kl = window.mean("kl_divergence")
        if kl is None:
            return None
        trend = reward_trend(window)
        swing = math.sqrt(trend[2]) if trend else 0.0
        if kl > self.kl_max:
            severity = excess(kl, self.kl_max)
        elif kl > self.band_high and swing > self.swing_std:
            severity = excess(kl, self.band_high) * 0.5
        else:
            return None
        return self._suggest(window, significant(window.param(self.parameter, 0) * self.factor),
                             {"kl_divergence": kl, "reward_swing_std": swing, "kl_max": self.kl_max,
                              "band_high": self.band_high}, severity)


@dataclasses.dataclass(frozen=True)
class KLTooLow(KLScaling, Rule):
    """KL near zero while the reward stalls: the KL penalty holds the policy too stiffly."""

    name: ClassVar[str] = "kl_low"
    group: ClassVar[str] = THROUGHPUT  # the guide's round 3: "reward slow -> kl_coef 0.08"
    reads: ClassVar[Tuple[str, ...]] = ("kl_divergence", "reward_mean")
    parameter: ClassVar[str] = "ppo.kl_coef"
    rationale: ClassVar[str] = ("KL below 0.01 with reward stalled: the policy cannot move away from the "
                                "reference; a smaller kl_coef frees it")
    kl_min: float = 0.01
    """The guide's floor."""
    stall_p: float = 0.05
    """The reward 'stalls' when an upward trend over the window is not significant at this level."""
    factor: float = 0.8
    """The guide's late step: kl_coef 0.1 -> 0.08."""

    def check(self, window):
        kl, trend = window.mean("kl_divergence"), reward_trend(window)
        if kl is None or trend is None or kl >= self.kl_min or trend[1] < self.stall_p:
            return None
        return self._suggest(window, significant(window.param(self.parameter, 0) * self.factor),
                             {"kl_divergence": kl, "reward_rise": trend[0], "reward_trend_p": trend[1],
                              "kl_min": self.kl_min}, excess(kl, self.kl_min, above=False))


# ---------------------------------------------------------------------------------- clipping
@dataclasses.dataclass(frozen=True)
class ClipTooMany(Rule):
    """Too many ratios clipped: updates are cut short, clip_range is too small."""

    name: ClassVar[str] = "clip_high"
    reads: ClassVar[Tuple[str, ...]] = ("clip_fraction", "clip_fraction_lower", "clip_fraction_upper")
    parameter: ClassVar[str] = "ppo.clip_range"
    rationale: ClassVar[str] = ("more than 40% of ratios clipped (healthy: ~20% low, ~10% high): clip_range "
                                "is too small")
    max_clipped: float = 0.40
    factor: float = 1.2
    """The guide's step: clip_range 0.1 -> 0.12."""

    def check(self, window):
        clipped = window.mean("clip_fraction")
        if clipped is None or clipped <= self.max_clipped:
            return None
        return self._suggest(window, significant(window.param(self.parameter, 0) * self.factor),
                             {"clip_fraction": clipped, "clip_fraction_lower": window.mean("clip_fraction_lower"),
                              "clip_fraction_upper": window.mean("clip_fraction_upper"),
                              "max_clipped": self.max_clipped}, excess(clipped, self.max_clipped))


@dataclasses.dataclass(frozen=True)
class ClipTooFew(Rule):
    """Almost no ratio clipped: the clip never binds, clip_range is too large to protect updates."""

    name: ClassVar[str] = "clip_low"
    reads: ClassVar[Tuple[str, ...]] = ("clip_fraction",)
    parameter: ClassVar[str] = "ppo.clip_range"
    rationale: ClassVar[str] = "fewer than 5% of ratios clipped: clip_range is too large to bound the update"
    min_clipped: float = 0.05
    factor: float = 0.8
    """The inverse of the guide's 1.2 step, rounded."""

    def check(self, window):
        clipped = window.mean("clip_fraction")
        if clipped is None or clipped >= self.min_clipped:
            return None
        return self._suggest(window, significant(window.param(self.parameter, 0) * self.factor),
                             {"clip_fraction": clipped, "min_clipped": self.min_clipped},
                             excess(clipped, self.min_clipped, above=False))


# ---------------------------------------------------------------------------- learning rates
@dataclasses.dataclass(frozen=True)
class RewardVariance(Rule):
    """Reward swings step to step: the actor's steps are too large."""

    name: ClassVar[str] = "reward_variance"
    reads: ClassVar[Tuple[str, ...]] = ("reward_mean",)
    parameter: ClassVar[str] = "ppo.actor_learning_rate"
    rationale: ClassVar[str] = "reward_mean swings around its trend: the actor learning rate is too high"
    max_variance: float = 0.3
    """The guide's: reward variance (here: around the window's linear trend, per seed) > 0.3."""
    factor: float = 0.75
    """The guide's step: actor LR 2e-6 -> 1.5e-6."""

    def check(self, window):
        trend = reward_trend(window)
        if trend is None or trend[2] <= self.max_variance:
            return None
        return self._suggest(window, significant(window.param(self.parameter, 0) * self.factor),
                             {"reward_variance": trend[2], "max_variance": self.max_variance},
                             excess(trend[2], self.max_variance))


@dataclasses.dataclass(frozen=True)
class RewardSawtooth(Rule):
    """Reward rises then crashes: the actor overshoots."""

    name: ClassVar[str] = "reward_sawtooth"
    reads: ClassVar[Tuple[str, ...]] = ("reward_mean",)
    parameter: ClassVar[str] = "ppo.actor_learning_rate"
    rationale: ClassVar[str] = "reward_mean rises then crashes (sawtooth): the actor learning rate is too high"
    crash_fraction: float = 0.5
    """A crash gives back at least this share of the rise before it (ours)."""
    min_crash_noise: float = 4.0
    """... and exceeds this many noise standard deviations of the smoothed curve (ours)."""
    smooth: int = 5
    """Moving-average width (steps) before peaks are read."""
    factor: float = 0.75

    def _seed(self, curve: np.ndarray) -> Optional[Tuple[float, float]]:
        if len(curve) < 3 * self.smooth:
            return None
        smooth = np.convolve(curve, np.ones(self.smooth) / self.smooth, mode="valid")
        noise = np.std(np.diff(curve)) / math.sqrt(2) / math.sqrt(self.smooth)
        peak = int(np.argmax(smooth))
        rise, crash = smooth[peak] - smooth[:peak + 1].min(), smooth[peak] - smooth[peak:].min()
        if rise > 0 and crash >= self.crash_fraction * rise and crash > self.min_crash_noise * noise:
            return float(rise), float(crash)
        return None

    def check(self, window):
        curves = window.seed_curves("reward_mean")
        hits = [h for h in (self._seed(c) for c in curves) if h]
        if not curves or len(hits) * 2 < len(curves):  # a majority of seeds must show it
            return None
        rise, crash = float(np.mean([h[0] for h in hits])), float(np.mean([h[1] for h in hits]))
        return self._suggest(window, significant(window.param(self.parameter, 0) * self.factor),
                             {"seeds_with_sawtooth": len(hits), "seeds": len(curves), "rise": rise, "crash": crash},
                             crash / max(rise, 1e-12))


@dataclasses.dataclass(frozen=True)
class FlatReward(Rule):
    """Reward flat for long: the critic learns too slowly to give the actor useful advantages."""

    name: ClassVar[str] = "reward_flat"
    group: ClassVar[str] = THROUGHPUT
    reads: ClassVar[Tuple[str, ...]] = ("reward_mean", "critic/explained_variance")
    parameter: ClassVar[str] = "ppo.critic_learning_rate"
    rationale: ClassVar[str] = ("reward_mean flat for long: the critic learns too slowly; raise its learning "
                                "rate, never above 3x the actor's")
    stall_p: float = 0.05
    min_steps: int = 20
    """'For long': at least this many steps in the window."""
    factor: float = 1.5
    max_ratio: float = 3.0
    """The guide's ceiling: critic LR <= 3x actor LR."""

    def check(self, window):
        trend = reward_trend(window)
        actor, critic = window.param("ppo.actor_learning_rate"), window.param(self.parameter)
        if trend is None or trend[1] < self.stall_p or len(window.steps) < self.min_steps or not actor or not critic:
            return None
        proposed = significant(min(critic * self.factor, actor * self.max_ratio))
        if proposed <= critic:
            return None  # already at the guide's ceiling: raising it is not allowed
        return self._suggest(window, proposed, {"reward_rise": trend[0], "reward_trend_p": trend[1],
                                                "steps": len(window.steps),
                                                "critic_explained_variance": window.mean("critic/explained_variance"),
                                                "critic_to_actor_lr": critic / actor},
                             (trend[1] - self.stall_p) / (1 - self.stall_p) + 1e-6)


# ---------------------------------------------------------------------------------- throughput
@dataclasses.dataclass(frozen=True)
class ResponseLength(Rule):
    """The response budget against what the answers use: far shorter than the maximum wastes memory
    and time on tokens never generated (lower it, the guide's rule); many responses cut at the
    maximum (`response_clip_ratio`) are answers the budget truncates (raise it)."""

    name: ClassVar[str] = "response_length"
    group: ClassVar[str] = THROUGHPUT
    reads: ClassVar[Tuple[str, ...]] = ("response_length_mean", "response_clip_ratio")
    parameter: ClassVar[str] = "ppo.max_response_length"
    rationale: ClassVar[str] = ("response_length_mean below 60% of max_response_length: the unused length "
                                "costs memory (~quadratic) and time; lower it, keeping room for the longest answers")
    raise_rationale: ClassVar[str] = ("more responses cut at max_response_length than the guide's success rate "
                                      "allows (a cut response is a failed rollout): the budget truncates answers; "
                                      "raise it (memory grows ~quadratically with the length)")
    max_fraction: float = 0.6
    margin: float = 0.5
    """New max = the longest observed mean length x (1 + margin), rounded up (ours)."""
    max_clip_ratio: float = 0.01
    """Not lowered when more responses than this hit the max: they need it."""
    max_clipped: float = 0.05
    """Raised when more responses than this are cut at the max: a cut response is not a successful
    rollout, and the guide's rollout_success_rate > 0.95 leaves 5% for every failure together."""
    raise_factor: float = 1.5
    """The raise, rounded up (ours: the guide's budgets step 512 -> 768 from dialog to code, x1.5)."""

    def check(self, window):
        mean, current = window.mean("response_length_mean"), window.param(self.parameter)
        clipped = window.mean("response_clip_ratio")
        if current and clipped is not None and clipped > self.max_clipped:
            return self._suggest(window, int(math.ceil(current * self.raise_factor)),
                                 {"response_clip_ratio": clipped, "max_clipped": self.max_clipped,
                                  "response_length_mean": mean}, excess(clipped, self.max_clipped),
                                 rationale=self.raise_rationale)
        if mean is None or not current or mean >= self.max_fraction * current:
            return None
        clipped = clipped or 0.0
        if clipped > self.max_clip_ratio:
            return None
        longest = max(v for v in (window.max("response_length_max"), window.max("response_length_mean")) if v)
        proposed = int(math.ceil(longest * (1 + self.margin)))
        if proposed >= current:
            return None
        return self._suggest(window, proposed, {"response_length_mean": mean, "longest_mean": longest,
                                                "fraction_of_max": mean / current, "response_clip_ratio": clipped},
                             excess(mean / current, self.max_fraction, above=False))


def valid_micro_batch(target: int, window: Window, up: bool) -> Optional[int]:
    """The nearest rollout_micro_batch_size at or beyond `target` in the change's direction that keeps
    the engine's rule valid: mini_batch_size divides micro x num_rollout_batches x samples_per_prompt."""
    current = int(window.param("ppo.rollout_micro_batch_size"))
    factor = int(window.param("ppo.num_rollout_batches", 1)) * int(window.param("ppo.samples_per_prompt", 1))
    mini = window.param("ppo.mini_batch_size")
    candidates = range(max(target, current + 1), 4 * max(target, current) + 1) if up else \
        range(min(target, current - 1), 0, -1)
    return next((v for v in candidates if not mini or (v * factor) % int(mini) == 0), None)


@dataclasses.dataclass(frozen=True)
class GpuMemory(Rule):
    """Peak GPU memory outside the target band: rollouts too small (waste) or too large (OOM risk)."""

    name: ClassVar[str] = "gpu_memory"
    group: ClassVar[str] = THROUGHPUT
    reads: ClassVar[Tuple[str, ...]] = ("perf/max_memory_allocated_gb",)
    parameter: ClassVar[str] = "ppo.rollout_micro_batch_size"
    rationale: ClassVar[str] = ("peak GPU memory outside the 85-92% target: adjust rollout_micro_batch_size "
                                "first (mini_batch_size divisibility kept)")
    low: float = 0.85
    high: float = 0.92
    max_factor: float = 1.5
    """At most the guide's 16 -> 24 per round: memory is not linear in the batch (weights are fixed)."""
    device_memory_gb: Optional[float] = None
    """The device's total memory; default: what the run recorded (silent when unknown)."""

    def check(self, window):
        peak, total = window.max("perf/max_memory_allocated_gb"), self.device_memory_gb or window.device_memory_gb
        current = window.param(self.parameter)
        if peak is None or not total or not current:
            return None
        used = peak / total
        if self.low <= used <= self.high:
            return None
        factor = min(max((self.low + self.high) / 2 / used, 1 / self.max_factor), self.max_factor)
        up = used < self.low
        target = int(math.ceil(current * factor)) if up else max(1, int(math.floor(current * factor)))
        severity = excess(used, self.low, above=False) if up else excess(used, self.high)
        return self._suggest(window, valid_micro_batch(target, window, up),
                             {"peak_memory_gb": peak, "device_memory_gb": total, "memory_fraction": used}, severity)


@dataclasses.dataclass(frozen=True)
class GpuUtilisation(Rule):
    """GPU busy less than the guide's 80%: sampling calls too small to fill it."""

    name: ClassVar[str] = "gpu_utilization"
    group: ClassVar[str] = THROUGHPUT
    reads: ClassVar[Tuple[str, ...]] = ("perf/gpu_utilization",)
    parameter: ClassVar[str] = "ppo.rollout_micro_batch_size"
    rationale: ClassVar[str] = "GPU utilisation below 80%: larger sampling calls (rollout_micro_batch_size)"
    min_utilization: float = 0.80
    factor: float = 1.5
    """The guide's step: 16 -> 24."""

    def check(self, window):
        util, current = window.mean("perf/gpu_utilization"), window.param(self.parameter)
        if util is None or not current:
            return None
        util = util / 100 if util > 1.0 else util  # percent or fraction
        if util >= self.min_utilization:
            return None
        return self._suggest(window, valid_micro_batch(int(math.ceil(current * self.factor)), window, True),
                             {"gpu_utilization": util}, excess(util, self.min_utilization, above=False))


# ---------------------------------------------------------------------------------- health
@dataclasses.dataclass(frozen=True)
class RolloutSuccess(Rule):
    """Too many failed rollouts (truncated or malformed): a flag, since no single knob fixes it."""

    name: ClassVar[str] = "rollout_success"
    group: ClassVar[str] = HEALTH
    reads: ClassVar[Tuple[str, ...]] = ("rollout_success_rate",)
    rationale: ClassVar[str] = ("rollout_success_rate must stay above 0.95: inspect failed samples (lengths, "
                                "format, reward errors) before tuning further")
    min_rate: float = 0.95

    def check(self, window):
        rate = window.mean("rollout_success_rate")
        if rate is None or rate >= self.min_rate:
            return None
        return Suggestion(self.name, self.group, None, None, None, self.rationale,
                          {"rollout_success_rate": significant(rate, 4), "min_rate": self.min_rate},
                          excess(rate, self.min_rate, above=False))


RULES: Tuple[Rule, ...] = (KLTooHigh(), KLTooLow(), ClipTooMany(), ClipTooFew(), RewardVariance(),
                           RewardSawtooth(), FlatReward(), ResponseLength(), GpuMemory(), GpuUtilisation(),
                           RolloutSuccess(), OverOptimisation(), EntropyCollapse(), EntropyBlowUp())
"""Every rule with its defaults: the guide's, in the guide's order, then drift.py's."""

"""The tuning guide's rules as declared objects: each reads a `Window` and proposes one change.

A rule is a frozen dataclass: its fields are its thresholds and step sizes (defaults: the guide's
numbers, in /shared/TUNING_GUIDE.md terms; where the guide gives no number the default is ours
and the field's docstring says so), its class attributes say what it reads and which round of
the guide it belongs to (`kl_and_clip`: round 2; `throughput_and_quality`: round 3; `health`:
flags, every round). `check(window)` returns a `Suggestion`
(ONE single-parameter change with its size, the guide's rationale and the numbers that
triggered it) or None when its condition does not hold or its metrics were not logged: a rule
never guesses from missing data.

Trends are judged per seed and averaged, never on the seed-mean curve alone, because seeds that
swing out of phase average into a flat line.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Dict, Optional, Tuple

import numpy as np
from scipy import stats

from experiments.advisor.window import Window

STABILITY, THROUGHPUT, HEALTH = "kl_and_clip", "throughput_and_quality", "health"
GROUPS = (STABILITY, THROUGHPUT, HEALTH)
"""The guide's rounds: 2 (KL and clip: KL, clipping, actor LR) and 3 (throughput and quality: lengths,
batch sizes, and a reward that slows late: kl_coef down, critic LR up); flags belong to every round."""


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One proposed single-parameter change (or, with parameter None, a flag that proposes none)."""

    rule: str
    group: str
    parameter: Optional[str]
    current: object
    proposed: object
    rationale: str
    evidence: Dict[str, float]
    severity: float
    """How far past its threshold the evidence is, relative to the threshold (ranks suggestions)."""

    @property
    def is_warning(self) -> bool:
        return self.parameter is None

    @property
    def binding(self) -> str:
        return f"{self.parameter} = {self.proposed!r}"

    @property
    def variant_name(self) -> str:
        """'kl_coef_up', 'max_response_length_down': names a results folder."""
        short = self.parameter.split(".", 1)[-1]
        return f"{short}_{'up' if self.proposed > self.current else 'down'}"

    @property
    def change(self) -> str:
        if self.is_warning:
            return "no change (flag)"
        ratio = f" (x{self.proposed / self.current:.3g})" if self.current else ""
        return f"{self.parameter}: {self.current!r} -> {self.proposed!r}{ratio}"

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "change": self.change,
                "binding": None if self.is_warning else self.binding}


def significant(x: float, digits: int = 3) -> float:
    """x rounded to `digits` significant digits, so a written recipe reads 0.06, not 0.060000001."""
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


def _excess(value: float, threshold: float, above: bool = True) -> float:
    """Relative distance past a threshold: the ranking score."""
    if threshold == 0:
        return abs(value)
    return max((value - threshold) / abs(threshold) if above else (threshold - value) / abs(threshold), 1e-6)


def reward_trend(window: Window) -> Optional[Tuple[float, float, float]]:
    """(mean rise over the window, one-sided p of an upward slope, detrended reward variance),
    per seed by linear regression (scipy.stats.linregress), rise/variance averaged over seeds and
    p from the seeds' combined evidence (Stouffer); None with fewer than 5 steps."""
    curves = [c for c in window.seed_curves("reward_mean") if len(c) >= 5]
    if not curves:
        return None
    rises, zs, variances = [], [], []
    for c in curves:
        x = np.arange(len(c), dtype=float)
        fit = stats.linregress(x, c)
        rises.append(fit.slope * (len(c) - 1))
        residual = c - (fit.intercept + fit.slope * x)
        variances.append(float(np.var(residual, ddof=2)))
        if fit.stderr > 0:
            t = fit.slope / fit.stderr
            zs.append(stats.norm.isf(stats.t.sf(t, len(c) - 2)))
        else:
            zs.append(math.copysign(8.0, fit.slope) if fit.slope else 0.0)
    z = float(np.sum(zs) / math.sqrt(len(zs)))
    return float(np.mean(rises)), float(stats.norm.sf(z)), float(np.mean(variances))


@dataclasses.dataclass(frozen=True)
class Rule:
    """Base: subclasses declare `name`, `reads`, `group`, `rationale` and their thresholds."""

    name: ClassVar[str] = ""
    reads: ClassVar[Tuple[str, ...]] = ()
    group: ClassVar[str] = STABILITY
    parameter: ClassVar[Optional[str]] = None
    rationale: ClassVar[str] = ""

    def check(self, window: Window) -> Optional[Suggestion]:
        raise NotImplementedError

    def _suggest(self, window: Window, proposed, evidence: Dict[str, float], severity: float,
                 rationale: str = "") -> Optional[Suggestion]:
        current = window.param(self.parameter)
        if self.parameter is not None:
            if current is None or proposed is None or proposed == current:
                return None
        evidence = {k: (significant(float(v), 4) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                    for k, v in evidence.items()}
        return Suggestion(self.name, self.group, self.parameter, current, proposed,
                          rationale or self.rationale, evidence, float(severity))


# ------------------------------------------------------------------------------------------ KL
@dataclasses.dataclass(frozen=True)
class KLTooHigh(Rule):
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
    factor: float = 1.2
    """The guide's step: kl_coef 0.1 -> 0.12."""

    def check(self, window):
        kl = window.mean("kl_divergence")
        if kl is None:
            return None
        trend = reward_trend(window)
        swing = math.sqrt(trend[2]) if trend else 0.0
        if kl > self.kl_max:
            severity = _excess(kl, self.kl_max)
        elif kl > self.band_high and swing > self.swing_std:
            severity = _excess(kl, self.band_high) * 0.5
        else:
            return None
        return self._suggest(window, significant(window.param(self.parameter, 0) * self.factor),
                             {"kl_divergence": kl, "reward_swing_std": swing, "kl_max": self.kl_max,
                              "band_high": self.band_high}, severity)


@dataclasses.dataclass(frozen=True)
class KLTooLow(Rule):
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
                              "kl_min": self.kl_min}, _excess(kl, self.kl_min, above=False))


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
                              "max_clipped": self.max_clipped}, _excess(clipped, self.max_clipped))


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
                             _excess(clipped, self.min_clipped, above=False))


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
                             _excess(trend[2], self.max_variance))


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
    """Responses far shorter than the maximum: memory and time reserved for tokens never generated."""

    name: ClassVar[str] = "response_length"
    group: ClassVar[str] = THROUGHPUT
    reads: ClassVar[Tuple[str, ...]] = ("response_length_mean", "response_clip_ratio")
    parameter: ClassVar[str] = "ppo.max_response_length"
    rationale: ClassVar[str] = ("response_length_mean below 60% of max_response_length: the unused length "
                                "costs memory (~quadratic) and time; lower it, keeping room for the longest answers")
    max_fraction: float = 0.6
    margin: float = 0.5
    """New max = the longest observed mean length x (1 + margin), rounded up (ours)."""
    max_clip_ratio: float = 0.01
    """Silent when more responses than this hit the max: they need it."""

    def check(self, window):
        mean, current = window.mean("response_length_mean"), window.param(self.parameter)
        if mean is None or not current or mean >= self.max_fraction * current:
            return None
        clipped = window.mean("response_clip_ratio") or 0.0
        if clipped > self.max_clip_ratio:
            return None
        longest = max(v for v in (window.max("response_length_max"), window.max("response_length_mean")) if v)
        proposed = int(math.ceil(longest * (1 + self.margin)))
        if proposed >= current:
            return None
        return self._suggest(window, proposed, {"response_length_mean": mean, "longest_mean": longest,
                                                "fraction_of_max": mean / current, "response_clip_ratio": clipped},
                             _excess(mean / current, self.max_fraction, above=False))


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
        severity = _excess(used, self.low, above=False) if up else _excess(used, self.high)
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
                             {"gpu_utilization": util}, _excess(util, self.min_utilization, above=False))


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
                          _excess(rate, self.min_rate, above=False))


RULES: Tuple[Rule, ...] = (KLTooHigh(), KLTooLow(), ClipTooMany(), ClipTooFew(), RewardVariance(),
                           RewardSawtooth(), FlatReward(), ResponseLength(), GpuMemory(), GpuUtilisation(),
                           RolloutSuccess())
"""Every rule with the guide's defaults, in the guide's order."""

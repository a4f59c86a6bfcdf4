"""Rules on how far the policy drifts, read from signals the guide does not list.

- Entropy (`actor/entropy_old`: the policy's entropy on its own rollout, nats per token). A
  collapse (the policy turns deterministic and stops exploring) asks for an entropy bonus; a
  blow-up (it turns towards uniform: updates too large for it to stay coherent) for a smaller
  actor step. The guide gives no numbers for entropy: every threshold here is ours and says so.
- Over-optimisation of the reward model. The guide's KL advice guards against it ("kl_coef too
  small: reward hacking") but reads KL alone; here it is named from its own evidence: the reward
  model's held-out score rising while held-out gold accuracy falls (Gao, Schulman and Hilton,
  "Scaling laws for reward model overoptimization", 2022: as the policy moves away from its start
  the proxy keeps rising while gold peaks and falls), or KL accelerating away from the reference.
  The remedy is the guide's, a larger kl_coef; the size is not. The guide's +20% step is sized for
  KL near its 0.15 line: with KL several times over it, +20% moves KL by a fraction of the
  distance to the band and by less than a round's seeds can tell apart. The proposal is a
  bracket sized from the observed KL, one variant per value, with what the planned seeds can
  detect (experiments/stats.py) in its rationale.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Dict, List, Optional, Tuple

import numpy as np
from scipy import stats as scipy_stats

from experiments import stats
from experiments.advisor.rule_api import GUIDE_KL_STEP, KLScaling, Rule, combined_p, significant, slope_z
from experiments.advisor.window import Window
from experiments.run_records import GOLD_METRIC as GOLD

ENTROPY = "actor/entropy_old"
RM_SCORE = "eval/rm_score"
GUIDE_PPO_KL_COEF = 0.05
"""The low end of the guide's PPO range for kl_coef (0.05-0.1): the start when there is no penalty."""


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def entropy_trends(window: Window, min_steps: int) -> List[Tuple[float, float, float]]:
    """Per seed with at least `min_steps` steps: (fitted entropy at the window's start, at its
    end, z of an upward slope), from a linear fit of the seed's `actor/entropy_old`."""
    out = []
    for curve in window.seed_curves(ENTROPY):
        if len(curve) >= min_steps:
            fit, z = slope_z(curve)
            out.append((float(fit.intercept), float(fit.intercept + fit.slope * (len(curve) - 1)), z))
    return out


# ------------------------------------------------------------------------------------ entropy
@dataclasses.dataclass(frozen=True)
class EntropyCollapse(Rule):
    """Policy entropy falling towards zero: the policy stops exploring, and PPO's advantages come
    from ever fewer distinct responses. Common practice adds an entropy bonus."""

    name: ClassVar[str] = "entropy_collapse"
    reads: ClassVar[Tuple[str, ...]] = (ENTROPY,)
    parameter: ClassVar[str] = "ppo.entropy_coef"
    rationale: ClassVar[str] = ("policy entropy collapsing (falling by a large share over the window, or near "
                                "zero): the policy stops exploring; an entropy bonus keeps it sampling")
    max_fall: float = 0.5
    """A seed collapses when its fitted entropy falls by at least this share of its start over the
    window, with a significant downward slope (ours)."""
    floor: float = 0.05
    """... or when it ends below this many nats per token: a near-deterministic policy (ours)."""
    trend_p: float = 0.05
    """One-sided level of a seed's downward slope."""
    min_steps: int = 10
    start_coef: float = 0.001
    """The bonus proposed when there is none (ours, after verl's early ppo_trainer.yaml default
    entropy_coeff = 0.001; CleanRL's Atari PPO uses 0.01)."""
    factor: float = 2.0
    """An existing bonus is doubled (ours)."""

    def check(self, window):
        trends = entropy_trends(window, self.min_steps)
        z_crit = scipy_stats.norm.isf(self.trend_p)
        hits = [(s, e) for s, e, z in trends
                if e < self.floor or (s > 0 and (s - e) / s >= self.max_fall and z < -z_crit)]
        if not trends or len(hits) * 2 < len(trends):  # at least half the seeds must show it
            return None
        start, end = float(np.mean([h[0] for h in hits])), float(np.mean([h[1] for h in hits]))
        fall = (start - end) / start if start > 0 else 0.0
        current = window.param(self.parameter, 0.0)
        proposed = significant(current * self.factor) if current else self.start_coef
        return self._suggest(window, proposed,
                             {"entropy_start": start, "entropy_end": end, "entropy_fall": fall,
                              "seeds_collapsing": len(hits), "seeds": len(trends), "max_fall": self.max_fall,
                              "floor": self.floor},
                             max(fall / self.max_fall, self.floor / max(end, 1e-12)))


@dataclasses.dataclass(frozen=True)
class EntropyBlowUp(Rule):
    """Policy entropy rising steeply: each update pushes the policy towards uniform, the sign of
    steps too large for it. Common practice lowers the actor's learning rate (here by the guide's
    LR step); an entropy bonus, when there is one, is the other suspect and the rationale says so."""

    name: ClassVar[str] = "entropy_blowup"
    reads: ClassVar[Tuple[str, ...]] = (ENTROPY,)
    parameter: ClassVar[str] = "ppo.actor_learning_rate"
    rationale: ClassVar[str] = ("policy entropy rising steeply: the updates push the policy towards uniform, "
                                "steps too large for it; a lower actor learning rate")
    max_rise: float = 0.5
    """A seed blows up when its fitted entropy rises by at least this share of its start over the
    window, with a significant upward slope (ours)."""
    trend_p: float = 0.05
    min_steps: int = 10
    factor: float = 0.75
    """The guide's LR step: actor LR 2e-6 -> 1.5e-6."""

    def check(self, window):
        trends = entropy_trends(window, self.min_steps)
        z_crit = scipy_stats.norm.isf(self.trend_p)
        hits = [(s, e) for s, e, z in trends if s > 0 and (e - s) / s >= self.max_rise and z > z_crit]
        if not trends or len(hits) * 2 < len(trends):
            return None
        start, end = float(np.mean([h[0] for h in hits])), float(np.mean([h[1] for h in hits]))
        bonus = window.param("ppo.entropy_coef", 0.0)
        rationale = self.rationale + (f" (ppo.entropy_coef = {bonus!r} pushes entropy up too: lowering it is "
                                      f"the other single change)" if bonus else "")
        return self._suggest(window, significant(window.param(self.parameter, 0) * self.factor),
                             {"entropy_start": start, "entropy_end": end, "entropy_rise": (end - start) / start,
                              "seeds_rising": len(hits), "seeds": len(trends), "max_rise": self.max_rise},
                             (end - start) / start / self.max_rise, rationale)


# --------------------------------------------------------------------------- over-optimisation
@dataclasses.dataclass(frozen=True)
class OverOptimisation(KLScaling, Rule):
    """The policy over-optimises the reward model: the RM's held-out score rises while held-out
    gold accuracy falls, or KL accelerates away from the reference. Outranks `kl_high`, whose
    +20% step on the same parameter it replaces with a bracket sized from the evidence.

    Sizing: at the optimum of a KL-penalised objective the policy is the reference tilted by
    exp(reward / kl_coef), whose KL to the reference is, to leading order, Var(reward) / (2 kl_coef^2):
    KL scales as 1/kl_coef^2. The bracket's first value is the step that scaling says brings the mean
    KL to `kl_target`, at least `min_factor` and at least the step whose predicted KL change the
    round's seeds can detect (80% power against the seeds' spread of KL); the second is `span` times
    larger, since the scaling holds only near the reference. The rationale says what gold difference
    the planned seeds can detect (`stats.min_detectable_effect` over the seeds' final gold) and
    how many seeds recovering the gold lost would need (`stats.seeds_needed`)."""

    name: ClassVar[str] = "over_optimisation"
    reads: ClassVar[Tuple[str, ...]] = (GOLD, RM_SCORE, "kl_divergence")
    parameter: ClassVar[str] = "ppo.kl_coef"
    outranks: ClassVar[Tuple[str, ...]] = ("kl_high",)
    rationale: ClassVar[str] = "over-optimisation of the reward model"
    min_gold_drop: float = 0.1
    """Gold falls when the seeds' mean held-out accuracy ends at least this share below its mean at
    the runs' initial evaluation (ours), while the RM score rises, in at least half the seeds."""
    accel_p: float = 0.05
    """KL accelerates when the seeds' pooled evidence (Stouffer) for a later-half slope above the
    earlier half's is significant at this one-sided level (ours), the later half rising ..."""
    kl_floor: float = 0.08
    """... at a mean KL above the guide's healthy band (0.03-0.08): acceleration inside it is not drift ..."""
    min_extra_rise: float = 0.1
    """... by a margin that matters: over the later half KL rises more than it would at the earlier
    half's slope by at least this share of the mean KL (ours; averaged over the seeds)."""
    min_steps: int = 10
    """Steps a seed needs for its two half-window slopes (ours: five each)."""
    kl_target: float = 0.08
    """Where the bracket's first step aims the mean KL: the top of the guide's healthy band."""
    min_factor: float = 2.0
    """The smallest step (ours): well past the guide's x1.2."""
    span: float = 3.0
    """The bracket's second value is the first x span (ours: half a decade; at KL 7x the band's top,
    x2.7 and x8)."""
    alpha: float = 0.05
    """Of the t-test the detectable effects are computed for (the study default)."""

    evidence_keys: ClassVar[Tuple[str, ...]] = (
        "gold_start", "gold_end", "rm_score_rise", "seeds_gold_down_rm_up", "seeds_evaluated", "kl_acceleration_p",
        "seeds_kl_accelerating", "kl_divergence", "kl_mde", "gold_sd_over_seeds", "gold_mde",
        "seeds_to_detect_gold_drop")
    """What the suggestion records as its evidence (the rationale gives the rest: slopes, sizing)."""

    def gold_vs_rm(self, window: Window) -> Optional[Dict[str, float]]:
        """The evidence of gold falling while the RM score rises, run start to end; None without it
        (or without both metrics: gold exists only where held-out ground truth does)."""
        gold, rm = window.eval_ends(GOLD), window.eval_ends(RM_SCORE)
        if not len(gold) or len(gold) != len(rm):
            return None
        both = np.isfinite(gold).all(axis=1) & np.isfinite(rm).all(axis=1)
        if not both.any():
            return None
        gold, rm = gold[both], rm[both]
        d_gold, d_rm = gold[:, 1] - gold[:, 0], rm[:, 1] - rm[:, 0]
        hacked = int(np.sum((d_rm > 0) & (d_gold < 0)))
        start = float(gold[:, 0].mean())
        drop = -float(d_gold.mean())
        relative = drop / start if start > 0 else drop
        if hacked * 2 < len(d_gold) or d_rm.mean() <= 0 or relative < self.min_gold_drop:
            return None
        return {"gold_start": start, "gold_end": float(gold[:, 1].mean()), "gold_drop": drop,
                "rm_score_rise": float(d_rm.mean()), "seeds_gold_down_rm_up": hacked, "seeds_evaluated": len(d_gold),
                "severity": relative / self.min_gold_drop}

    def kl_acceleration(self, window: Window) -> Optional[Dict[str, float]]:
        """The evidence of KL accelerating over the window, per seed; None without it."""
        kl = window.mean("kl_divergence")
        if kl is None or kl <= self.kl_floor:
            return None
        zs, accelerating, early, late, extra = [], 0, [], [], []
        for c in window.seed_curves("kl_divergence"):
            if len(c) < self.min_steps:
                continue
            half = len(c) // 2
            a = scipy_stats.linregress(np.arange(half, dtype=float), c[:half])
            b = scipy_stats.linregress(np.arange(len(c) - half, dtype=float), c[half:])
            # linregress's stub types its result without attributes: slope and stderr exist at run time.
            se, d = math.hypot(a.stderr, b.stderr), b.slope - a.slope  # pyright: ignore[reportAttributeAccessIssue]
            zs.append(d / se if se > 0 else (math.copysign(8.0, d) if d else 0.0))
            accelerating += bool(d > 0 and b.slope > 0)  # pyright: ignore[reportAttributeAccessIssue]
            early.append(a.slope)  # pyright: ignore[reportAttributeAccessIssue]
            late.append(b.slope)  # pyright: ignore[reportAttributeAccessIssue]
            extra.append(d * (len(c) - half))
        if not zs:
            return None
        p, extra_rise = combined_p(zs), float(np.mean(extra))
        if p >= self.accel_p or accelerating * 2 < len(zs) or extra_rise < self.min_extra_rise * kl:
            return None
        return {"kl_slope_early": float(np.mean(early)), "kl_slope_late": float(np.mean(late)),
                "kl_extra_rise": extra_rise,
                "kl_acceleration_p": p, "seeds_kl_accelerating": accelerating, "seeds_kl_read": len(zs),
                "severity": float(scipy_stats.norm.isf(max(p, 1e-300)) / scipy_stats.norm.isf(self.accel_p))}

    def check(self, window):
        gold, accel = self.gold_vs_rm(window), self.kl_acceleration(window)
        current = window.param(self.parameter)
        if (gold is None and accel is None) or current is None:
            return None
        kl = window.mean("kl_divergence")
        factors, sizing = self.factors(window, kl)
        if not current:  # no penalty to scale: start in the guide's range
            factors = (1.0, self.span)
        values = [significant((current or GUIDE_PPO_KL_COEF) * f) for f in factors]
        gold_power = self.gold_detectability(window, gold)
        found = {**(gold or {}), **(accel or {}), "kl_divergence": kl, **sizing, **gold_power}
        evidence = {k: found[k] for k in self.evidence_keys if found.get(k) is not None}
        severity = max(part["severity"] for part in (gold, accel) if part)
        return self._suggest(window, values[0], evidence, severity,
                             self.explain(window, gold, accel, kl, factors, values, sizing, gold_power),
                             bracket=values[1:])

    def factors(self, window: Window, kl: Optional[float]) -> Tuple[Tuple[float, float], Dict[str, float]]:
        """The bracket's two factors on kl_coef, and the numbers they came from."""
        sizing: Dict[str, float] = {"kl_target": self.kl_target}
        first = self.min_factor
        if kl:
            to_band = math.sqrt(kl / self.kl_target) if kl > self.kl_target else 1.0
            sizing["kl_band_factor"] = to_band
            first = max(first, to_band)
            means = [float(np.mean(c)) for c in window.seed_curves("kl_divergence")]
            n = len(means)
            sd = float(np.std(means, ddof=1)) if n > 1 else math.nan
            mde = stats.min_detectable_effect(sd, n, n, self.alpha) if n > 1 else math.nan
            sizing["kl_sd_over_seeds"] = sd
            if math.isfinite(mde):
                sizing["kl_mde"] = mde
                if mde < kl:  # the step whose predicted fall kl (1 - 1/f^2) the seeds can detect
                    detectable = 1 / math.sqrt(1 - mde / kl)
                    sizing["kl_detectable_factor"] = detectable
                    first = max(first, detectable)
            sizing["kl_at_guide_step"] = kl / GUIDE_KL_STEP ** 2
        return (first, first * self.span), sizing

    def gold_detectability(self, window: Window, gold: Optional[Dict]) -> Dict[str, float]:
        """What the planned seeds can detect in final gold: its spread over the seeds, the minimum
        detectable effect at this round's number of seeds, the seeds that recovering the drop needs."""
        finals = window.eval_ends(GOLD)[:, 1] if len(window.evals.get(GOLD, ())) else np.array([])
        finals = finals[np.isfinite(finals)]
        n = len(finals)
        if n < 2:
            return {}
        sd = float(np.std(finals, ddof=1))
        out = {"gold_sd_over_seeds": sd, "seeds": n}
        mde = stats.min_detectable_effect(sd, n, n, self.alpha)
        if math.isfinite(mde):
            out["gold_mde"] = mde
        if gold is not None:
            needed = stats.seeds_needed(gold["gold_drop"], sd, self.alpha)
            if needed is not None:
                out["seeds_to_detect_gold_drop"] = needed
        return out

    def explain(self, window, gold, accel, kl, factors, values, sizing, gold_power) -> str:
        parts = []
        if gold:
            parts.append(f"held-out gold accuracy fell {_fmt(gold['gold_start'])} -> {_fmt(gold['gold_end'])} while "
                         f"the reward model's score rose {gold['rm_score_rise']:+.3g} "
                         f"({gold['seeds_gold_down_rm_up']} of {gold['seeds_evaluated']} seeds)")
        if accel:
            parts.append(f"KL accelerates (mean slope {accel['kl_slope_early']:.3g}/step over the window's first "
                         f"half, {accel['kl_slope_late']:.3g} over its second; rising faster in "
                         f"{accel['seeds_kl_accelerating']} of {accel['seeds_kl_read']} seeds, "
                         f"p = {accel['kl_acceleration_p']:.2g})")
        text = "over-optimisation of the reward model: " + "; ".join(parts) + "."
        steps = " and ".join(f"{v!r}" + (f" (x{f:.2g})" if window.param(self.parameter) else "")
                             for v, f in zip(values, factors))
        if kl and kl > self.kl_target:
            text += (f" The guide's x{GUIDE_KL_STEP:g} kl_coef step is sized for KL near its 0.15 line; "
                     f"at KL {_fmt(kl)} it would leave KL near {_fmt(sizing['kl_at_guide_step'])} "
                     f"(KL ~ 1/kl_coef^2).")
        text += f" Bracket: {steps}, one variant each"
        if kl and kl > self.kl_target:
            text += (f": the first is at least the x{sizing['kl_band_factor']:.2g} that brings KL to "
                     f"{_fmt(self.kl_target)}")
            if "kl_mde" in sizing:
                text += f", moving KL by more than the {_fmt(sizing['kl_mde'])} the seeds can detect"
        text += "."
        if "gold_mde" in gold_power:
            text += (f" With the seeds' spread of final gold (sd {_fmt(gold_power['gold_sd_over_seeds'])}), "
                     f"{gold_power['seeds']} seeds per variant detect a gold difference of "
                     f"{_fmt(gold_power['gold_mde'])} at 80% power")
            if "seeds_to_detect_gold_drop" in gold_power:
                text += (f"; recovering the {_fmt(gold['gold_drop'])} lost needs "
                         f"{gold_power['seeds_to_detect_gold_drop']} seeds per variant")
            text += "."
        return text

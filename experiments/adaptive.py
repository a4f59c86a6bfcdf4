"""Adaptive seeds: add seeds only to the variants whose comparison with the baseline is undecided.

A fixed design runs every variant `max_seeds` times. Most variants of a tuning round are either
clearly better/worse (decided after the first few seeds) or null; only the undecided ones need
more. `study.adaptive_seeds = {'max_seeds': 8}` makes a study start with its `study.seeds`, then,
after each look, give one more seed (`step`) to every variant whose confidence interval of the
difference from the baseline still contains zero, until it excludes zero or `max_seeds` is
reached. The baseline gets as many seeds as the variants still running. With
`study.target_effect` set, 'max_seeds' may be left out: the cap is then the seed plan's N
(experiments/seed_plan.py; at least min_seeds), so the study stops where the planned fixed design
would have; an explicit 'max_seeds' wins.

The interval is Welch's t interval (scipy) at confidence 1 - alpha / m, m the study's variants,
so stopping agrees with a Holm-corrected Welch verdict at its strictest step (`study.analysis =
'welch'`); the report's paired verdict (the default: the baseline runs every look's seeds, so
the seeds pair) can decide a variant the interval left undecided, or the reverse. Looking
repeatedly raises the chance of a false verdict on a null variant; `spend_alpha_over_looks`
(Bonferroni over the possible looks) bounds it at alpha, at the price of more seeds for real
differences. `bench/adaptive_seeds.py` measures both: runs saved and the false verdict rate.

`run_looks` is the rule's one loop: it asks a `measure` callback for each look's values, so the
same loop stops `simulate`'s drawn values (pure: per-seed values in, decisions out) and real
studies, which `driver.run_adaptive` measures through the ordinary plan -> launch -> collect
steps, one launch per look.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from experiments.errors import StudyError
from experiments.results import BASELINE
from experiments.stats import MAX_SEEDS, difference_ci


@dataclasses.dataclass(frozen=True)
class AdaptiveSeeds:
    """The stopping rule. min_seeds: seeds before the first look (default: len(study.seeds));
    max_seeds: the cap (None until planning fills in the seed plan's N); step: seeds added per look;
    spend_alpha_over_looks: Bonferroni over looks."""

    max_seeds: Optional[int]
    min_seeds: int = 3
    step: int = 1
    spend_alpha_over_looks: bool = False

    @property
    def looks(self) -> int:
        assert self.max_seeds is not None, "max_seeds is planned before the looks are counted"
        return 1 + math.ceil((self.max_seeds - self.min_seeds) / self.step)

    def confidence(self, alpha: float, n_variants: int) -> float:
        spent = alpha / max(n_variants, 1) / (self.looks if self.spend_alpha_over_looks else 1)
        return 1 - spent


def parse_adaptive_seeds(value, initial_seeds: int, planned: bool = False) -> Optional[AdaptiveSeeds]:
    """`study.adaptive_seeds` -> AdaptiveSeeds (None when unset); errors name the key and what is allowed.
    `planned` (study.target_effect is set): 'max_seeds' may be left to the seed plan (None here)."""
    if value is None or value == {}:
        return None
    if not isinstance(value, Mapping):
        raise StudyError(f"study.adaptive_seeds = {value!r} is invalid: must be a dict such as {{'max_seeds': 8}}")
    allowed = {f.name for f in dataclasses.fields(AdaptiveSeeds)}
    unknown = set(value) - allowed
    if unknown or ("max_seeds" not in value and not planned):
        raise StudyError(f"study.adaptive_seeds = {dict(value)!r} is invalid: needs 'max_seeds' "
                         "(or study.target_effect, whose seed plan then gives it); "
                         f"allowed keys: {', '.join(sorted(allowed))}")
    cfg = {"min_seeds": initial_seeds, "max_seeds": None, **value}
    for key in ("max_seeds", "min_seeds", "step"):
        v = cfg.get(key, 1)
        if key == "max_seeds" and v is None and "max_seeds" not in value:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < (2 if key != "step" else 1):
            raise StudyError(f"study.adaptive_seeds['{key}'] = {v!r} is invalid: must be an integer >= "
                             f"{2 if key != 'step' else 1}")
    if cfg["max_seeds"] is not None and cfg["max_seeds"] > MAX_SEEDS:
        raise StudyError(f"study.adaptive_seeds['max_seeds'] = {cfg['max_seeds']} is invalid: must be at most "
                         f"{MAX_SEEDS} seeds per variant (the most a seed plan proposes, as for study.seeds)")
    if cfg["max_seeds"] is not None and cfg["max_seeds"] < cfg["min_seeds"]:
        raise StudyError(f"study.adaptive_seeds['max_seeds'] = {cfg['max_seeds']} is invalid: must be >= "
                         f"min_seeds = {cfg['min_seeds']} (default: the number of study.seeds)")
    if not isinstance(cfg.get("spend_alpha_over_looks", False), bool):
        raise StudyError("study.adaptive_seeds['spend_alpha_over_looks'] must be True or False")
    return AdaptiveSeeds(**cfg)


def decide_look(values: Mapping[str, Sequence[float]], baseline: Sequence[float], confidence: float) -> Dict:
    """{variant: {'decided', 'interval', 'n'}}: decided when the interval excludes zero."""
    out = {}
    for name, v in values.items():
        lo, hi = difference_ci(v, baseline, confidence)
        if math.isnan(lo):  # fewer than 2 seeds, or tied ones: nothing is excluded yet
            lo, hi = -math.inf, math.inf
        out[name] = {"decided": bool(lo > 0 or hi < 0), "interval": [lo, hi], "n": len(v)}
    return out


Measured = Tuple[Mapping[str, Sequence[float]], Sequence[float]]
"""({variant: its values}, the baseline's values): one look's completed per-seed values."""


@dataclasses.dataclass(frozen=True)
class Looks:
    """How the stopping rule ended: per variant, its last look's `decide_look` entry and the look
    (1-based) it stopped at, in the order they stopped; every look's record; the seeds of the last."""

    stopped: Dict[str, Tuple[Dict, int]]
    looks: Tuple[Dict, ...]
    """Per look: 'seeds', the variants still 'active', their 'intervals' (`decide_look`)."""
    seeds: int


def run_looks(cfg: AdaptiveSeeds, variants: Sequence[str], confidence: float,
              measure: Callable[[int, List[str]], Optional[Measured]],
              on_look: Optional[Callable[[int, int, Dict], None]] = None) -> Optional[Looks]:
    """The stopping rule's loop. At n = min_seeds seeds, then `step` more at a time up to max_seeds,
    `measure(n, active)` gives the values of the baseline and of the variants still undecided at n
    seeds (None: stop now, and return None); a variant stops at the look whose interval excludes
    zero, or at max_seeds. `on_look(look, n, decisions)` hears each look as it ends."""
    max_seeds = cfg.max_seeds
    assert max_seeds is not None, "max_seeds is planned before the looks run"
    n, active, stopped, looks = cfg.min_seeds, list(variants), {}, []
    while True:
        measured = measure(n, active)
        if measured is None:
            return None
        values, baseline = measured
        look = decide_look(values, baseline, confidence)
        looks.append({"seeds": n, "active": list(active), "intervals": look})
        for name, d in look.items():
            if d["decided"] or n >= max_seeds:
                stopped[name] = (d, len(looks))
        if on_look is not None:
            on_look(len(looks), n, look)
        active = [v for v in active if v not in stopped]
        if not active:
            return Looks(stopped=stopped, looks=tuple(looks), seeds=n)
        n = min(n + cfg.step, max_seeds)


def simulate(draw: Callable[[str, int], float], variants: Sequence[str], cfg: AdaptiveSeeds,
             alpha: float = 0.05) -> Dict:
    """Runs the stopping rule on values from `draw(variant, seed)` ('baseline' included).

    Returns per-variant seeds used and final decision, runs used, and the fixed design's runs
    (every variant and the baseline at max_seeds)."""
    values: Dict[str, List[float]] = {}

    def measure(n: int, active: List[str]) -> Measured:
        for name in [BASELINE, *active]:  # each look draws only the seeds it adds
            drawn = values.setdefault(name, [])
            drawn += [draw(name, s) for s in range(len(drawn), n)]
        return {v: values[v] for v in active}, values[BASELINE]

    ended = run_looks(cfg, variants, cfg.confidence(alpha, len(variants)), measure)
    assert ended is not None and cfg.max_seeds is not None, "measure never stops the looks; run_looks needs max_seeds"
    used = sum(len(v) for v in values.values())
    return {"variants": {name: d for name, (d, _) in ended.stopped.items()}, "runs_used": used,
            "runs_fixed": (1 + len(variants)) * cfg.max_seeds, "baseline_seeds": len(values[BASELINE])}


def extra_seeds(seeds: Sequence[int], count: int) -> List[int]:
    """The study's seeds, extended with the smallest unused integers up to `count`."""
    out, candidate = list(seeds), 0
    while len(out) < count:
        if candidate not in out:
            out.append(candidate)
        candidate += 1
    return out[:max(count, 0)]

"""Seeds planned for power: how many seeds per variant a round needs, said before it runs.

A round with too few seeds cannot tell "no difference" from "could not have seen one"; the
report says so afterwards (`underpowered`). The plan says it before the compute: from the
smallest change worth detecting (`study.target_effect`, in the decision metric's units), the
power wanted (`study.power`, default 80%) and a finished round's spread (`study.pilot`, default
the study `study.resume_from` names), `stats.seeds_needed` gives the seeds per variant. The
choices, each one line:

- sigma: the pilot's per-seed values pooled over all its variants, each variant's seeds around
  its own mean (`stats.pooled_std`, sum(n_i - 1) degrees of freedom): the spread a comparison of
  two of its settings sees, with every seed of the pilot behind it. A variant with fewer than two
  completed seeds adds nothing.
- design: Welch's two-sample design, unless the pilot recorded the correlation between paired
  seeds (`comparison.paired.correlation`): then the paired design at the smallest correlation its
  variants recorded (the least help pairing gave).
- alpha: `study.alpha` / the number of variants (Bonferroni: the strictest step of the Holm
  correction the verdicts use), so the plan holds whichever variant Holm tests first.
- no pilot (none bound, `resume_from` unset or a checkpoint dir) or no spread in it: the plan
  proposes a pilot round of PILOT_SEEDS seeds rather than failing. A pilot bound by name that
  does not exist is a one-line error naming it.

The plan is study-level: it changes no run's configuration, so no run's hash. `plan` prints it,
and a notice when the study runs fewer seeds (with the power those give); `run` records it in
plan.json and the aggregate (`results.SeedPlan`); seed waves without 'max_seeds' are planned from it
(`sequential.plan_waves`, `with_planned_waves`); the advisor writes its N as the next round's
`study.seeds`. Each arm is sized by its own spread: the baseline by the pilot's chosen arm (the
setting the round continues), the variants by the spread pooled over the pilot's arms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from experiments import sequential, stats
from experiments.errors import StudyError
from experiments.results import BASELINE, SeedPlan, StudyAggregate
from experiments.resume_from import (
    is_checkpoint_dir,
    lineage_notice,
    previous_aggregate,
    resume_checkpoints,
    shared_starts,
)
from experiments.study import AUTO, PAIRED, WELCH, Study

PILOT_SEEDS = 3
"""The seeds of the pilot round proposed when there is no spread to plan from (the guide's three)."""


def _paired_correlation(variant) -> Optional[float]:
    """`comparison.paired.correlation` of a pilot's variant, when its aggregate records one."""
    paired = getattr(variant.comparison, "paired", None)
    r = paired.get("correlation") if isinstance(paired, Mapping) else getattr(paired, "correlation", None)
    return float(r) if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) else None


def pilot_spread(pilot: StudyAggregate) -> Tuple[Optional[float], int, int, Optional[float]]:
    """(sigma, seeds pooled, variants pooled, paired correlation or None) of a finished study:
    sigma pools the completed per-seed values of every variant with at least two of them."""
    groups = [v.values for v in pilot.variants.values() if len(v.values) >= 2]
    sigma = stats.pooled_std(*groups) if groups else math.nan
    correlations = [r for r in map(_paired_correlation, pilot.variants.values()) if r is not None]
    return (sigma if math.isfinite(sigma) else None, sum(map(len, groups)), len(groups),
            min(correlations) if correlations else None)


def pilot_correlation(pilot: Optional[StudyAggregate]) -> Optional[float]:
    """The correlation between paired seeds a finished round measured (the smallest over its
    variants), None when it measured none: what `study.analysis = 'auto'` reads."""
    return pilot_spread(pilot)[3] if pilot is not None else None


def arm_spread(pilot: StudyAggregate) -> Optional[float]:
    """The spread of the pilot's chosen arm (the setting a round resumed from it continues: its
    baseline), when it completed two seeds; None otherwise."""
    chosen = pilot.variants.get(pilot.decision.chosen or BASELINE)
    values = chosen.values if chosen is not None else []
    sd = float(np.std(values, ddof=1)) if len(values) >= 2 else math.nan
    return sd if math.isfinite(sd) and sd > 0 else None


def make_plan(pilot: Optional[StudyAggregate], *, target_effect: float, power: float, alpha: float,
              variants: int, seeds_run: int, analysis: str = AUTO) -> SeedPlan:
    """The seed plan for `variants` comparisons with the baseline, from `pilot`'s spread (None: no
    pilot). The design is the analysis the round will use: under 'auto', paired when the pilot
    measured a correlation at which the paired design needs fewer seeds (`resolve_analysis` then
    chooses it at the planned seeds), Welch's otherwise. Pure: the same numbers give the same plan."""
    comparisons = max(variants, 1)
    per_test = stats.per_test_alpha(alpha, comparisons)
    sigma, n, k, r = pilot_spread(pilot) if pilot is not None else (None, 0, 0, None)
    sd_base = cast(float, (arm_spread(pilot) if pilot is not None else None) or sigma)  # None only beside sigma
    if sigma is not None and analysis != WELCH:
        def needed(**design):
            return (stats.seeds_needed(target_effect, sd_base, per_test, power, sd2=sigma, **design)
                    or stats.MAX_SEEDS + 1)
        at = stats.design_correlation(r)
        if analysis == AUTO and (r is None or needed(paired=True, correlation=at) >= needed()):
            r = None  # Welch's design: pairing would not save a seed
        elif analysis == PAIRED:
            r = at
    elif analysis == WELCH:
        r = None
    plan = SeedPlan(target_effect=float(target_effect), power=float(power), alpha=float(alpha),
                    comparisons=comparisons, pilot=pilot.study if pilot is not None else "", pilot_seeds=n,
                    pilot_variants=k, correlation=r, seeds_run=seeds_run)
    if sigma is None:
        return plan
    design: Dict[str, Any] = dict(paired=r is not None,
                                  correlation=stats.design_correlation(r) if r is not None else 0.0, sd2=sigma)
    at_run = stats.power(target_effect, sd_base, seeds_run, seeds_run, per_test, **design)
    return dataclasses.replace(plan, sigma=sigma, sd_baseline=sd_base, sd_variant=sigma,
                               seeds=stats.seeds_needed(target_effect, sd_base, per_test, power, **design),
                               power_at_seeds_run=at_run if math.isfinite(at_run) else None)


def find_pilot(study: Study, results_dir: str | Path) -> Optional[StudyAggregate]:
    """The pilot's aggregate: `study.pilot` (a name under `results_dir`, or a results dir), else the
    study `study.resume_from` names (its reader: resume_from.previous_aggregate); None when neither names
    a study. A bound pilot that is missing is a StudyError naming it."""
    if study.pilot:
        root = Path(study.pilot) if Path(study.pilot).is_absolute() else Path(results_dir) / study.pilot
        binding = f"study.pilot = {study.pilot!r}"
        if not root.is_dir():
            raise StudyError(f"{binding} does not exist (no study results at {root}): run that study first, or "
                             f"name a finished study (its name under --results, or its results dir)")
        return previous_aggregate(root, binding, ", or name another finished study")
    if study.resume_from and Path(study.resume_from).is_dir() and not is_checkpoint_dir(Path(study.resume_from)):
        return previous_aggregate(Path(study.resume_from), f"study.resume_from = {study.resume_from!r}",
                                  ", or set study.pilot")
    return None


def seeds_run(study: Study) -> int:
    """Seeds per variant the study runs: its seeds, or the last wave's when that is set."""
    cap = study.sequential.max_seeds if study.sequential is not None else None
    return cap if cap is not None else len(study.seeds)


def seed_plan(study: Study, results_dir: str | Path) -> Optional[SeedPlan]:
    """The study's seed plan; None when `study.target_effect` is unset. With seed waves, the waves
    are planned too (`sequential.plan_waves`): the fewest seeds at the last wave that give the
    power, from each arm's spread, unless study.sequential['max_seeds'] fixes it."""
    if study.target_effect is None:
        return None
    plan = make_plan(find_pilot(study, results_dir), target_effect=study.target_effect, power=study.power,
                     alpha=study.alpha, variants=len(study.variants), seeds_run=seeds_run(study),
                     analysis=study.analysis)
    if study.sequential is None or plan.sigma is None:
        return plan
    assert plan.sd_baseline is not None and plan.sd_variant is not None  # make_plan sets them beside sigma
    waves = sequential.plan_waves(plan.target_effect, sd_baseline=plan.sd_baseline, sd_variant=plan.sd_variant,
                                  correlation=stats.design_correlation(plan.correlation),
                                  paired=plan.correlation is not None, alpha=plan.alpha, variants=plan.comparisons,
                                  power=plan.power, waves=study.sequential, max_seeds=stats.MAX_SEEDS)
    if waves is None:
        return dataclasses.replace(plan, seeds=None)
    d = waves.design
    return dataclasses.replace(plan, seeds_run=d.waves[-1], power_at_seeds_run=waves.power, sequential={
        "waves": list(d.waves), "spending": d.spending, "futility": d.futility_spending,
        "alpha_per_variant": d.alpha, "boundaries": d.boundary_rows(), "power": waves.power,
        "runs_max": waves.runs_max, "runs_expected_null": waves.runs_null,
        "runs_expected_target": waves.runs_target, "runs_fixed": waves.runs_fixed})


def with_planned_waves(study: Study, plan: Optional[SeedPlan]) -> Study:
    """The study with seed waves' 'max_seeds', when left out, set to the plan's last wave; a
    StudyError when there is no plan to take it from."""
    cfg = study.sequential
    if cfg is None or cfg.max_seeds is not None:
        return study
    if plan is None or plan.sequential is None:
        why = plan_line(plan, study.direction) if plan is not None else "no study.target_effect"
        raise StudyError(f"study.sequential has no 'max_seeds' and no seed plan gives one ({why}): set "
                         f"study.sequential['max_seeds']")
    return dataclasses.replace(study, sequential=dataclasses.replace(cfg, max_seeds=plan.seeds_run))


def study_design(study: Study, plan: Optional[SeedPlan]) -> Optional[sequential.Design]:
    """The seed waves' design of a study (None: a fixed design), its last wave planned or bound."""
    cfg = with_planned_waves(study, plan).sequential
    if cfg is None:
        return None
    assert cfg.max_seeds is not None
    return sequential.study_design(cfg, cfg.max_seeds, study.alpha, len(study.variants), study.power)


def _signed(effect: float, direction: str) -> str:
    return f"{'-' if direction == 'lower' else '+'}{effect:g}"


def _spread(plan: SeedPlan) -> str:
    """'spread from round1: sigma = 0.031, n = 3 seeds x 2 variants, paired r = 0.6'."""
    per = plan.pilot_seeds / plan.pilot_variants if plan.pilot_variants else 0
    if plan.pilot_variants == 1:
        n = f"n = {plan.pilot_seeds}"
    elif per == int(per):
        n = f"n = {int(per)} seeds x {plan.pilot_variants} variants"
    else:
        n = f"n = {plan.pilot_seeds} seeds over {plan.pilot_variants} variants"
    paired = f", paired seeds correlate r = {plan.correlation:.2g}" if plan.correlation is not None else ""
    return f"spread from {plan.pilot}: sigma = {plan.sigma:.2g}, {n}{paired}"


def plan_line(plan: SeedPlan, direction: str = "higher") -> str:
    """The plan in one line: 'plan: 7 seeds per variant detect +0.02 at 80% power (spread from
    round1: sigma = 0.031, n = 3; alpha 0.05 / 3 variants)', or the pilot round it proposes."""
    effect = _signed(plan.target_effect, direction)
    if plan.sigma is None:
        why = f" ({plan.pilot} has no variant with two completed seeds)" if plan.pilot else ""
        return (f"plan: no spread to plan from{why}: run a pilot round of {PILOT_SEEDS} seeds first "
                f"(study.pilot) to size seeds for {effect} at {plan.power:.0%} power")
    family = f"alpha {plan.alpha:g} / {plan.comparisons} variant{'s' if plan.comparisons != 1 else ''}"
    if plan.seeds is None:
        return (f"plan: more than {stats.MAX_SEEDS} seeds per variant would be needed to detect {effect} at "
                f"{plan.power:.0%} power ({_spread(plan)}; {family}): raise study.target_effect")
    line = (f"plan: {plan.seeds} seeds per variant detect {effect} at {plan.power:.0%} power "
            f"({_spread(plan)}; {family})")
    waves = plan.sequential
    if waves:
        line += (f"; in waves of {'/'.join(map(str, waves['waves']))} seeds: {waves['power']:.0%} power, "
                 f"at most {waves['runs_max']} runs, expected {waves['runs_expected_null']:.0f} with no true "
                 f"difference and {waves['runs_expected_target']:.0f} with every variant at {effect}, against "
                 f"{waves['runs_fixed']} for the fixed design")
    return line


def boundaries_lines(plan: Optional[SeedPlan], direction: str = "higher") -> List[str]:
    """The waves' boundaries table, one line per look (nothing without seed waves)."""
    if plan is None or not plan.sequential:
        return []
    waves = plan.sequential
    better = "above" if direction == "higher" else "below"
    lines = [f"boundaries ({waves['spending']} efficacy, {waves['futility']} futility, non-binding; each variant "
             f"at two-sided alpha {waves['alpha_per_variant']:.3g}): z of the difference from the baseline",
             "  look  seeds  efficacy |z| >=  nominal p  futility z <"]
    for row in waves["boundaries"]:
        fut = f"{row['futility_z']:.3f}" if row["futility_z"] is not None else "-"
        lines.append(f"  {row['look']:>4}  {row['seeds']:>5}  {row['efficacy_z']:>15.3f}  {row['nominal_p']:>9.3g}  "
                     f"{fut:>11}")
    lines.append(f"  (z {better} zero improves; a variant stops at the first look it crosses either boundary)")
    return lines


def shortfall(plan: SeedPlan, direction: str = "higher", knob: str = "study.seeds") -> Optional[str]:
    """A notice when the study runs fewer seeds per variant than planned (None otherwise); `knob`
    is the binding that sets them."""
    if plan.seeds is None or plan.seeds_run >= plan.seeds:
        return None
    power = f"{plan.power_at_seeds_run:.0%}" if plan.power_at_seeds_run is not None else "no"
    return (f"notice: this study runs {plan.seeds_run} seeds per variant, fewer than the {plan.seeds} planned: a true "
            f"difference of {_signed(plan.target_effect, direction)} is detected with {power} power; set "
            f"{knob} = {plan.seeds} to detect it with {plan.power:.0%}")


def _wave_starts(study: Study, plan: Optional[SeedPlan]) -> Dict[int, str]:
    """{seed: start checkpoint} of every seed the waves may run ({} without waves, or a resumed study
    that has not run yet)."""
    last = seeds_run(study) if plan is None or not plan.sequential else plan.seeds_run
    try:
        return resume_checkpoints(dataclasses.replace(study, seeds=tuple(sequential.extra_seeds(study.seeds, last))))
    except StudyError:
        return {}


def plan_lines(study: Study, plan: Optional[SeedPlan], specs: Sequence = ()) -> List[str]:
    """What `plan` and `run` print: the plan line and, when the study runs fewer seeds, the notice;
    and, when seeds share start checkpoints (`specs`' init_from; with seed waves, every wave's
    seeds), that the round has fewer units, and the power those units give."""
    starts = {s.seed: s.init_from for s in specs if s.variant == BASELINE and s.init_from}
    if study.sequential is not None:
        starts = _wave_starts(study, plan) or starts
    lineages = list(filter(None, [lineage_notice(starts)]))
    units = len(shared_starts(starts)) if shared_starts(starts) else None
    if lineages and units and plan is not None and plan.sd_baseline is not None and units >= 2:
        at = stats.power(plan.target_effect, plan.sd_baseline, units, units,
                         stats.per_test_alpha(plan.alpha, plan.comparisons), paired=plan.correlation is not None,
                         correlation=stats.design_correlation(plan.correlation), sd2=plan.sd_variant)
        if math.isfinite(at):
            lineages.append(f"notice: with {units} independent starts a true difference of "
                            f"{_signed(plan.target_effect, study.direction)} is detected with {at:.0%} power (fixed "
                            f"design); give the round distinct starts (more seeds in the round it resumes) for more")
    if plan is None:
        if study.target_effect is None and study.power != stats.POWER:
            lineages.append(f"notice: study.power = {study.power:g} has no effect without study.target_effect: the "
                            f"power is what the seed plan sizes the seeds for, and only a target effect makes a plan; "
                            f"set study.target_effect (in {study.metric}'s units) or leave study.power out")
        return lineages
    if plan.sequential:
        short = []
        if plan.seeds is not None and plan.power_at_seeds_run is not None and plan.power_at_seeds_run < plan.power:
            short = [f"notice: these waves end at {plan.seeds_run} seeds per variant: a true difference of "
                     f"{_signed(plan.target_effect, study.direction)} is detected with {plan.power_at_seeds_run:.0%} "
                     f"power (the fixed design needs {plan.seeds} for {plan.power:.0%}); leave out "
                     f"study.sequential['max_seeds'] to let the plan size the waves"]
        return [plan_line(plan, study.direction), *short, *boundaries_lines(plan, study.direction), *lineages]
    knob = "study.sequential['max_seeds']" if study.sequential is not None else "study.seeds"
    return [plan_line(plan, study.direction), *filter(None, [shortfall(plan, study.direction, knob)]), *lineages]

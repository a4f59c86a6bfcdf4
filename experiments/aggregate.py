"""Aggregate and decide: per-variant statistics, a verdict against the baseline, the chosen variant.

Input: the collected run results; output: a `results.StudyAggregate` (saved as aggregate.json),
which the report renders and a later study's `resume_from` reads (`decision.chosen`). Every
comparison records two analyses of the same seeds: Welch's t-test (independent groups) and the
paired one (seed s of the variant against seed s of the baseline, which share their prompt
order and sampling streams); `study.analysis` names the one that decides (`study.resolve_analysis`:
'auto' is paired when the seeds pair and a previous round's correlation makes it the more sensitive). Verdicts:
- `better` / `worse`: the deciding analysis's Holm-corrected p-value below `study.alpha`, in
  the metric's direction;
- `equivalent` (with `study.equivalence_margin` > 0): neither, and the deciding analysis's TOST
  p-value, Holm-corrected across the variants, below alpha: the difference lies within
  +-margin. A settled question: the advisor does not propose the change again;
- `no detectable difference`, marked `underpowered` when the observed difference would need more
  seeds than were run to be detected with 80% power (under the deciding analysis);
- `insufficient data`: fewer than two completed seeds on either side (or, paired, fewer than two
  seeds completed on both); `failed`: no run completed; `undecidable`: runs completed but none
  logged the decision metric.
Minimum detectable effects and seeds needed are at alpha over the variants compared
(`stats.per_test_alpha`: Holm's first step, the seed plan's level, at which 'auto' also compares
the two designs). A test whose seeds do not spread at the metric's resolution
(`study.metric_resolution`, `stats.is_flat`) is undefined: `insufficient data`, and it stays in
Holm's family. Seeds that share a start checkpoint are tested as one unit, their mean
(`lineage_units`). A guardrail is violated by a run whose final-window value is outside its
bounds, missing or not a finite number; a variant with any violation, or any run that failed or did
not complete, is never chosen, and the decision's reason names a `better` one passed over, with why.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

from experiments import sequential, stats
from experiments.paths import portable
from experiments.results import (
    BASELINE,
    BETTER,
    EQUIVALENT,
    INSUFFICIENT,
    NO_DIFFERENCE,
    PAIRED,
    UNDECIDABLE,
    VARIANT_FAILED,
    WELCH,
    WORSE,
    BestCheckpoints,
    CheckpointScore,
    Comparison,
    Decision,
    GuardrailCheck,
    PairedComparison,
    RunOutcome,
    RunStatus,
    SequentialRecord,
    StudyAggregate,
    Summary,
    VariantResult,
)
from experiments.resume_from import shared_starts
from experiments.run_records import GOLD_METRIC, scalar
from experiments.seed_plan import study_design
from experiments.study import Study, resolve_analysis

__all__ = ["BETTER", "WORSE", "EQUIVALENT", "NO_DIFFERENCE", "INSUFFICIENT", "VARIANT_FAILED", "UNDECIDABLE",
           "aggregate", "decide", "verdicts"]

ANALYSIS_NAMES = {WELCH: "Welch", PAIRED: "paired t"}

Values = Union[Sequence[float], Mapping[int, float]]


def _by_seed(values: Values) -> Dict[int, float]:
    """{seed: value}; a plain sequence's positions are its seeds."""
    return dict(values) if isinstance(values, Mapping) else dict(enumerate(values))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One variant judged against the baseline: both analyses (`comparison`, its `analysis` naming
    the one that decides and its `_holm` fields that one's corrected p-values), the verdict and why."""

    comparison: Comparison
    verdict: str
    underpowered: bool
    explanation: str

    @property
    def decisive(self):
        return self.comparison.decisive


def _verdict(cmp: Comparison, n: int, n_base: int, higher: bool, alpha: float, margin: float) -> Verdict:
    """The verdict of one comparison, read from its deciding analysis."""
    own = cmp.decisive
    name = ANALYSIS_NAMES[cmp.analysis]
    diff, p = own.difference, cmp.p_value_holm

    def say(verdict, underpowered, why):
        return Verdict(cmp, verdict, underpowered, why)

    if n < 2 or n_base < 2:
        return say(INSUFFICIENT, True, f"{n} vs {n_base} completed seeds; at least 2 each are needed")
    n_used = cast(PairedComparison, own).n_pairs if cmp.analysis == PAIRED else min(n, n_base)
    if n_used < 2:
        return say(INSUFFICIENT, True, f"{n_used} seed(s) completed on both sides; the paired analysis needs at "
                                       f"least 2 (study.analysis = 'welch' compares the groups)")
    if own.flat:
        tied = ("every seed of both arms ties" if cmp.analysis == WELCH
                else "every seed pair differs by the same amount")
        return say(INSUFFICIENT, True, f"{tied} at the metric's resolution (difference {diff:+.4g}): no spread to "
                                       f"judge chance by; run more seeds, or evaluate on more prompts")
    improves = diff is not None and (diff > 0) == higher and diff != 0
    if p is not None and p < alpha:
        return say(BETTER if improves else WORSE, False, f"Holm-corrected {name} p = {p:.3g} < {alpha:g}")
    tost = cmp.equivalence_p_holm
    if margin > 0 and tost is not None and tost < alpha:
        return say(EQUIVALENT, False, f"equivalent within ±{margin:g} (TOST p = {tost:.3g} < {alpha:g}, "
                                      f"{name}, Holm-corrected)")
    needed, mde = own.seeds_needed, own.min_detectable_effect
    level = f"alpha {cmp.alpha_per_test:.3g}" if cmp.alpha_per_test is not None else "alpha"
    underpowered = needed is None or needed > n_used
    if diff in (None, 0) or needed is None:
        why = "no observed difference" if diff in (None, 0) else (
            f"more than {stats.MAX_SEEDS} seeds per variant would be needed to detect the observed difference "
            f"{diff:+.4g}")
    else:
        why = (f"{needed} seeds per variant needed to detect the observed difference {diff:+.4g} at 80% power "
               f"({name}, {level})")
    if mde is not None:
        why += f"; minimum detectable effect at n={n_used}: {mde:.4g}"
    if diff not in (None, 0) and needed is not None and not underpowered:
        why = f"p = {p:.3g}, enough seeds to detect the observed difference: " + why
    if margin > 0:
        why += (f"; not shown equivalent within ±{margin:g}"
                + (f" (TOST p = {tost:.3g})" if tost is not None else ""))
    return say(NO_DIFFERENCE, underpowered and diff not in (None, 0), why)


def verdicts(values: Mapping[str, Values], higher: bool, alpha: float, analysis: str = WELCH,
             margin: float = 0.0, resolution: float = 0.0) -> Dict[str, Verdict]:
    """{variant: Verdict} for every variant but the baseline. `values`: {variant: {seed: value}}
    (or a list per variant, its positions the seeds). Both analyses are computed against
    `values['baseline']`; `analysis` ('welch' | 'paired') decides, its p-values (and TOST
    p-values, with a `margin` > 0) Holm-corrected across every compared variant (one whose test is
    undefined stays in the family); minimum detectable effects and seeds needed are at
    `stats.per_test_alpha`. Pure."""
    by_seed = {n: _by_seed(v) for n, v in values.items()}
    names = [n for n in by_seed if n != BASELINE]
    base = by_seed.get(BASELINE, {})
    level = stats.per_test_alpha(alpha, len(names))
    comparisons = {}
    for n in names:
        welch = stats.compare(list(by_seed[n].values()), list(base.values()), higher, level, margin, resolution)
        comparisons[n] = dataclasses.replace(
            welch, analysis=analysis, paired=stats.compare_paired(by_seed[n], base, level, margin, resolution))

    def holm(key: str) -> List[Optional[float]]:
        raw = [getattr(comparisons[n].decisive, key) for n in names]
        return [None if p != p else p for p in stats.holm([float("nan") if p is None else p for p in raw])]

    out = {}
    for n, p, tost in zip(names, holm("p_value"), holm("equivalence_p")):
        cmp = dataclasses.replace(comparisons[n], p_value_holm=p, equivalence_p_holm=tost)
        out[n] = _verdict(cmp, len(by_seed[n]), len(base), higher, alpha, margin)
    return out


def lineage_units(by_seed: Mapping[str, Mapping[int, float]], starts: Mapping[int, str]) -> tuple:
    """({variant: {unit: value}}, {start: seeds}) where seeds that share a start checkpoint
    (`resume_from.shared_starts`) are one unit, the mean of its seeds, keyed by its first seed:
    seeds from one start share its luck, so counting them apart would overstate the evidence.
    Unchanged, and {} as the lineages, when every seed starts apart."""
    lineages = shared_starts(starts)
    return {n: stats.unit_means(v, lineages) for n, v in by_seed.items()}, lineages


def _summary(values: Sequence[float], resolution: float = 0.0) -> Summary:
    s = stats.summarize(values, resolution)
    return Summary(**{**s, "ci95": tuple(s["ci95"])})


def _guardrails(study: Study, runs: Sequence[RunOutcome]) -> Dict[str, GuardrailCheck]:
    out = {}
    for g in study.guardrails:
        values = {r.seed: r.guardrails.get(g.metric) for r in runs if r.status == RunStatus.COMPLETED}
        violations = tuple(sorted(seed for seed, v in values.items() if g.violated_by(v)))
        out[g.metric] = GuardrailCheck(bound=g.describe(), min=g.min, max=g.max,
                                       values={str(k): v for k, v in values.items()},
                                       violated_seeds=violations, ok=not violations)
    return out


BESIDE_METRICS = ("eval/accuracy", "eval/rm_score")
"""Final held-out metrics every report shows beside the decision metric when the runs log them:
gold accuracy and the reward model's score, so over-optimisation of a reward model is visible."""


def _beside(study: Study, runs: Sequence[RunOutcome]) -> Dict[str, Summary]:
    """{metric: Summary} of each BESIDE_METRICS metric a completed run logged, over the completed
    runs' finite values: a NaN or inf is no value, as a missing one is (a summary's n below the
    variant's completed runs says how many had none)."""
    out = {}
    for metric in BESIDE_METRICS:
        if metric == study.metric:
            continue
        logged = [v for v in (scalar((r.final or {}).get(metric)) for r in runs if r.status == RunStatus.COMPLETED)
                  if v is not None]
        if logged:
            out[metric] = _summary([v for v in logged if math.isfinite(v)])
    return out


def planned_seeds(study: Study, results: Sequence[RunOutcome]) -> Dict[str, List[int]]:
    """{arm: the seeds it was planned at}: every run of the plan, whatever its outcome."""
    out: Dict[str, List[int]] = {v.name: [] for v in study.all_variants}
    for r in results:
        out.setdefault(r.variant, []).append(r.seed)
    return out


def completed_values(results: Sequence[RunOutcome]) -> Dict[str, Dict[int, float]]:
    """{arm: {seed: decision metric}} of the completed runs that logged it."""
    out: Dict[str, Dict[int, float]] = {}
    for r in results:
        out.setdefault(r.variant, {})
        if r.status == RunStatus.COMPLETED and r.value is not None and math.isfinite(r.value):
            out[r.variant][r.seed] = r.value
    return out


def replay_waves(study: Study, design: sequential.Design, results: Sequence[RunOutcome], analysis: str,
                 starts: Optional[Mapping[int, str]] = None) -> sequential.Replay:
    """The seed waves' looks over the study's results (`sequential.replay`): what the manager
    decided after each wave, and what `report` finds again from the same runs."""
    planned = planned_seeds(study, results)
    seeds = sequential.extra_seeds(study.seeds, design.waves[-1])
    return sequential.replay(design, seeds, completed_values(results), BASELINE, paired=analysis == PAIRED,
                             higher=study.direction == "higher", lineages=shared_starts(starts or {}),
                             ran={name: len(set(s)) for name, s in planned.items()})


def _sequential_verdict(judge: Verdict, record: Dict, design: sequential.Design, compared: int) -> Verdict:
    """A variant's verdict as the seed waves decided it: the stagewise interval and the design's
    p-value (times the variants compared: each is tested at alpha over them) replace the fixed
    sample's, and the verdict is the look's decision, never a re-test."""
    cmp: Comparison = judge.comparison
    interval = cast(Tuple[Optional[float], Optional[float]], tuple(record.get("interval") or (None, None)))
    p = record.get("p_value")
    adjusted = min(1.0, p * compared) if p is not None else None
    if cmp.analysis == PAIRED and cmp.paired is not None:
        cmp = dataclasses.replace(cmp, paired=dataclasses.replace(cmp.paired, difference_ci95=interval),
                                  p_value_holm=adjusted)
    else:
        cmp = dataclasses.replace(cmp, difference_ci95=interval, p_value_holm=adjusted)
    look, seeds, z = record["look"], record["seeds"], record.get("z")
    where = f"look {look} of {len(design.waves)} ({seeds} seeds a side, {record['units']} units)"
    zs = f"z = {z:+.3g}" if z is not None else "z undefined"
    decision = record["decision"]
    if z is None and decision != sequential.CONTINUE:
        return Verdict(cmp, INSUFFICIENT, True, f"no statistic at {where}: fewer than two units finished on both "
                                                f"arms, or they do not spread")
    if decision in (sequential.BETTER, sequential.WORSE):
        verdict = BETTER if decision == sequential.BETTER else WORSE
        why = (f"crossed the efficacy boundary at {where}: |{zs}| >= {record['efficacy_z']:.3g} "
               f"(design p = {p:.3g}, x{compared} variants = {adjusted:.3g} < alpha)")
        return Verdict(cmp, verdict, False, why)
    if decision == sequential.FUTILE:
        last = look == len(design.waves)
        why = (f"did not cross the efficacy boundary at the last {where}: {zs} < {record['efficacy_z']:.3g}" if last
               else f"stopped for futility at {where}: {zs} < {record['futility_z']:.3g}, the improvement the waves "
                    f"were planned to detect is unlikely; its remaining seeds were not run")
        return Verdict(cmp, NO_DIFFERENCE, False, why)
    return Verdict(cmp, INSUFFICIENT, True, f"undecided at {where}: its remaining waves have not run "
                                             f"(`python -m experiments run` continues them)")


def aggregate(study: Study, results: Sequence[RunOutcome], provenance: Optional[Dict] = None,
              plots: Optional[Dict[str, str]] = None, seed_plan=None,
              pilot_correlation: Optional[float] = None, starts: Optional[Mapping[int, str]] = None
              ) -> StudyAggregate:
    """Study settings, per-variant stats and verdicts, and the decision. `pilot_correlation`: the
    correlation between paired seeds a previous round measured, which 'auto' reads to choose the
    analysis (`study.resolve_analysis`). `starts`: {seed: the checkpoint it started from}; seeds that
    share one are tested as one unit (`lineage_units`). With seed waves (`study.sequential`), the
    verdicts are the looks' decisions (`replay_waves`)."""
    higher = study.direction == "higher"
    by_variant: Dict[str, List[RunOutcome]] = {v.name: [] for v in study.all_variants}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    by_seed = {name: {r.seed: r.value for r in runs if r.status == RunStatus.COMPLETED and r.value is not None}
               for name, runs in by_variant.items()}
    values = {name: list(v.values()) for name, v in by_seed.items()}
    # The design (every planned run, whatever its outcome) picks the analysis, not the values.
    design = study_design(study, seed_plan)
    planned = ({v.name: sequential.extra_seeds(study.seeds, design.waves[-1]) for v in study.all_variants}
               if design is not None else {name: [r.seed for r in runs] for name, runs in by_variant.items()})
    analysis = resolve_analysis(study.analysis, planned, pilot_correlation, study.alpha)  # seed waves: the design's
    margin, step = study.equivalence_margin, study.metric_resolution
    units, lineages = lineage_units(by_seed, starts or {})
    judged = verdicts(units, higher, study.alpha, analysis, margin, step)
    record = None
    if design is not None:
        waves = replay_waves(study, design, results, analysis, starts)
        judged = {name: _sequential_verdict(v, waves.stopped[name], design, len(judged)) if name in waves.stopped
                  else v for name, v in judged.items()}
        record = sequential_record(design, waves, len(results), len(study.variants), seed_plan)
    declared = {v.name: v for v in study.all_variants}
    metric = f"{study.metric_from} {study.metric}"
    base_completed = sum(r.status == RunStatus.COMPLETED for r in by_variant.get(BASELINE, []))
    variants: Dict[str, VariantResult] = {}
    for name, runs in by_variant.items():
        completed = sum(r.status == RunStatus.COMPLETED for r in runs)
        rails = _guardrails(study, runs)
        fields: Dict[str, Any] = dict(
            bindings=tuple(declared[name].bindings) if name in declared else (),
            coupled=bool(declared.get(name) and declared[name].coupled),
            summary=_summary(values[name], step),
            runs=tuple(r.as_filed(_relative(r.run_dir, study.name)) for r in runs),
            completed=completed, failed=sum(r.status == RunStatus.FAILED for r in runs),
            incomplete=len(runs) - completed,
            guardrails=rails, guardrails_ok=all(g.ok for g in rails.values()), beside=_beside(study, runs))
        if name == BASELINE:
            variants[name] = VariantResult(**fields)
            continue
        judge = judged[name]
        verdict, underpowered, why = judge.verdict, judge.underpowered, judge.explanation
        if completed == 0:
            verdict, underpowered, why = VARIANT_FAILED, False, "no run completed"
        elif not values[name] or (base_completed and not values[BASELINE]):
            verdict, underpowered = UNDECIDABLE, False
            why = f"no run logged {metric}"
        if lineages and verdict not in (VARIANT_FAILED, UNDECIDABLE):
            why += f" (over {len(units[name])} lineage means: seeds sharing a start checkpoint count as one)"
        variants[name] = VariantResult(**fields, comparison=judge.comparison,
                                       verdict=verdict,
                                       underpowered=underpowered, explanation=why)
    return StudyAggregate(
        study=study.name, study_file=portable(study.path), description=study.description, metric=study.metric,
        metric_from=study.metric_from, direction=study.direction, alpha=study.alpha, seeds=tuple(study.seeds),
        guardrails=tuple(g.describe() for g in study.guardrails), variants=variants,
        decision=decide(variants, higher, metric), provenance=provenance or {}, plots=plots or {},
        sequential=record, seed_plan=seed_plan, best_checkpoints=best_checkpoints(results, study.name),
        analysis=analysis, equivalence_margin=margin, metric_resolution=step, lineages=lineages)


def sequential_record(design: sequential.Design, waves: sequential.Replay, runs_used: int, variants: int,
                      seed_plan=None) -> SequentialRecord:
    """The aggregate's record of a study run in seed waves."""
    planned = (seed_plan.sequential or {}) if seed_plan is not None else {}
    return SequentialRecord(
        waves=design.waves, spending=design.spending, futility=design.futility_spending,
        alpha_per_variant=design.alpha, power=design.power, boundaries=tuple(design.boundary_rows()),
        variants=dict(waves.stopped), looks=waves.looks, runs_used=runs_used,
        runs_max=(variants + 1) * design.waves[-1], runs_fixed=planned.get("runs_fixed"),
        runs_expected_null=planned.get("runs_expected_null"), runs_expected_target=planned.get("runs_expected_target"))


def decide(variants: Dict[str, VariantResult], higher: bool, metric: str = "the decision metric") -> Decision:
    """The chosen variant: the best `better` one with clean guardrails and every run completed, else the
    baseline (an `equivalent` variant is no reason to change: the baseline stays). No choice (None) when no run
    completed, or none logged the metric. A `better` variant passed over (one of its runs failed or did not
    complete, or it broke a guardrail) ahead of the chosen one, or in place of any, is named in the reason
    with why (`passed_over`)."""
    flagged = tuple(sorted(n for n, v in variants.items() if not v.guardrails_ok))
    if not any(v.completed for v in variants.values()):
        return Decision(None, "no decision: no run completed", flagged)
    if not any(v.values for v in variants.values()):
        return Decision(None, f"no decision: no completed run logged {metric}", flagged)
    base = variants.get(BASELINE)
    if base is not None and not base.values:
        return Decision(None, f"no decision: no baseline run {'logged ' + metric if base.completed else 'completed'}",
                        flagged)
    sign = 1 if higher else -1
    better = sorted((n for n, v in variants.items() if v.verdict == BETTER),  # a better one has values
                    key=lambda n: -sign * cast(float, variants[n].summary.mean))
    candidates = [n for n in better if variants[n].guardrails_ok and variants[n].incomplete == 0]
    if candidates:
        chosen = candidates[0]
        reason = f"{chosen} is better than the baseline ({variants[chosen].explanation})"
        ahead = better[:better.index(chosen)]
        if ahead:
            reason += "; " + "; ".join(f"{n} has a {'higher' if higher else 'lower'} mean but "
                                       f"{passed_over(variants[n])}" for n in ahead)
        return Decision(chosen, reason, flagged)
    if better:
        passed = "; ".join(f"{n} is better than the baseline but {passed_over(variants[n])}" for n in better)
        return Decision(BASELINE, f"no better variant can be chosen: {passed}; keep the baseline", flagged)
    return Decision(BASELINE, "no variant is detectably better with its guardrails holding; keep the baseline",
                    flagged)


def passed_over(v: VariantResult) -> str:
    """Why a `better` variant is not chosen: '1 of its 3 runs failed and it broke its guardrail
    kl_divergence <= 0.5 (seed 2)'."""
    runs = len(v.runs)
    why = []
    if v.failed:
        why.append(f"{v.failed} of its {runs} runs failed")
    if v.incomplete > v.failed:
        why.append(f"{v.incomplete - v.failed} of its {runs} runs did not complete")
    broken = [g for g in v.guardrails.values() if not g.ok]
    if broken:
        rails = " and ".join(f"{g.bound} (seed{'s' if len(g.violated_seeds) > 1 else ''} "
                             f"{', '.join(map(str, g.violated_seeds))})" for g in broken)
        why.append(f"{'it ' if why else ''}broke its guardrail{'s' if len(broken) > 1 else ''} {rails}")
    elif not v.guardrails_ok:
        why.append(f"{'it ' if why else ''}broke a guardrail")
    return " and ".join(why) or "it is not chosen"


def _relative(run_dir: str, study_name: str) -> str:
    """A run dir relative to the study's results dir (so a results dir can move)."""
    parts = run_dir.split(f"/{study_name}/", 1)
    return parts[1] if len(parts) == 2 else run_dir


def best_checkpoints(results: Sequence[RunOutcome], study_name: str) -> Optional[BestCheckpoints]:
    """Each run's checkpoint with the best held-out gold accuracy, and the study's best of them
    (any run that saved one, whatever its status: a checkpoint is a model either way); None when
    no checkpoint's step was evaluated."""
    runs = tuple(CheckpointScore(variant=r.variant, seed=r.seed, step=r.best_checkpoint[0], value=r.best_checkpoint[1],
                                 path=f"{_relative(r.run_dir, study_name)}/checkpoints/step_{r.best_checkpoint[0]}")
                 for r in results if r.best_checkpoint)
    if not runs:
        return None
    return BestCheckpoints(metric=GOLD_METRIC, runs=runs, best=max(runs, key=lambda c: c.rank))

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
Each verdict is checked leaving out one seed at a time (`leave_one_seed_out`): with a handful of
seeds a verdict can hang on one of them, and the report marks such a verdict fragile.
A guardrail is violated by a run whose final-window value is outside its bounds (or missing);
a variant with any violation, or any failed run, is never chosen.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Union

from experiments import stats
from experiments.paths import portable
from experiments.results import (BASELINE, BETTER, DECIDED, EQUIVALENT, INSUFFICIENT, NO_DIFFERENCE, PAIRED,
                                 UNDECIDABLE, VARIANT_FAILED, WELCH, WORSE, BestCheckpoints, CheckpointScore,
                                 Comparison, Decision, GuardrailCheck, PairedComparison, Robustness, RunOutcome,
                                 RunStatus, StudyAggregate, Summary, VariantResult)
from experiments.rundir import GOLD_METRIC
from experiments.study import Study, resolve_analysis

__all__ = ["BETTER", "WORSE", "EQUIVALENT", "NO_DIFFERENCE", "INSUFFICIENT", "VARIANT_FAILED", "UNDECIDABLE",
           "aggregate", "decide", "verdicts", "leave_one_seed_out"]

ANALYSIS_NAMES = {WELCH: "Welch", PAIRED: "paired t"}

Values = Union[Sequence[float], Mapping[int, float]]


def _by_seed(values: Values) -> Dict[int, float]:
    """{seed: value}; a plain sequence's positions are its seeds."""
    return dict(values) if isinstance(values, Mapping) else dict(enumerate(values))


def _verdict(cmp: Dict, n: int, n_base: int, higher: bool, alpha: float, margin: float) -> tuple:
    """(verdict, underpowered, explanation) for one comparison, read from its deciding analysis."""
    analysis = cmp["analysis"]
    own = cmp["paired"] if analysis == PAIRED else cmp  # the deciding analysis's own numbers
    name = ANALYSIS_NAMES[analysis]
    diff, p = own["difference"], cmp["p_value_holm"]
    spread = own["sd_difference"] if analysis == PAIRED else cmp["pooled_std"]
    if n < 2 or n_base < 2:
        return INSUFFICIENT, True, f"{n} vs {n_base} completed seeds; at least 2 each are needed"
    n_used = own["n_pairs"] if analysis == PAIRED else min(n, n_base)
    if n_used < 2:
        return INSUFFICIENT, True, (f"{n_used} seed(s) completed on both sides; the paired analysis needs at "
                                    f"least 2 (study.analysis = 'welch' compares the groups)")
    improves = diff is not None and (diff > 0) == higher and diff != 0
    if p is None and spread == 0 and diff not in (None, 0):
        agree = "every seed agrees" if analysis == WELCH else "every seed pair differs by the same amount"
        return (BETTER if improves else WORSE), False, f"{agree} (zero variance)"
    if p is not None and p < alpha:
        return (BETTER if improves else WORSE), False, f"Holm-corrected {name} p = {p:.3g} < {alpha:g}"
    tost = cmp.get("equivalence_p_holm")
    if margin > 0 and tost is not None and tost < alpha:
        return EQUIVALENT, False, (f"equivalent within ±{margin:g} (TOST p = {tost:.3g} < {alpha:g}, "
                                   f"{name}, Holm-corrected)")
    if margin > 0 and p is None and spread == 0 and diff == 0:
        return EQUIVALENT, False, f"equivalent within ±{margin:g} (every seed agrees: zero variance, no difference)"
    needed, mde = own["seeds_needed"], own["min_detectable_effect"]
    underpowered = needed is None or needed > n_used
    if diff in (None, 0) or needed is None:
        why = "no observed difference"
    else:
        why = (f"{needed} seeds per variant needed to detect the observed difference {diff:+.4g} at 80% power "
               f"({name})")
    if mde is not None:
        why += f"; minimum detectable effect at n={n_used}: {mde:.4g}"
    if diff not in (None, 0) and needed is not None and not underpowered:
        why = f"p = {p:.3g}, enough seeds to detect the observed difference: " + why
    if margin > 0:
        why += (f"; not shown equivalent within ±{margin:g}"
                + (f" (TOST p = {tost:.3g})" if tost is not None else ""))
    return NO_DIFFERENCE, underpowered and diff not in (None, 0), why


def verdicts(values: Mapping[str, Values], higher: bool, alpha: float, analysis: str = WELCH,
             margin: float = 0.0) -> Dict[str, tuple]:
    """{variant: (comparison dict, verdict, underpowered, explanation)} for every variant but the
    baseline. `values`: {variant: {seed: value}} (or a list per variant, its positions the seeds).
    Both analyses are computed against `values['baseline']`; `analysis` ('welch' | 'paired')
    decides, its p-values (and TOST p-values, with a `margin` > 0) Holm-corrected across the
    variants. Pure."""
    by_seed = {n: _by_seed(v) for n, v in values.items()}
    names = [n for n in by_seed if n != BASELINE]
    base = by_seed.get(BASELINE, {})
    comparisons = {}
    for n in names:
        cmp = stats.compare(list(by_seed[n].values()), list(base.values()), higher, alpha, margin)
        cmp["paired"] = stats.compare_paired(by_seed[n], base, alpha, margin)
        cmp["analysis"] = analysis
        comparisons[n] = cmp

    def holm(key: str) -> List[Optional[float]]:
        raw = [(comparisons[n]["paired"] if analysis == PAIRED else comparisons[n])[key] for n in names]
        return [None if p != p else p for p in stats.holm([float("nan") if p is None else p for p in raw])]

    out = {}
    for n, p, tost in zip(names, holm("p_value"), holm("equivalence_p")):
        cmp = comparisons[n]
        cmp["p_value_holm"], cmp["equivalence_p_holm"] = p, tost
        out[n] = (cmp, *_verdict(cmp, len(by_seed[n]), len(base), higher, alpha, margin))
    return out


def leave_one_seed_out(values_by_seed: Mapping[str, Mapping[int, float]], higher: bool,
                       alpha: float, analysis: str = WELCH, margin: float = 0.0) -> Dict[str, Robustness]:
    """Per variant, its verdict with each seed left out of every variant (the baseline too), and
    whether the full-data verdict survives: a better/worse/equivalent verdict that some left-out
    seed undoes, or a 'no detectable difference' that some left-out seed turns into one of them,
    is fragile. Pure: {variant: {seed: value}} in."""
    reference = {n: r[1] for n, r in verdicts(values_by_seed, higher, alpha, analysis, margin).items()}
    seeds = sorted({s for v in values_by_seed.values() for s in v})
    loo: Dict[str, Dict[str, str]] = {n: {} for n in reference}
    for seed in seeds:
        left = {n: {s: x for s, x in v.items() if s != seed} for n, v in values_by_seed.items()}
        for n, r in verdicts(left, higher, alpha, analysis, margin).items():
            loo[n][str(seed)] = r[1]
    out = {}
    for n, verdict in reference.items():
        if verdict in DECIDED:
            bad = [int(s) for s, v in loo[n].items() if v != verdict]
        else:
            bad = [int(s) for s, v in loo[n].items() if v in DECIDED]
        out[n] = Robustness(leave_one_out=loo[n], fragile=bool(bad), fragile_seeds=tuple(bad))
    return out


def _summary(values: Sequence[float]) -> Summary:
    s = stats.summarize(values)
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
    out = {}
    for metric in BESIDE_METRICS:
        if metric == study.metric:
            continue
        values = [r.final[metric] for r in runs
                  if r.status == RunStatus.COMPLETED and r.final and r.final.get(metric) is not None]
        if values:
            out[metric] = _summary(values)
    return out


def aggregate(study: Study, results: Sequence[RunOutcome], provenance: Optional[Dict] = None,
              plots: Optional[Dict[str, str]] = None, adaptive=None, seed_plan=None,
              pilot_correlation: Optional[float] = None) -> StudyAggregate:
    """Study settings, per-variant stats and verdicts, their robustness, and the decision.
    `pilot_correlation`: the correlation between paired seeds a previous round measured, which
    'auto' reads to choose the analysis (`study.resolve_analysis`)."""
    higher = study.direction == "higher"
    by_variant: Dict[str, List[RunOutcome]] = {v.name: [] for v in study.all_variants}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    by_seed = {name: {r.seed: r.value for r in runs if r.status == RunStatus.COMPLETED and r.value is not None}
               for name, runs in by_variant.items()}
    values = {name: list(v.values()) for name, v in by_seed.items()}
    # The design (every planned run, whatever its outcome) picks the analysis, not the values.
    analysis = resolve_analysis(study.analysis, {name: [r.seed for r in runs] for name, runs in by_variant.items()},
                                pilot_correlation, study.alpha)
    margin = study.equivalence_margin
    judged = verdicts(by_seed, higher, study.alpha, analysis, margin)
    robust = leave_one_seed_out(by_seed, higher, study.alpha, analysis, margin)
    declared = {v.name: v for v in study.all_variants}
    metric = f"{study.metric_from} {study.metric}"
    base_completed = sum(r.status == RunStatus.COMPLETED for r in by_variant.get(BASELINE, []))
    variants: Dict[str, VariantResult] = {}
    for name, runs in by_variant.items():
        completed = sum(r.status == RunStatus.COMPLETED for r in runs)
        rails = _guardrails(study, runs)
        fields = dict(
            bindings=tuple(declared[name].bindings) if name in declared else (),
            coupled=bool(declared.get(name) and declared[name].coupled),
            summary=_summary(values[name]),
            runs=tuple(r.as_filed(_relative(r.run_dir, study.name)) for r in runs),
            completed=completed, failed=sum(r.status == RunStatus.FAILED for r in runs),
            incomplete=len(runs) - completed,
            guardrails=rails, guardrails_ok=all(g.ok for g in rails.values()), beside=_beside(study, runs))
        if name == BASELINE:
            variants[name] = VariantResult(**fields)
            continue
        cmp, verdict, underpowered, why = judged[name]
        if completed == 0:
            verdict, underpowered, why = VARIANT_FAILED, False, "no run completed"
        elif not values[name] or (base_completed and not values[BASELINE]):
            verdict, underpowered = UNDECIDABLE, False
            why = f"no run logged {metric}"
        paired = cmp["paired"]
        comparison = Comparison(**{**cmp, "difference_ci95": tuple(cmp["difference_ci95"]),
                                   "paired": PairedComparison(**{**paired, "difference_ci95":
                                                                 tuple(paired["difference_ci95"])})})
        variants[name] = VariantResult(**fields, comparison=comparison,
                                       verdict=verdict,
                                       underpowered=underpowered, explanation=why,
                                       robustness=(robust.get(name) if verdict not in (VARIANT_FAILED, UNDECIDABLE)
                                                   else None))
    return StudyAggregate(
        study=study.name, study_file=portable(study.path), description=study.description, metric=study.metric,
        metric_from=study.metric_from, direction=study.direction, alpha=study.alpha, seeds=tuple(study.seeds),
        guardrails=tuple(g.describe() for g in study.guardrails), variants=variants,
        decision=decide(variants, higher, metric), provenance=provenance or {}, plots=plots or {},
        adaptive=adaptive, seed_plan=seed_plan, best_checkpoints=best_checkpoints(results, study.name),
        analysis=analysis, equivalence_margin=margin)


def decide(variants: Dict[str, VariantResult], higher: bool, metric: str = "the decision metric") -> Decision:
    """The chosen variant: the best `better` one with clean guardrails and every run completed, else the
    baseline (an `equivalent` variant is no reason to change: the baseline stays). No choice (None) when no run completed, or none logged the metric."""
    flagged = tuple(sorted(n for n, v in variants.items() if not v.guardrails_ok))
    if not any(v.completed for v in variants.values()):
        return Decision(None, "no decision: no run completed", flagged)
    if not any(v.values for v in variants.values()):
        return Decision(None, f"no decision: no completed run logged {metric}", flagged)
    base = variants.get(BASELINE)
    if base is not None and not base.values:
        return Decision(None, f"no decision: no baseline run {'logged ' + metric if base.completed else 'completed'}",
                        flagged)
    candidates = [n for n, v in variants.items() if v.verdict == BETTER and v.guardrails_ok and v.incomplete == 0]
    if candidates:
        sign = 1 if higher else -1
        chosen = max(candidates, key=lambda n: sign * variants[n].summary.mean)
        reason = f"{chosen} is better than the baseline ({variants[chosen].explanation})"
        if variants[chosen].fragile:
            seeds = ", ".join(map(str, variants[chosen].robustness.fragile_seeds))
            reason += f"; fragile: the verdict does not survive leaving out seed {seeds}"
        return Decision(chosen, reason, flagged)
    return Decision(BASELINE, "no variant is detectably better with its guardrails holding; keep the baseline",
                    flagged)


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
    return BestCheckpoints(metric=GOLD_METRIC, runs=runs, best=max(runs, key=lambda c: c.value))

"""Aggregate and decide: per-variant statistics, a verdict against the baseline, the chosen variant.

Input: the collected run results; output: a `results.StudyAggregate` (saved as aggregate.json),
which the report renders and a later study's `resume_from` reads (`decision.chosen`). Verdicts:
- `better` / `worse`: Holm-corrected Welch p-value below `study.alpha`, in the metric's direction;
- `no detectable difference`, marked `underpowered` when the observed difference would need more
  seeds than were run to be detected with 80% power;
- `insufficient data`: fewer than two completed seeds on either side; `failed`: no run completed;
  `undecidable`: runs completed but none logged the decision metric.
Each verdict is checked leaving out one seed at a time (`leave_one_seed_out`): with a handful of
seeds a verdict can hang on one of them, and the report marks such a verdict fragile.
A guardrail is violated by a run whose final-window value is outside its bounds (or missing);
a variant with any violation, or any failed run, is never chosen.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

from experiments import stats
from experiments.collect import RunResult
from experiments.results import (BASELINE, BETTER, DECIDED, FAILED, INSUFFICIENT, NO_DIFFERENCE, UNDECIDABLE,
                                 WORSE, BestCheckpoints, CheckpointScore, Comparison, Decision, GuardrailCheck,
                                 Robustness, RunOutcome, StudyAggregate, Summary, VariantResult)
from experiments.rundir import COMPLETED, GOLD_METRIC
from experiments.study import Study

__all__ = ["BETTER", "WORSE", "NO_DIFFERENCE", "INSUFFICIENT", "FAILED", "UNDECIDABLE", "aggregate", "decide",
           "verdicts", "leave_one_seed_out"]


def _verdict(cmp: Dict, n: int, n_base: int, higher: bool, alpha: float) -> tuple:
    """(verdict, underpowered, explanation) for one comparison."""
    diff, p = cmp["difference"], cmp["p_value_holm"]
    if n < 2 or n_base < 2:
        return INSUFFICIENT, True, f"{n} vs {n_base} completed seeds; at least 2 each are needed"
    improves = diff is not None and (diff > 0) == higher and diff != 0
    if p is None and cmp["pooled_std"] == 0 and diff not in (None, 0):
        return (BETTER if improves else WORSE), False, "every seed agrees (zero variance)"
    if p is not None and p < alpha:
        return (BETTER if improves else WORSE), False, f"Holm-corrected p = {p:.3g} < {alpha:g}"
    needed, mde = cmp["seeds_needed"], cmp["min_detectable_effect"]
    underpowered = needed is None or needed > min(n, n_base)
    if diff in (None, 0) or needed is None:
        why = "no observed difference"
    else:
        why = f"{needed} seeds per variant needed to detect the observed difference {diff:+.4g} at 80% power"
    if mde is not None:
        why += f"; minimum detectable effect at n={min(n, n_base)}: {mde:.4g}"
    if diff not in (None, 0) and needed is not None and not underpowered:
        why = f"p = {p:.3g}, enough seeds to detect the observed difference: " + why
    return NO_DIFFERENCE, underpowered and diff not in (None, 0), why


def verdicts(values: Mapping[str, Sequence[float]], higher: bool, alpha: float) -> Dict[str, tuple]:
    """{variant: (comparison dict, verdict, underpowered, explanation)} for every variant but the
    baseline: Welch against `values['baseline']`, Holm across the variants. Pure."""
    names = [n for n in values if n != BASELINE]
    base = list(values.get(BASELINE, ()))
    comparisons = {n: stats.compare(values[n], base, higher, alpha) for n in names}
    adjusted = stats.holm([comparisons[n]["p_value"] if comparisons[n]["p_value"] is not None else float("nan")
                           for n in names])
    out = {}
    for n, p in zip(names, adjusted):
        cmp = comparisons[n]
        cmp["p_value_holm"] = None if p != p else p
        out[n] = (cmp, *_verdict(cmp, len(values[n]), len(base), higher, alpha))
    return out


def leave_one_seed_out(values_by_seed: Mapping[str, Mapping[int, float]], higher: bool,
                       alpha: float) -> Dict[str, Robustness]:
    """Per variant, its verdict with each seed left out of every variant (the baseline too), and
    whether the full-data verdict survives: a better/worse verdict that some left-out seed
    undoes, or a 'no detectable difference' that some left-out seed turns into better/worse,
    is fragile. Pure: {variant: {seed: value}} in."""
    full = {n: list(v.values()) for n, v in values_by_seed.items()}
    reference = {n: r[1] for n, r in verdicts(full, higher, alpha).items()}
    seeds = sorted({s for v in values_by_seed.values() for s in v})
    loo: Dict[str, Dict[str, str]] = {n: {} for n in reference}
    for seed in seeds:
        left = {n: [x for s, x in v.items() if s != seed] for n, v in values_by_seed.items()}
        for n, r in verdicts(left, higher, alpha).items():
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


def _guardrails(study: Study, runs: Sequence[RunResult]) -> Dict[str, GuardrailCheck]:
    out = {}
    for g in study.guardrails:
        values = {r.seed: r.guardrails.get(g.metric) for r in runs if r.status == COMPLETED}
        violations = tuple(sorted(seed for seed, v in values.items() if g.violated_by(v)))
        out[g.metric] = GuardrailCheck(bound=g.describe(), min=g.min, max=g.max,
                                       values={str(k): v for k, v in values.items()},
                                       violated_seeds=violations, ok=not violations)
    return out


BESIDE_METRICS = ("eval/accuracy", "eval/rm_score")
"""Final held-out metrics every report shows beside the decision metric when the runs log them:
gold accuracy and the reward model's score, so over-optimisation of a reward model is visible."""


def _beside(study: Study, runs: Sequence[RunResult]) -> Dict[str, Summary]:
    out = {}
    for metric in BESIDE_METRICS:
        if metric == study.metric:
            continue
        values = [r.final[metric] for r in runs if r.status == COMPLETED and r.final and r.final.get(metric) is not None]
        if values:
            out[metric] = _summary(values)
    return out


def aggregate(study: Study, results: Sequence[RunResult], provenance: Optional[Dict] = None,
              plots: Optional[Dict[str, str]] = None, adaptive=None, seed_plan=None) -> StudyAggregate:
    """Study settings, per-variant stats and verdicts, their robustness, and the decision."""
    higher = study.direction == "higher"
    by_variant: Dict[str, List[RunResult]] = {v.name: [] for v in study.all_variants}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    by_seed = {name: {r.seed: r.value for r in runs if r.status == COMPLETED and r.value is not None}
               for name, runs in by_variant.items()}
    values = {name: list(v.values()) for name, v in by_seed.items()}
    judged = verdicts(values, higher, alpha=study.alpha)
    robust = leave_one_seed_out(by_seed, higher, study.alpha)
    declared = {v.name: v for v in study.all_variants}
    metric = f"{study.metric_from} {study.metric}"
    base_completed = sum(r.status == COMPLETED for r in by_variant.get(BASELINE, []))
    variants: Dict[str, VariantResult] = {}
    for name, runs in by_variant.items():
        completed = sum(r.status == COMPLETED for r in runs)
        rails = _guardrails(study, runs)
        fields = dict(
            bindings=tuple(declared[name].bindings) if name in declared else (),
            coupled=bool(declared.get(name) and declared[name].coupled),
            summary=_summary(values[name]),
            runs=tuple(RunOutcome(seed=r.seed, status=r.status, value=r.value, error=r.error, steps=r.steps,
                                  run_dir=_relative(r.run_dir, study.name), guardrails=r.guardrails)
                       for r in runs),
            completed=completed, failed=sum(r.status == "failed" for r in runs), incomplete=len(runs) - completed,
            guardrails=rails, guardrails_ok=all(g.ok for g in rails.values()), beside=_beside(study, runs))
        if name == BASELINE:
            variants[name] = VariantResult(**fields)
            continue
        cmp, verdict, underpowered, why = judged[name]
        if completed == 0:
            verdict, underpowered, why = FAILED, False, "no run completed"
        elif not values[name] or (base_completed and not values[BASELINE]):
            verdict, underpowered = UNDECIDABLE, False
            why = f"no run logged {metric}"
        variants[name] = VariantResult(**fields, comparison=Comparison(**{**cmp, "difference_ci95": tuple(cmp["difference_ci95"])}),
                                       verdict=verdict,
                                       underpowered=underpowered, explanation=why,
                                       robustness=robust.get(name) if verdict not in (FAILED, UNDECIDABLE) else None)
    return StudyAggregate(
        study=study.name, study_file=study.path, description=study.description, metric=study.metric,
        metric_from=study.metric_from, direction=study.direction, alpha=study.alpha, seeds=tuple(study.seeds),
        guardrails=tuple(g.describe() for g in study.guardrails), variants=variants,
        decision=decide(variants, higher, metric), provenance=provenance or {}, plots=plots or {},
        adaptive=adaptive, seed_plan=seed_plan, best_checkpoints=best_checkpoints(results, study.name))


def decide(variants: Dict[str, VariantResult], higher: bool, metric: str = "the decision metric") -> Decision:
    """The chosen variant: the best `better` one with clean guardrails and every run completed, else the
    baseline. No choice (None) when no run completed, or none logged the metric."""
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


def best_checkpoints(results: Sequence[RunResult], study_name: str) -> Optional[BestCheckpoints]:
    """Each run's checkpoint with the best held-out gold accuracy, and the study's best of them
    (any run that saved one, whatever its status: a checkpoint is a model either way); None when
    no checkpoint's step was evaluated."""
    runs = tuple(CheckpointScore(variant=r.variant, seed=r.seed, step=r.best_checkpoint[0], value=r.best_checkpoint[1],
                                 path=f"{_relative(r.run_dir, study_name)}/checkpoints/step_{r.best_checkpoint[0]}")
                 for r in results if r.best_checkpoint)
    if not runs:
        return None
    return BestCheckpoints(metric=GOLD_METRIC, runs=runs, best=max(runs, key=lambda c: c.value))

"""Aggregate and decide: per-variant statistics, a verdict against the baseline, the chosen variant.

Input: the collected run results; output: the `aggregate.json` dict, which the report renders
and a later study's `resume_from` reads (`decision.chosen`). Verdicts:
- `better` / `worse`: Holm-corrected Welch p-value below `study.alpha`, in the metric's direction;
- `no detectable difference`, marked `underpowered` when the observed difference would need more
  seeds than were run to be detected with 80% power;
- `insufficient data`: fewer than two completed seeds on either side; `failed`: no run completed.
A guardrail is violated by a run whose final-window value is outside its bounds (or missing);
a variant with any violation, or any failed run, is never chosen.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from experiments import stats
from experiments.collect import RunResult
from experiments.rundir import COMPLETED
from experiments.study import BASELINE, Study

BETTER, WORSE, NO_DIFFERENCE, INSUFFICIENT, FAILED = (
    "better", "worse", "no detectable difference", "insufficient data", "failed")


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


def _guardrails(study: Study, runs: Sequence[RunResult]) -> Dict:
    out = {}
    for g in study.guardrails:
        values = {r.seed: r.guardrails.get(g.metric) for r in runs if r.status == COMPLETED}
        violations = sorted(seed for seed, v in values.items() if g.violated_by(v))
        out[g.metric] = {"bound": g.describe(), "min": g.min, "max": g.max,
                         "values": {str(k): v for k, v in values.items()}, "violated_seeds": violations,
                         "ok": not violations}
    return out


def aggregate(study: Study, results: Sequence[RunResult], provenance: Dict = None) -> Dict:
    """The aggregate.json dict: study settings, per-variant stats and verdicts, the decision."""
    higher = study.direction == "higher"
    by_variant: Dict[str, List[RunResult]] = {v.name: [] for v in study.all_variants}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    values = {name: [r.value for r in runs if r.status == COMPLETED and r.value is not None]
              for name, runs in by_variant.items()}
    variants: Dict[str, Dict] = {}
    declared = {v.name: v for v in study.all_variants}
    for name, runs in by_variant.items():
        completed = sum(r.status == COMPLETED for r in runs)
        variants[name] = {
            "bindings": list(declared[name].bindings) if name in declared else [],
            "coupled": bool(declared.get(name) and declared[name].coupled),
            "summary": stats.summarize(values[name]),
            "runs": [{"seed": r.seed, "status": r.status, "value": r.value, "error": r.error,
                      "steps": r.steps, "run_dir": _relative(r.run_dir, study.name),
                      "guardrails": r.guardrails} for r in runs],
            "completed": completed, "failed": sum(r.status == "failed" for r in runs),
            "incomplete": len(runs) - completed,
            "guardrails": _guardrails(study, runs),
        }
    names = [n for n in variants if n != BASELINE]
    comparisons = {n: stats.compare(values[n], values[BASELINE], higher, study.alpha) for n in names}
    adjusted = stats.holm([comparisons[n]["p_value"] if comparisons[n]["p_value"] is not None else float("nan")
                           for n in names])
    for n, p in zip(names, adjusted):
        cmp = comparisons[n]
        cmp["p_value_holm"] = None if p != p else p
        if variants[n]["completed"] == 0:
            verdict, underpowered, why = FAILED, False, "no run completed"
        else:
            verdict, underpowered, why = _verdict(cmp, len(values[n]), len(values[BASELINE]), higher, study.alpha)
        variants[n].update(comparison=cmp, verdict=verdict, underpowered=underpowered, explanation=why)
    variants[BASELINE].update(verdict="baseline", underpowered=False, explanation="",
                              comparison=None)
    for v in variants.values():
        v["guardrails_ok"] = all(g["ok"] for g in v["guardrails"].values())
    return {
        "study": study.name, "study_file": study.path, "description": study.description,
        "metric": study.metric, "metric_from": study.metric_from, "direction": study.direction,
        "alpha": study.alpha, "seeds": list(study.seeds),
        "guardrails": [g.describe() for g in study.guardrails],
        "variants": variants, "decision": decide(variants, higher),
        "provenance": provenance or {},
    }


def decide(variants: Dict[str, Dict], higher: bool) -> Dict:
    """The chosen variant: the best `better` one with clean guardrails and every run completed, else the
    baseline (when its own guardrails hold)."""
    candidates = [n for n, v in variants.items() if v["verdict"] == BETTER and v["guardrails_ok"]
                  and v["incomplete"] == 0]
    if candidates:
        sign = 1 if higher else -1
        chosen = max(candidates, key=lambda n: sign * variants[n]["summary"]["mean"])
        reason = f"{chosen} is better than the baseline ({variants[chosen]['explanation']})"
    else:
        chosen = BASELINE
        reason = "no variant is detectably better with its guardrails holding; keep the baseline"
    flagged = sorted(n for n, v in variants.items() if not v["guardrails_ok"])
    return {"chosen": chosen, "reason": reason, "guardrail_violations": flagged}


def _relative(run_dir: str, study_name: str) -> str:
    """A run dir relative to the study's results dir (so a results dir can move)."""
    parts = run_dir.split(f"/{study_name}/", 1)
    return parts[1] if len(parts) == 2 else run_dir

"""Markdown for the tuning path: what the advisor saw before each round, and what the round made of it.

The final report (`python -m experiments summary`) shows, for every round that resumed
from a previous one, the rules that fired on the previous round's chosen variant with their
evidence and rationale, next to the variant of this round that tested the change and its
verdict. A change the advisor proposed that no variant tested, a variant testing a change a
stronger rule superseded, or a variant no rule proposed, is said so: the report shows where
the path followed the data and where a person chose otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from experiments.advisor.advise import advise
from experiments.advisor.window import AdviceError, load_window
from experiments.results import BASELINE, StudyAggregate
from experiments.run_records import scalar, summary


def _fmt(evidence: Dict) -> str:
    return ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in evidence.items()
                     if v is not None)


def run_values(aggregate: StudyAggregate, study_dir: Path, variant: str, section: str, metric: str) -> List[float]:
    """`metric` from the `section` of summary.json ('initial', 'final_window', ...) of each of
    `variant`'s runs that has it."""
    values = []
    for run in aggregate.variants[variant].runs if variant in aggregate.variants else ():
        v = scalar(((summary(study_dir / run.run_dir) or {}).get(section) or {}).get(metric))
        if v is not None:
            values.append(v)
    return values


def measured(aggregate: StudyAggregate, study_dir: Path, variant: str, metric: str) -> Optional[float]:
    """Mean over `variant`'s completed seeds of `metric` over the final window (summary.json)."""
    values = run_values(aggregate, study_dir, variant, "final_window", metric)
    return sum(values) / len(values) if values else None


def _prediction(predicted: Dict[str, float], aggregate: StudyAggregate, study_dir: Optional[Path],
                variant: Optional[str]) -> str:
    """'kl_divergence 0.08 -> measured 0.47 (x5.9)': a rule's prediction beside the round's measurement."""
    parts = []
    for metric, value in predicted.items():
        seen = measured(aggregate, study_dir, variant, metric) if variant and study_dir is not None else None
        text = f"{metric} {value:.3g}"
        if seen is not None:
            text += f" -> measured {seen:.3g}" + (f" (x{seen / value:.2g})" if value else "")
        parts.append(text)
    return "; ".join(parts) or "-"


def advice_lines(previous_dir: Path, aggregate: StudyAggregate, study_dir: Optional[Path] = None) -> List[str]:
    """The advisor's suggestions on `previous_dir`'s chosen variant, matched to this round's variants
    (found in `study_dir`, which also gives what the variants measured against the rules'
    predictions)."""
    try:
        window = load_window(previous_dir)
    except AdviceError as err:
        return [f"Advisor: not available ({err}).", ""]
    advice = advise(window)
    tested = {b: name for name, v in aggregate.variants.items() for b in v.bindings}
    lines = [f"Advisor on {previous_dir.name}/{window.variant} (last {len(window.steps)} steps, "
             f"{len(window.seeds)} seeds):", "",
             "| rule | proposed change | evidence | predicted -> measured | tested as | verdict |",
             "|---|---|---|---|---|---|"]
    for s in advice.warnings:
        lines.append(f"| {s.rule} | flag: {s.rationale} | {_fmt(s.evidence)} | - | - | - |")
    proposed = set()
    for s in advice.changes:
        for i, binding in enumerate(s.bindings):
            proposed.add(binding)
            name = tested.get(binding)
            verdict = aggregate.variants[name].verdict if name else "not tested this round"
            evidence = _fmt(s.evidence) if i == 0 else "the bracket's next value (evidence above)"
            predicted = _prediction(s.predicted[i] if i < len(s.predicted) else {}, aggregate, study_dir, name)
            lines.append(f"| {s.rule} | `{binding}` (from {s.current!r}) | {evidence} | {predicted} | {name or '-'} | "
                         f"{verdict} |")
    superseded = {b: s for s in advice.superseded for b in s.bindings}
    for binding, name in tested.items():
        if binding in proposed:
            continue
        verdict = aggregate.variants[name].verdict
        s = superseded.get(binding)
        if s is not None:
            lines.append(f"| {s.rule} (superseded) | `{binding}` (from {s.current!r}) | {_fmt(s.evidence)} | - | "
                         f"{name} | {verdict} |")
        else:
            lines.append(f"| (none) | `{binding}` | no rule proposed it | - | {name} | {verdict} |")
    lines += ["", *(f"- {s.rule}: {s.rationale}" for s in advice.changes), ""] if advice.changes else [""]
    lines += [f"Rules silent: {', '.join(advice.silent) or 'none'}.", ""]
    return lines


def initial_values(aggregate: StudyAggregate, study_dir: Path, metric: str) -> List[float]:
    """`metric` at the start of each baseline run, before any training (summary.json's `initial`)."""
    return run_values(aggregate, study_dir, BASELINE, "initial", metric)

"""The next study, written as a gin recipe from a finished study and the advice on it.

The next round's baseline is this round's chosen setting: the same engine recipe and baseline
bindings as were run (read from plan.json, so `-b` bindings given at run time are kept), plus
the chosen variant's change, resuming from this study's results dir (the planner then starts
every seed from the chosen variant's checkpoint of that seed). Each suggested change becomes
one variant, a bracket one variant per value (each still a single parameter); the decision
metric, direction, seeds, guardrails, equivalence margin and resources carry over (a change the
study found equivalent or worse is not proposed again). The evidence is written in the recipe's
header, so the file explains itself when read later.

When this round had a target effect (its aggregate's `seed_plan`), the next round's seeds are
planned from this round's spread for that target (experiments/seed_plan.py, alpha / the next
round's variants): `study.seeds` is the planned N, the header gives the plan's line, and the
target and power carry over, so `plan` on the next round (whose pilot is this round, through
resume_from) prints the same line.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

from experiments.advisor.advise import Advice
from experiments.advisor.window import AdviceError
from experiments.paths import portable
from experiments.plan import plan_path
from experiments.results import StudyAggregate, aggregate_path, read_aggregate
from experiments.run_records import read_json
from experiments.seed_plan import make_plan, plan_line
from experiments.study import BASELINE, MANAGED_BINDINGS, split_binding
from rlhf.configurable import RECIPES_DIR


def _key(binding: str) -> str:
    return split_binding(binding, "binding")[0]


def baseline_of_next(study_dir: Path, chosen: str) -> tuple:
    """(engine recipe, baseline bindings) of the next round: what was run plus the chosen change."""
    plan = read_json(plan_path(study_dir))
    agg = _aggregate(study_dir)
    if plan is None or not plan.get("runs"):
        raise AdviceError(f"{plan_path(study_dir)} not found: the advisor reads the bindings that were run")
    base = next((r for r in plan["runs"] if r["variant"] == BASELINE), plan["runs"][0])
    bindings = [b for b in base["bindings"] if _key(b) not in MANAGED_BINDINGS]
    change = list(agg.variants[chosen].bindings) if chosen != BASELINE and chosen in agg.variants else []
    changed = {_key(b) for b in change}
    return base["recipe"], [b for b in bindings if _key(b) not in changed] + change


def _gin_list(items: Sequence[str], indent: str = "    ") -> str:
    if not items:
        return "[]"
    return "[\n" + "".join(f"{indent}{item!r},\n" for item in items) + "]"


def _aggregate(study_dir: Path) -> StudyAggregate:
    return read_aggregate(study_dir, f"{aggregate_path(study_dir)} not found: run or report the study first",
                          AdviceError)


def _guardrails(agg: StudyAggregate) -> dict:
    base = agg.variants.get(BASELINE)
    rails = base.guardrails if base else {}
    return {metric: {k: v for k, v in (("min", g.min), ("max", g.max)) if v is not None}
            for metric, g in rails.items()}


def next_study_text(study_dir: str | Path, advice: Advice, name: Optional[str] = None,
                    max_variants: Optional[int] = None, seeds=None, command: str = "",
                    cwd: Optional[Path] = None) -> str:
    """The next study recipe: one variant per suggested value (the top `max_variants` variants)."""
    study_dir = Path(study_dir)
    cwd = cwd or Path.cwd()
    agg = _aggregate(study_dir)
    chosen = agg.decision.chosen
    if chosen is None:
        raise AdviceError(f"{study_dir}: the study decided nothing ({agg.decision.reason}); nothing to continue from")
    recipe, bindings = baseline_of_next(study_dir, chosen)
    if Path(recipe).resolve().is_relative_to(RECIPES_DIR.resolve()):
        recipe = str(Path(recipe).resolve().relative_to(RECIPES_DIR.resolve()))
    else:
        recipe = portable(recipe, cwd)
    kept = advice.variants(max_variants)
    plan = read_json(plan_path(study_dir)) or {}
    cpus = (plan.get("runs") or [{}])[0].get("cpus", 1)
    name = name or f"{agg.study}_next"
    lines: List[str] = [
        f"# Next round after study {agg.study!r}, proposed by the tuning advisor"
        + (f":\n#   {command}" if command else "."),
        f"# Baseline: {agg.study}'s chosen setting {chosen!r} ({agg.decision.reason}),",
        "# resuming from its checkpoints (study.resume_from). One variant per suggested value, ranked:",
    ]
    suggestions = [s for s in advice.changes if any(s is k for k, _, _ in kept)]
    for i, s in enumerate(suggestions, 1):
        evidence = ", ".join(f"{k} = {v}" for k, v in s.evidence.items() if v is not None)
        names = ", ".join(variant for k, variant, _ in kept if k is s)
        lines += [f"#   {i}. {names} [{s.rule}]: {s.change}", f"#      why: {s.rationale}",
                  f"#      evidence (window of {agg.study}/{chosen}): {evidence}"]
    for s in advice.warnings:
        lines.append(f"#   flag [{s.rule}]: {s.rationale} ({s.evidence})")
    for s, why in advice.settled:
        lines.append(f"#   settled [{s.rule}]: {s.binding} not proposed again: {why}")
    if not kept:
        lines.append("#   (no rule fired: this round re-runs the chosen setting from its checkpoints)")
    target = agg.seed_plan
    planned = None
    if target is not None:
        planned = make_plan(agg, target_effect=target.target_effect, power=target.power, alpha=agg.alpha,
                            variants=len(kept), seeds_run=0)
        lines += [f"# Seeds, planned for study.target_effect from {agg.study}'s spread:",
                  f"#   {plan_line(planned, agg.direction)}"]
    variants = ("{\n" + "".join(f"    {variant!r}: {binding!r},\n" for _, variant, binding in kept) + "}"
                if kept else "{}")
    if seeds is None and planned is not None and planned.seeds is not None:
        seeds = planned.seeds
    seeds = seeds if seeds is not None else list(agg.seeds) or 3
    resume = portable(str(study_dir), cwd)
    description = f"Advised from {agg.study} ({chosen}): one suggested change per variant."
    lines += [
        "",
        f"study.name = {name!r}",
        f"study.description = {description!r}",
        f"study.baseline_recipe = {recipe!r}",
        f"study.baseline_bindings = {_gin_list(bindings)}",
        f"study.variants = {variants}",
        f"study.seeds = {list(seeds) if not isinstance(seeds, int) else seeds!r}",
        f"study.metric = {agg.metric!r}",
        f"study.metric_from = {agg.metric_from!r}",
        f"study.direction = {agg.direction!r}",
        f"study.guardrails = {_guardrails(agg)!r}",
        *([f"study.equivalence_margin = {agg.equivalence_margin!r}"] if agg.equivalence_margin else []),
        f"study.resume_from = {resume!r}",
        f"study.cpus_per_run = {int(cpus)!r}",
        *([f"study.campaign = {plan['campaign']!r}"] if plan.get("campaign") else []),  # the same W&B project
    ]
    if target is not None:
        lines += [f"study.target_effect = {target.target_effect!r}", f"study.power = {target.power!r}",
                  f"study.alpha = {agg.alpha!r}"]
    lines.append("")
    return "\n".join(lines)

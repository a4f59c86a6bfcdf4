"""Collect: the run dirs of a launched plan, read into run records (`results.RunOutcome`) and
per-step curves.

Reads `plan.json` (written at launch) and each run dir; writes nothing. Non-scalar metrics
(the policy-ratio histogram) are skipped. A run counts as completed only when its summary.json
says so and its hash matches the plan.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, cast

import numpy as np

from experiments.errors import StudyError
from experiments.plan import RunSpec, plan_path
from experiments.results import RunOutcome, RunStatus, SeedPlan
from experiments.run_records import best_checkpoint, iter_metrics, last_attempt, read_json, scalar, state, summary
from experiments.study import Study
from rlhf.config import PPOConfig


def load_plan(study_dir: Path) -> List[RunSpec]:
    plan = read_json(plan_path(study_dir))
    if plan is None:
        raise StudyError(f"{plan_path(study_dir)} not found: run `python -m experiments run` on the study first")
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    return [RunSpec(**{"placement": "local", "final_window": _final_window(run.get("operative_config", "")),
                       **{k: (tuple(v) if k == "bindings" else v) for k, v in run.items() if k in fields},
                       "run_dir": str(Path(study_dir) / run["run_dir"])})  # spec_record: relative to the study
            for run in plan["runs"]]


def load_seed_plan(study_dir: Path) -> Optional[SeedPlan]:
    """The seed plan plan.json recorded at launch (experiments/seed_plan.py); None when it has none."""
    recorded = (read_json(plan_path(study_dir)) or {}).get("seed_plan")
    return SeedPlan.from_json(recorded) if recorded else None


def _final_window(operative: str) -> int:
    """`ppo.final_window` of an operative config (a plan.json written before RunSpec recorded it)."""
    m = re.search(r"^ppo\.final_window\s*=\s*(\d+)", operative, re.M)
    # cast: PPOConfig.final_window has a plain int default (never dataclasses.MISSING)
    return int(m.group(1)) if m else cast(int, next(f.default for f in dataclasses.fields(PPOConfig)
                                                    if f.name == "final_window"))


def final_window_value(run_dir: str, metric: str, window: int) -> Optional[float]:
    """Mean of `metric` over the last `window` steps of metrics.jsonl (when summary.json lacks it)."""
    values = [v for v in (scalar(r.get(metric)) for r in iter_metrics(run_dir)) if v is not None]
    return float(np.mean(values[-window:])) if values else None


def read_run(spec: RunSpec, study: Study) -> RunOutcome:
    """The run record of `spec`'s run dir: its state and, when it completed, its decision metric,
    guardrail values and final evaluation. A completed run whose decision metric is not a finite
    number (NaN, inf, or the null a strict writer turns them into) counts as failed, with that as
    its error; a run that never logged the metric stays completed (the verdict says 'undecidable')."""
    st = state(spec)
    s = summary(spec.run_dir) if st == RunStatus.COMPLETED else None
    guards: Dict[str, Optional[float]] = {}
    value, error = None, None
    if s is not None:
        logged = s.get(study.metric_from) or {}
        value = scalar(logged.get(study.metric))
        if study.metric in logged and (value is None or not math.isfinite(value)):
            # NaN or inf (written as null by a strict JSON writer) is no value: no verdict may read it
            shown = "null" if logged[study.metric] is None else value
            st, error = RunStatus.FAILED, f"{study.metric_from} {study.metric} = {shown} (not a finite number)"
            value = None
        window = s.get("final_window") or {}
        for g in study.guardrails:
            guards[g.metric] = scalar(window.get(g.metric))
            if guards[g.metric] is None:
                guards[g.metric] = final_window_value(spec.run_dir, g.metric, spec.final_window)
    elif study.guardrails:
        guards = {g.metric: None for g in study.guardrails}
    attempt = last_attempt(spec.run_dir)
    return RunOutcome(variant=spec.variant, seed=spec.seed, run_dir=spec.run_dir, status=st, value=value,
                      guardrails=guards, error=error or (attempt.get("error") if st != RunStatus.COMPLETED else None),
                      steps=(s or {}).get("steps"), final=(s or {}).get("final"),
                      best_checkpoint=best_checkpoint(spec.run_dir))


def collect(specs: Sequence[RunSpec], study: Study) -> List[RunOutcome]:
    return [read_run(spec, study) for spec in specs]


def curves(run_dir: str, metrics: Sequence[str]) -> Dict[str, tuple]:
    """{metric: (steps, values)} of the scalar metrics logged by one run."""
    out: Dict[str, tuple] = {m: ([], []) for m in metrics}
    for row in iter_metrics(run_dir):
        for m in metrics:
            v = scalar(row.get(m))
            if v is not None:
                out[m][0].append(int(row["step"]))
                out[m][1].append(v)
    return {m: (np.asarray(s), np.asarray(v)) for m, (s, v) in out.items()}


def band(per_seed: Sequence[tuple]) -> tuple:
    """Mean and std over seeds at each step any seed logged: (steps, mean, std), NaN-aware. The
    std has ddof = 1, as the report's tables: the spread of the seeds as a sample, NaN (no band)
    where fewer than two seeds logged the step."""
    steps = sorted({int(s) for st, _ in per_seed for s in st})
    if not steps:
        return np.array([]), np.array([]), np.array([])
    grid = np.full((len(per_seed), len(steps)), math.nan)
    col = {s: i for i, s in enumerate(steps)}
    for row, (st, vals) in enumerate(per_seed):
        for s, v in zip(st, vals):
            grid[row, col[int(s)]] = v
    with np.errstate(all="ignore"):
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(grid, axis=0)
            std = np.nanstd(grid, axis=0, ddof=1)
    return np.asarray(steps), mean, std

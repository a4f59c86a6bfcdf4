"""Running a planned study: what `python -m experiments run` does once the plan is made.

A fixed design is one launch of the whole plan. A study with `study.adaptive_seeds` is one launch
per look: each look plans the baseline and the still-undecided variants at the current seed count
and launches that plan; runs already finished (same hash) are skipped, so a look costs only its
new seeds, and an interrupted adaptive study resumes like any other. Either way the runs the plan
no longer has are then removed and the report written; the adaptive report covers every run of
every look, with an `adaptive` section (seeds per variant, the look that decided it, runs used
against the fixed design) built into the aggregate before it is written. SIGTERM stops a study
like Ctrl-C: runs are stopped in order and recorded as interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from argparse import Namespace
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console

from experiments.adaptive import Measured, extra_seeds, run_looks
from experiments.collect import collect
from experiments.errors import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNS_FAILED, INTERRUPTED
from experiments.launch import LaunchResult, StudyBusy, launch, prune_superseded
from experiments.plan import RunSpec, expand, study_dir
from experiments.results import BASELINE, AdaptiveRecord, AdaptiveVariant, RunStatus, SeedPlan
from experiments.study import Study


def run_study(study: Study, specs: List[RunSpec], args: Namespace, console: Console,
              seed_plan: Optional[SeedPlan] = None) -> int:
    """Runs the plan `specs` of `study` (adaptive seeds: its looks) on Ray with the command line's
    settings (`args`), then writes the report; returns the command's exit code. `seed_plan`, the
    seeds planned for study.target_effect, is recorded; an adaptive study's max_seeds is set
    (`seed_plan.with_planned_max_seeds`)."""
    if study.adaptive_seeds is not None:
        return run_adaptive(study, args, console, seed_plan)
    return run_fixed(study, specs, args, console, seed_plan)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM stops a study like Ctrl-C: runs are stopped in order and recorded as interrupted."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _launch(study: Study, specs: List[RunSpec], args: Namespace, seed_plan: Optional[SeedPlan],
            recorded: Optional[List[RunSpec]] = None) -> LaunchResult:
    """`launch.launch` with the command line's Ray, cache and rerun settings."""
    return launch(study, specs, Path(args.results), ray_address=args.ray_address, num_cpus=args.num_cpus,
                  num_gpus=args.num_gpus, cache_dir=args.cache_dir, rerun_failed=args.rerun_failed,
                  argv=args.argv, recorded=recorded, seed_plan=seed_plan)


def run_fixed(study: Study, specs: List[RunSpec], args: Namespace, console: Console,
              seed_plan: Optional[SeedPlan]) -> int:
    """One launch of the whole plan, then the report and the study's W&B aggregate run."""
    from experiments.report import REPORT, write_report
    t0 = time.monotonic()
    try:
        with sigterm_as_interrupt():
            result = _launch(study, specs, args, seed_plan)
    except StudyBusy as err:
        console.print(f"error: {err}", highlight=False)
        return EXIT_CONFIG
    console.print(f"{study.name}: {len(result.completed)} completed, {len(result.skipped)} already done, "
                  f"{len(result.failed)} failed in {time.monotonic() - t0:.0f}s", highlight=False)
    for key, error in result.failed.items():
        console.print(f"  failed {key}: {error}", highlight=False, soft_wrap=True)
    if result.interrupted:
        console.print(INTERRUPTED, highlight=False)
        return EXIT_INTERRUPTED
    report_pruned(prune_superseded(study_dir(study, args.results), specs), console)
    agg = write_report(study, study_dir(study, args.results), specs, seed_plan=seed_plan)
    log_wandb_aggregate(study, specs, args, console)
    console.print(f"{decision_line(agg)}; report: {study_dir(study, args.results) / REPORT}",
                  highlight=False, soft_wrap=True)
    return EXIT_RUNS_FAILED if result.failed or agg.decision.chosen is None else EXIT_OK


def run_adaptive(study: Study, args: Namespace, console: Console, seed_plan: Optional[SeedPlan] = None) -> int:
    """Looks until every variant is decided or at max_seeds; SIGTERM stops it like Ctrl-C. The
    study's max_seeds is set (`seed_plan.with_planned_max_seeds`); `seed_plan` is recorded."""
    try:
        with sigterm_as_interrupt():
            return _run_adaptive(study, args, console, seed_plan)
    except StudyBusy as err:
        console.print(f"error: {err}", highlight=False)
        return EXIT_CONFIG


def _run_adaptive(study: Study, args: Namespace, console: Console, seed_plan: Optional[SeedPlan]) -> int:
    from experiments.report import write_report

    cfg = study.adaptive_seeds
    assert cfg is not None and cfg.max_seeds is not None, "an adaptive study with its max_seeds planned"
    max_seeds = cfg.max_seeds
    seeds = extra_seeds(study.seeds, max_seeds)
    confidence = cfg.confidence(study.alpha, len(study.variants))
    specs_by_key: Dict[str, RunSpec] = {}
    failed = {}

    def measure(n: int, active: List[str]) -> Optional[Measured]:
        """One look: the baseline and the active variants planned at n seeds and launched (the runs
        already finished are skipped), then every run so far collected; None when interrupted."""
        look_study = dataclasses.replace(study, variants=tuple(v for v in study.variants if v.name in active),
                                         seeds=tuple(seeds[:n]))
        specs = expand(look_study, args.results)
        specs_by_key.update({s.key: s for s in specs})
        # plan.json records every run of every look so far: `report` re-reads them all.
        result = _launch(look_study, specs, args, seed_plan, recorded=list(specs_by_key.values()))
        failed.update(result.failed)
        if result.interrupted:
            return None
        results = collect(list(specs_by_key.values()), look_study)

        def values(variant: str) -> List[float]:
            return [r.value for r in results if r.variant == variant and r.status == RunStatus.COMPLETED
                    and r.value is not None]
        return {name: values(name) for name in active}, values(BASELINE)

    def said(look: int, n: int, decisions: Dict) -> None:
        console.print(f"look {look} at {n} seeds: "
                      + ", ".join(f"{k} {'decided' if d['decided'] else 'undecided'} "
                                  f"[{d['interval'][0]:+.4g}, {d['interval'][1]:+.4g}]" for k, d in decisions.items()),
                      highlight=False)

    ended = run_looks(cfg, [v.name for v in study.variants], confidence, measure, said)
    if ended is None:
        console.print(INTERRUPTED, highlight=False)
        return EXIT_INTERRUPTED
    decided = {name: AdaptiveVariant(n=d["n"], decided=d["decided"], interval=tuple(d["interval"]), look=look,
                                     stopped="decided" if d["decided"] else "max_seeds")
               for name, (d, look) in ended.stopped.items()}
    out = study_dir(study, args.results)
    all_specs = list(specs_by_key.values())
    report_pruned(prune_superseded(out, all_specs), console)
    full = dataclasses.replace(study, seeds=tuple(seeds[:max(d.n for d in decided.values())
                                                        if decided else ended.seeds]))
    used, fixed = len(all_specs), (1 + len(study.variants)) * max_seeds
    adaptive = AdaptiveRecord(max_seeds=max_seeds, min_seeds=cfg.min_seeds, step=cfg.step,
                              confidence=confidence, spend_alpha_over_looks=cfg.spend_alpha_over_looks,
                              variants=decided, looks=ended.looks, runs_used=used, runs_fixed=fixed)
    agg = write_report(full, out, all_specs, adaptive=adaptive, seed_plan=seed_plan)
    log_wandb_aggregate(study, all_specs, args, console)
    console.print(f"{study.name}: {used} runs instead of {fixed} at a fixed {max_seeds} seeds "
                  f"({1 - used / fixed:.0%} saved); {decision_line(agg)}", highlight=False)
    return EXIT_RUNS_FAILED if failed or agg.decision.chosen is None else EXIT_OK


def log_wandb_aggregate(study: Study, specs: List[RunSpec], args: Namespace, console: Console) -> None:
    """The study's W&B aggregate run, from the aggregate.json and plots just written (nothing new
    is logged when they are what was last sent); W&B's own failures are a warning."""
    from experiments.wandb_sink import log_aggregate_dir, project_for, wandb_mode
    if wandb_mode() == "disabled":
        return
    project = project_for(study)  # a bad WANDB_PROJECT is the user's error, said as one
    try:
        log_aggregate_dir(study_dir(study, args.results), project, [s.run_hash for s in specs])
    except Exception as err:  # noqa: BLE001 - W&B must never fail a study
        console.print(f"warning: W&B aggregate: {err}", highlight=False)


def report_pruned(removed, console: Console) -> None:
    """One line for `launch.prune_superseded`'s outcome (nothing when there was nothing to remove)."""
    if removed is None:
        console.print("notice: another manager holds the study's lock: superseded runs were not removed",
                      highlight=False)
    elif removed:
        console.print(f"removed {removed} superseded run{'s' if removed != 1 else ''} (not in the current plan)",
                      highlight=False)


def decision_line(agg) -> str:
    """'decision: X (why)', or the reason there is none (no run completed, the metric never logged)."""
    d = agg.decision
    return f"decision: {d.chosen} ({d.reason})" if d.chosen else d.reason

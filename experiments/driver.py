"""Running a planned study: what `python -m experiments run` does once the plan is made.

A fixed design is one launch of the whole plan. A study with `study.sequential` is one launch per
wave: each look plans the baseline and the variants still running at the wave's seeds and launches
that plan; runs already finished (same hash) are skipped, so a look costs only its new seeds, and
an interrupted study resumes like any other (its looks are replayed from the runs on disk:
`aggregate.replay_waves`, the same function the report decides with). Either way the runs the plan
no longer has are then removed and the report written, with the waves' record (boundaries, the
look each variant stopped at, runs used against the fixed design). SIGTERM stops a study like
Ctrl-C: runs are stopped in order and recorded as interrupted.
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

from experiments.collect import collect
from experiments.errors import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNS_FAILED, INTERRUPTED
from experiments.launch import LaunchResult, StudyBusy, launch, prune_superseded
from experiments.plan import RunSpec, expand, study_dir
from experiments.results import BASELINE, SeedPlan
from experiments.sequential import extra_seeds
from experiments.study import Study


def run_study(study: Study, specs: List[RunSpec], args: Namespace, console: Console,
              seed_plan: Optional[SeedPlan] = None) -> int:
    """Runs the plan `specs` of `study` (seed waves: one launch per wave) on Ray with the command
    line's settings (`args`), then writes the report; returns the command's exit code. `seed_plan`,
    the seeds planned for study.target_effect, is recorded."""
    if study.sequential is not None:
        return run_waves(study, args, console, seed_plan)
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


def run_waves(study: Study, args: Namespace, console: Console, seed_plan: Optional[SeedPlan] = None) -> int:
    """Runs wave after wave until every variant has stopped; SIGTERM stops it like Ctrl-C."""
    try:
        with sigterm_as_interrupt():
            return _run_waves(study, args, console, seed_plan)
    except StudyBusy as err:
        console.print(f"error: {err}", highlight=False)
        return EXIT_CONFIG


def _run_waves(study: Study, args: Namespace, console: Console, seed_plan: Optional[SeedPlan]) -> int:
    from experiments.aggregate import replay_waves
    from experiments.report import write_report
    from experiments.seed_plan import find_pilot, pilot_correlation, study_design
    from experiments.study import resolve_analysis

    design = study_design(study, seed_plan)
    assert design is not None, "a study with seed waves"
    seeds = extra_seeds(study.seeds, design.waves[-1])
    full = dataclasses.replace(study, seeds=tuple(seeds))
    analysis = resolve_analysis(study.analysis, {v.name: seeds for v in study.all_variants},
                                pilot_correlation(find_pilot(study, args.results)), study.alpha)
    specs_by_key: Dict[str, RunSpec] = {}
    active = [v.name for v in study.variants]
    failed: Dict[str, str] = {}
    for k, n in enumerate(design.waves):
        look_study = dataclasses.replace(study, variants=tuple(v for v in study.variants if v.name in active),
                                         seeds=tuple(seeds[:n]))
        specs = expand(look_study, args.results)
        specs_by_key.update({s.key: s for s in specs})
        # plan.json records every run of every wave so far: `report` re-reads them all.
        result = _launch(look_study, specs, args, seed_plan, recorded=list(specs_by_key.values()))
        failed.update(result.failed)
        if result.interrupted:
            console.print(INTERRUPTED, highlight=False)
            return EXIT_INTERRUPTED
        all_specs = list(specs_by_key.values())
        waves = replay_waves(full, design, collect(all_specs, full), analysis,
                             {s.seed: s.init_from for s in all_specs if s.variant == BASELINE and s.init_from})
        judged = waves.looks[k]["judged"] if k < len(waves.looks) else {}
        last = k == len(design.waves) - 1
        console.print(f"look {k + 1}/{len(design.waves)} at {n} seeds: " + ", ".join(
            f"{name} {'not crossed' if last and j['decision'] == 'futile' else j['decision']} (z = {j['z']:+.3g})"
            if j["z"] is not None else f"{name} undefined" for name, j in judged.items()), highlight=False)
        active = [name for name in active if waves.stopped.get(name, {}).get("decision") == "continue"]
        if not active:
            break
    all_specs = list(specs_by_key.values())
    out = study_dir(study, args.results)
    report_pruned(prune_superseded(out, all_specs), console)
    agg = write_report(full, out, all_specs, seed_plan=seed_plan)
    log_wandb_aggregate(study, all_specs, args, console)
    record = agg.sequential
    assert record is not None
    fixed = f" ({record.runs_fixed} for the fixed design)" if record.runs_fixed else ""
    console.print(f"{study.name}: {record.runs_used} runs of at most {record.runs_max}{fixed}; {decision_line(agg)}",
                  highlight=False)
    return EXIT_RUNS_FAILED if failed or agg.decision.chosen is None else EXIT_OK


def log_wandb_aggregate(study: Study, specs: List[RunSpec], args: Namespace, console: Console) -> None:
    """The study's W&B aggregate run, from the aggregate.json and plots just written (nothing new
    is logged when they are what was last sent); W&B's own failures are a warning."""
    from experiments.report import REPORT
    from experiments.wandb_sink import log_aggregate_dir, project_for, wandb_mode
    if wandb_mode() == "disabled":
        return
    project = project_for(study)  # a bad WANDB_PROJECT is the user's error, said as one
    try:
        out = study_dir(study, args.results)
        log_aggregate_dir(out, project, [s.run_hash for s in specs], files=[out / REPORT])
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

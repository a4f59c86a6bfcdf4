"""`python -m experiments run` for a study with `study.adaptive_seeds`: one launch per look.

Each look plans the baseline and the still-undecided variants at the current seed count and
launches that plan; runs already finished (same hash) are skipped, so a look costs only its new
seeds, and an interrupted adaptive study resumes like any other. After the last look the report
covers every run of every look, with an `adaptive` section (seeds per variant, the look that
decided it, runs used against the fixed design) built into the aggregate before it is written.
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from pathlib import Path
from typing import Dict, Optional

from rich.console import Console

from experiments.adaptive import decide_look, extra_seeds
from experiments.collect import collect
from experiments.commands import (EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNS_FAILED, decision_line,
                                  report_pruned, sigterm_as_interrupt)
from experiments.launch import StudyBusy, launch, prune_superseded
from experiments.plan import expand, study_dir
from experiments.results import AdaptiveRecord, AdaptiveVariant, SeedPlan
from experiments.rundir import COMPLETED
from experiments.study import Study


def run_adaptive(study: Study, args: Namespace, console: Console, seed_plan: Optional[SeedPlan] = None) -> int:
    """Looks until every variant is decided or at max_seeds; SIGTERM stops it like Ctrl-C. The
    study's max_seeds is set (`seed_plan.with_planned_max_seeds`); `seed_plan` is recorded."""
    try:
        with sigterm_as_interrupt():
            return _run(study, args, console, seed_plan)
    except StudyBusy as err:
        console.print(f"error: {err}", highlight=False)
        return EXIT_CONFIG


def _run(study: Study, args: Namespace, console: Console, seed_plan: Optional[SeedPlan]) -> int:
    from experiments.report import write_report

    cfg = study.adaptive_seeds
    seeds = extra_seeds(study.seeds, cfg.max_seeds)
    confidence = cfg.confidence(study.alpha, len(study.variants))
    n, active, decided, looks = cfg.min_seeds, list(study.variants), {}, []
    specs_by_key: Dict[str, object] = {}
    failed = {}
    while True:
        look_study = dataclasses.replace(study, variants=tuple(active), seeds=tuple(seeds[:n]))
        specs = expand(look_study, args.results)
        specs_by_key.update({s.key: s for s in specs})
        # plan.json records every run of every look so far: `report` re-reads them all.
        result = launch(look_study, specs, Path(args.results), ray_address=args.ray_address, num_cpus=args.num_cpus,
                        num_gpus=args.num_gpus, cache_dir=args.cache_dir, rerun_failed=args.rerun_failed,
                        argv=args.argv, recorded=list(specs_by_key.values()), seed_plan=seed_plan)
        failed.update(result.failed)
        if result.interrupted:
            console.print("interrupted: run the same command again to resume", highlight=False)
            return EXIT_INTERRUPTED
        results = collect(list(specs_by_key.values()), look_study)
        values = {v.name: [r.value for r in results if r.variant == v.name and r.status == COMPLETED
                           and r.value is not None] for v in active}
        base = [r.value for r in results if r.variant == "baseline" and r.status == COMPLETED and r.value is not None]
        look = decide_look(values, base, confidence)
        looks.append({"seeds": n, "active": [v.name for v in active], "intervals": look})
        for v in active:
            if look[v.name]["decided"] or n >= cfg.max_seeds:
                decided[v.name] = AdaptiveVariant(n=look[v.name]["n"], decided=look[v.name]["decided"],
                                                  interval=tuple(look[v.name]["interval"]), look=len(looks),
                                                  stopped="decided" if look[v.name]["decided"] else "max_seeds")
        active = [v for v in active if v.name not in decided]
        console.print(f"look {len(looks)} at {n} seeds: "
                      + ", ".join(f"{k} {'decided' if d['decided'] else 'undecided'} "
                                  f"[{d['interval'][0]:+.4g}, {d['interval'][1]:+.4g}]" for k, d in look.items()),
                      highlight=False)
        if not active:
            break
        n = min(n + cfg.step, cfg.max_seeds)
    out = study_dir(study, args.results)
    all_specs = list(specs_by_key.values())
    report_pruned(prune_superseded(out, all_specs), console)
    full = dataclasses.replace(study, seeds=tuple(seeds[:max(d.n for d in decided.values())
                                                        if decided else n]))
    used, fixed = len(all_specs), (1 + len(study.variants)) * cfg.max_seeds
    adaptive = AdaptiveRecord(max_seeds=cfg.max_seeds, min_seeds=cfg.min_seeds, step=cfg.step,
                              confidence=confidence, spend_alpha_over_looks=cfg.spend_alpha_over_looks,
                              variants=decided, looks=tuple(looks), runs_used=used, runs_fixed=fixed)
    agg = write_report(full, out, all_specs, adaptive=adaptive, seed_plan=seed_plan)
    console.print(f"{study.name}: {used} runs instead of {fixed} at a fixed {cfg.max_seeds} seeds "
                  f"({1 - used / fixed:.0%} saved); {decision_line(agg)}", highlight=False)
    return EXIT_RUNS_FAILED if failed or agg.decision.chosen is None else EXIT_OK

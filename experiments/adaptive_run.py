"""`python -m experiments run` for a study with `study.adaptive_seeds`: one launch per look.

Each look plans the baseline and the still-undecided variants at the current seed count and
launches that plan; runs already finished (same hash) are skipped, so a look costs only its new
seeds, and an interrupted adaptive study resumes like any other. After the last look the report
covers every run of every look, and aggregate.json and report.md gain an `adaptive` section:
seeds per variant, the look that decided it, and runs used against the fixed design.
"""

from __future__ import annotations

import dataclasses
import signal
from argparse import Namespace
from pathlib import Path
from typing import Dict

from rich.console import Console

from experiments.adaptive import decide_look, extra_seeds
from experiments.collect import collect
from experiments.launch import StudyBusy, launch
from experiments.plan import expand, study_dir
from experiments.rundir import COMPLETED, write_json
from experiments.study import Study

EXIT_OK, EXIT_RUNS_FAILED, EXIT_INTERRUPTED = 0, 1, 130


def run_adaptive(study: Study, args: Namespace, console: Console) -> int:
    """Looks until every variant is decided or at max_seeds; SIGTERM stops it like Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _run(study, args, console)
    except StudyBusy as err:
        console.print(f"error: {err}", highlight=False)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _run(study: Study, args: Namespace, console: Console) -> int:
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
        result = launch(look_study, specs, Path(args.results), ray_address=args.ray_address, num_cpus=args.num_cpus,
                        num_gpus=args.num_gpus, cache_dir=args.cache_dir, rerun_failed=args.rerun_failed,
                        argv=args.argv)
        specs_by_key.update({s.key: s for s in specs})
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
                decided[v.name] = {**look[v.name], "look": len(looks), "stopped": "decided" if look[v.name]["decided"]
                                   else "max_seeds"}
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
    write_json(out / "plan.json", {"study": study.name, "study_file": study.path,
                                   "runs": [s.to_json() for s in all_specs]})
    full = dataclasses.replace(study, seeds=tuple(seeds[:max(d["n"] for d in decided.values())
                                                        if decided else n]))
    agg = write_report(full, out, all_specs)
    used, fixed = len(all_specs), (1 + len(study.variants)) * cfg.max_seeds
    agg["adaptive"] = {"max_seeds": cfg.max_seeds, "min_seeds": cfg.min_seeds, "step": cfg.step,
                       "confidence": confidence, "spend_alpha_over_looks": cfg.spend_alpha_over_looks,
                       "variants": decided, "looks": looks, "runs_used": used, "runs_fixed": fixed}
    write_json(out / "aggregate.json", agg)
    with open(out / "report.md", "a") as f:
        f.write(render_adaptive(agg["adaptive"]))
    console.print(f"{study.name}: {used} runs instead of {fixed} at a fixed {cfg.max_seeds} seeds "
                  f"({1 - used / fixed:.0%} saved); decision: {agg['decision']['chosen']}", highlight=False)
    return EXIT_RUNS_FAILED if failed else EXIT_OK


def render_adaptive(adaptive: dict) -> str:
    """The report section: seeds used per variant and why it stopped, runs saved."""
    lines = ["", "## Adaptive seeds", "",
             f"Seeds were added to undecided variants from {adaptive['min_seeds']} up to {adaptive['max_seeds']} "
             f"(Welch interval of the difference at {adaptive['confidence']:.4g} confidence).", "",
             "| variant | seeds | stopped | interval of the difference |", "|---|---|---|---|"]
    for name, d in adaptive["variants"].items():
        lines.append(f"| {name} | {d['n']} | {d['stopped']} at look {d['look']} | "
                     f"[{d['interval'][0]:.4g}, {d['interval'][1]:.4g}] |")
    used, fixed = adaptive["runs_used"], adaptive["runs_fixed"]
    lines += ["", f"Runs used: {used} of {fixed} for a fixed design ({1 - used / fixed:.0%} saved).", ""]
    return "\n".join(lines)

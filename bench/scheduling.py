"""Scheduling benchmark: N short runs on K slots through the manager, against the ideal.

    python bench/scheduling.py [--runs 8] [--slots 2] [--steps 4]

Measures, on the tiny default:
- `run_alone_s`: one run of the engine in a plain subprocess (no Ray, no manager);
- `makespan_s`: `launch()` of a study of N runs with K one-CPU slots, Ray start included;
- `ideal_s`: ceil(N / K) x run_alone_s, what a perfect scheduler with no contention would take;
- `manager_overhead_per_run_s`: slot-seconds not spent inside an engine process, per run:
  (makespan x K - sum of engine wall times) / N. It includes Ray's start, task dispatch,
  the per-run bookkeeping and the idle tail when N is not a multiple of K.
Prints the figures and writes them to bench/results/scheduling.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from experiments.display import StudyDisplay  # noqa: E402
from experiments.launch import launch  # noqa: E402
from experiments.plan import expand  # noqa: E402
from experiments.run_records import read_record  # noqa: E402
from experiments.study import load_study  # noqa: E402

STUDY = """
study.name = 'bench'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = {steps}', 'ppo.eval_every = {steps}', 'ppo.save_every = {steps}',
                           'ppo.final_window = 1']
study.variants = {{'kl_coef_x2': 'ppo.kl_coef = 0.1'}}
study.seeds = {seeds}
study.cpus_per_run = 1
study.retries = 0
"""


def run_alone(study, work: Path) -> float:
    """Wall time of one engine run in a plain subprocess (also warms the SFT cache)."""
    spec = expand(study, work / "alone")[0]
    argv = [sys.executable, "-m", "rlhf.train", spec.recipe]
    for b in spec.bindings:
        argv += ["-b", b]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(argv + ["--out", str(work / "warmup")], env=env, check=True, capture_output=True, cwd=REPO)
    t0 = time.monotonic()
    subprocess.run(argv + ["--out", str(work / "alone_run")], env=env, check=True, capture_output=True, cwd=REPO)
    return time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=8, help="N runs (rounded up to an even number: 2 variants)")
    p.add_argument("--slots", type=int, default=2, help="K parallel slots (one CPU each)")
    p.add_argument("--steps", type=int, default=4, help="PPO steps per run")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "scheduling.json"))
    args = p.parse_args()
    seeds = math.ceil(args.runs / 2)
    with tempfile.TemporaryDirectory(prefix="bench-scheduling-") as tmp:
        work = Path(tmp)
        study_file = work / "bench.gin"
        study_file.write_text(STUDY.format(steps=args.steps, seeds=seeds))
        study = load_study(study_file)
        alone = run_alone(study, work)
        specs = expand(study, work / "results")
        n = len(specs)
        t0 = time.monotonic()
        result = launch(study, specs, work / "results", num_cpus=args.slots, num_gpus=0,
                        display=StudyDisplay(study.name, specs))
        makespan = time.monotonic() - t0
        engine = [sum(a.get("seconds", 0) for a in read_record(s.run_dir)["attempts"]) for s in specs]
    ideal = math.ceil(n / args.slots) * alone
    figures = {
        "runs": n, "slots": args.slots, "steps_per_run": args.steps,
        "completed": len(result.completed), "failed": len(result.failed),
        "run_alone_s": round(alone, 2),
        "engine_mean_s_in_study": round(sum(engine) / n, 2),
        "makespan_s": round(makespan, 2),
        "ideal_s": round(ideal, 2),
        "makespan_over_ideal": round(makespan / ideal, 3),
        "ideal_with_observed_run_time_s": round(math.ceil(n / args.slots) * sum(engine) / n, 2),
        "manager_overhead_per_run_s": round((makespan * args.slots - sum(engine)) / n, 2),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
    }
    print(json.dumps(figures, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()

"""Benchmark: the garbage collector's pauses in a run, with the run's heap frozen after its first
iteration (rlhf/heap.py, what the trainer does) and without (not a test).

    python bench/gc_pauses.py [--recipe recipes/tiny.gin] [-b BINDING]... [--steps 8] [--json PATH]

Each mode runs `PPOTrainer.run` of the recipe in its own process, `gc.callbacks` timing every
collection by generation (how many, their total and longest pause), over the whole run and inside
the iterations' phases alone (the freeze's own collection is outside them), and after each iteration
the objects a full pass walks (`len(gc.get_objects())`: frozen objects are not among them). The
'unfrozen' mode replaces the freeze with nothing. Figures go to stdout and to the JSON file.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def child(recipe: str, bindings: list, frozen: bool) -> dict:
    from host_probe import GCTimer

    from rlhf import configurable, heap
    from rlhf.metrics import MetricLogger
    from rlhf.trainer import PPOTrainer

    if not frozen:
        heap.FrozenAfterFirst.settle = lambda self: None  # the loop as it was without the freeze
    walked: list = []
    cfg, _ = configurable.resolve(recipe, bindings)
    timer = GCTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = PPOTrainer(cfg, Path(out) / "run", log=lambda m: None)
        t = time.perf_counter()
        original = trainer.train_step

        def step():
            timer.tag = "step"  # the passes inside an iteration's phases (not the freeze's own)
            try:
                record = original()
            finally:
                timer.tag = None
            walked.append(len(gc.get_objects()))  # what a full pass would walk now (frozen objects are not)
            return record

        trainer.train_step = step
        with timer:
            trainer.run(MetricLogger([]))
        wall = time.perf_counter() - t

    return {"frozen": frozen, "run_s": wall, "tracked_objects_by_step": walked,
            "collections": GCTimer.table(timer.pauses),
            "collections_in_iterations": GCTimer.table([p for p in timer.pauses if p[2] == "step"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.gin"))
    p.add_argument("-b", "--binding", action="append", default=[])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", default="")
    p.add_argument("--child", choices=("frozen", "unfrozen"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bindings = [f"ppo.total_steps = {args.steps}", "ppo.eval_every = 100000", "ppo.save_every = 100000",
                *args.binding]
    if args.child:
        print(json.dumps(child(args.recipe, bindings, args.child == "frozen")))
        return 0
    results = {}
    for mode in ("unfrozen", "frozen"):
        done = subprocess.run([sys.executable, __file__, "--recipe", args.recipe, "--steps", str(args.steps),
                               "--child", mode, *[a for b in args.binding for a in ("-b", b)]],
                              capture_output=True, text=True, check=True)
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        c = results[mode]["collections_in_iterations"]
        print(f"{mode:9s} run {results[mode]['run_s']:.1f} s; tracked at the end "
              f"{results[mode]['tracked_objects_by_step'][-1]:,}; in the iterations "
              + "; ".join(f"{g}: {v['count']} passes, {v['total_ms']:.1f} ms, longest {v['longest_ms']:.1f} ms"
                          for g, v in c.items()))
    result = {"command": "python bench/gc_pauses.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "python": sys.version.split()[0], "recipe": args.recipe, "steps": args.steps,
              "bindings": args.binding, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: runs saved by adaptive seeds against a fixed design, and what it costs (not a test).

    python bench/adaptive_seeds.py [--studies 200] [--max-seeds 8] [--json PATH]

Simulates tuning rounds whose per-seed scores are drawn from known distributions (deterministic
numpy generator, no engine): a baseline at 0.40 +- 0.02 accuracy across seeds (what the tiny
demo's round 1 shows) and four variants: clearly better (+0.06), clearly worse (-0.06), a small
gain (+0.02) and a null one. For each design it reports runs used, the share of studies where a
variant was declared better/worse, and the false verdict rate on the null variant, so the saving
is read next to its price in error control.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from experiments.adaptive import AdaptiveSeeds, decide_look, simulate  # noqa: E402

EFFECTS = {"better": 0.06, "worse": -0.06, "small_gain": 0.02, "null": 0.0}
BASE, SD = 0.40, 0.02


def run(studies: int, max_seeds: int, min_seeds: int, spend: bool, alpha: float = 0.05) -> dict:
    cfg = AdaptiveSeeds(max_seeds=max_seeds, min_seeds=min_seeds, spend_alpha_over_looks=spend)
    used, verdicts, fixed_verdicts = [], {k: 0 for k in EFFECTS}, {k: 0 for k in EFFECTS}
    seeds_per_variant = {k: [] for k in EFFECTS}
    for i in range(studies):
        rng = np.random.default_rng(i)
        table = {name: BASE + EFFECTS.get(name, 0.0) + SD * rng.standard_normal(max_seeds)
                 for name in ["baseline", *EFFECTS]}
        out = simulate(lambda name, seed: float(table[name][seed]), list(EFFECTS), cfg, alpha)
        used.append(out["runs_used"])
        for name, d in out["variants"].items():
            verdicts[name] += d["decided"]
            seeds_per_variant[name].append(d["n"])
        fixed = decide_look({n: table[n] for n in EFFECTS}, table["baseline"],
                            1 - alpha / len(EFFECTS))
        for name, d in fixed.items():
            fixed_verdicts[name] += d["decided"]
    fixed_runs = (1 + len(EFFECTS)) * max_seeds
    return {"max_seeds": max_seeds, "min_seeds": min_seeds, "spend_alpha_over_looks": spend,
            "runs_fixed": fixed_runs, "runs_used_mean": float(np.mean(used)),
            "saving": 1 - float(np.mean(used)) / fixed_runs,
            "seeds_mean": {k: float(np.mean(v)) for k, v in seeds_per_variant.items()},
            "decided_rate": {k: v / studies for k, v in verdicts.items()},
            "decided_rate_fixed": {k: v / studies for k, v in fixed_verdicts.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--studies", type=int, default=200)
    p.add_argument("--max-seeds", type=int, default=8)
    p.add_argument("--min-seeds", type=int, default=3)
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "adaptive_seeds.json"))
    args = p.parse_args(argv)
    rows = [run(args.studies, args.max_seeds, args.min_seeds, spend) for spend in (False, True)]
    for r in rows:
        print(f"spend_alpha_over_looks={r['spend_alpha_over_looks']}: {r['runs_used_mean']:.1f} runs of "
              f"{r['runs_fixed']} fixed ({r['saving']:.0%} saved)")
        for name in EFFECTS:
            print(f"  {name:>10}: seeds {r['seeds_mean'][name]:.2f}, declared different in "
                  f"{r['decided_rate'][name]:.1%} of studies (fixed {args.max_seeds} seeds: "
                  f"{r['decided_rate_fixed'][name]:.1%})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"studies": args.studies, "designs": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

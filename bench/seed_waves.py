"""Benchmark: seed waves' promises on simulated studies whose truth is known (Monte Carlo; not a test).

    python bench/seed_waves.py [--studies 20000] [--effect 1.0] [--json PATH]

For 1, 3 and 5 variants; a variant's spread 1 and 2 times the baseline's; Welch's analysis and
the paired one at a correlation of 0 and 0.6 between paired seeds: the planner
(`sequential.plan_waves`, the product's own, default waves) sizes the waves for a target effect
of `--effect` baseline sds at 80% power and alpha 0.05, then `--studies` studies (random numbers
independent of the planner's) are run through the design under three truths: every variant null,
one variant at the target with the rest null, every variant at the target. Per condition:

- the family-wise false-positive rate (any null variant called better or worse), with two Monte
  Carlo standard errors above alpha as its bound;
- power at the target (the target variants' rate of 'better'), against the plan's power - 0.02;
- runs per decision (the variants' seeds and the baseline's) against the fixed design with the
  same alpha and power from the same planner (`stats.seeds_needed`), averaged over the truths
  (with one variant, 'one' and 'all at the target' are one truth, counted once);
- the coverage of the interval the report prints for every variant (the stagewise-ordering 95%
  interval at the look it stopped), against 0.94-0.96.

Beside them, the seed rule seed waves replaced (a look at every seed from 3 to 8, a variant
decided when Welch's 95% interval excludes zero) on the same null studies. Writes
bench/results/stats/seed_waves.json. A few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments import sequential  # noqa: E402

ALPHA, POWER = 0.05, 0.8
ANALYSES = {"welch": (False, 0.0), "paired rho 0": (True, 0.0), "paired rho 0.6": (True, 0.6)}
TRUTHS = ("null", "one at target", "all at target")


def old_rule_false_positives(studies: int, rng: np.random.Generator) -> float:
    """One null variant, a Welch 95% interval at every seed count 3..8, stop when it excludes zero."""
    v, b = rng.standard_normal((2, studies, 8))
    rejected = np.zeros(studies, bool)
    for n in range(3, 9):
        rejected |= sps.ttest_ind(v[:, :n], b[:, :n], axis=1, equal_var=False).pvalue < ALPHA
    return float(rejected.mean())


def condition(m: int, ratio: float, paired: bool, rho: float, effect: float, studies: int, seed: int) -> dict:
    plan = sequential.plan_waves(effect, sd_baseline=1.0, sd_variant=ratio, correlation=rho, paired=paired,
                                 alpha=ALPHA, variants=m, power=POWER)
    assert plan is not None and plan.runs_fixed is not None
    d = plan.design
    table = sequential.interval_table(d)
    rows, runs = {}, []
    for i, truth in enumerate(TRUTHS):
        effects = [0.0] * m if truth == "null" else [effect] + [0.0] * (m - 1) if truth == "one at target" \
            else [effect] * m
        out = sequential.simulate(d, effects, sd_variant=ratio, correlation=rho, paired=paired, studies=studies,
                                  rng=np.random.default_rng(seed + i))
        null = np.asarray(effects) == 0
        called = np.isin(out.verdict, ["better", "worse"])
        fwer = float(called[:, null].any(1).mean()) if null.any() else None
        power = float((out.verdict[:, ~null] == "better").mean()) if (~null).any() else None
        lo, hi = table(out.z.ravel(), out.look.ravel())
        lo, hi = lo.reshape(out.z.shape), hi.reshape(out.z.shape)
        low = sequential.to_difference(out.z, lo, out.t, out.df, out.se)
        high = sequential.to_difference(out.z, hi, out.t, out.df, out.se)
        truth_d = np.broadcast_to(np.asarray(effects), out.z.shape)
        ok = np.isfinite(low) & np.isfinite(high)
        coverage = float(np.mean((low[ok] <= truth_d[ok]) & (truth_d[ok] <= high[ok])))
        if m > 1 or truth != "all at target":  # with one variant, 'one' and 'all' at the target are one truth
            runs.append(float(out.runs.mean()))
        rows[truth] = {"family_wise_error": fwer, "power": power, "runs_mean": float(out.runs.mean()),
                       "runs_vs_fixed": float(out.runs.mean()) / plan.runs_fixed, "interval_coverage": coverage,
                       "intervals_undefined": int((~ok).sum())}
    limit = ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / studies)
    return {"variants": m, "sd_ratio": ratio, "paired": paired, "correlation": rho, "waves": list(d.waves),
            "planned_power": plan.power, "fixed_seeds": plan.fixed_seeds, "runs_fixed": plan.runs_fixed,
            "runs_max": plan.runs_max, "truths": rows, "runs_vs_fixed_mean": float(np.mean(runs)) / plan.runs_fixed,
            "goals": {
                "fwer": all(r["family_wise_error"] is None or r["family_wise_error"] <= limit for r in rows.values()),
                "power": all(r["power"] is None or r["power"] >= plan.power - 0.02 for r in rows.values()),
                "runs": float(np.mean(runs)) / plan.runs_fixed <= 0.70,
                "coverage": all(0.94 <= r["interval_coverage"] <= 0.96 for r in rows.values())}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--studies", type=int, default=20_000)
    p.add_argument("--effect", type=float, default=1.0, help="target effect in baseline sds")
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "stats" / "seed_waves.json"))
    args = p.parse_args()
    t0 = time.time()
    out = {"studies": args.studies, "alpha": ALPHA, "power": POWER, "effect": args.effect,
           "old_rule_false_positives": old_rule_false_positives(args.studies, np.random.default_rng(99)),
           "conditions": []}
    print(f"replaced rule (Welch interval at every seed 3..8): false positives {out['old_rule_false_positives']:.3f}")
    print(f"{'m':>2} {'ratio':>5} {'analysis':>15} {'waves':>18} {'fwer':>6} {'power':>6} {'plan':>5} "
          f"{'runs/fixed':>10} {'coverage':>17} goals")
    for m in (1, 3, 5):
        for ratio in (1.0, 2.0):
            for name, (paired, rho) in ANALYSES.items():
                row = condition(m, ratio, paired, rho, args.effect, args.studies, seed=1000 * m + int(10 * ratio))
                row["analysis"] = name
                out["conditions"].append(row)
                truths = row["truths"]
                fwer = max(r["family_wise_error"] for r in truths.values() if r["family_wise_error"] is not None)
                power = min(r["power"] for r in truths.values() if r["power"] is not None)
                cov = [r["interval_coverage"] for r in truths.values()]
                print(f"{m:>2} {ratio:>5g} {name:>15} {'/'.join(map(str, row['waves'])):>18} {fwer:6.3f} {power:6.3f} "
                      f"{row['planned_power']:5.3f} {row['runs_vs_fixed_mean']:10.3f} "
                      f"{min(cov):.3f}-{max(cov):.3f} {''.join('+' if v else '-' for v in row['goals'].values())}",
                      flush=True)
    out["all_goals"] = {k: all(c["goals"][k] for c in out["conditions"]) for k in ("fwer", "power", "runs", "coverage")}
    out["seconds"] = round(time.time() - t0, 1)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"goals: {out['all_goals']}; {out['seconds']} s; wrote {args.json}")


if __name__ == "__main__":
    main()

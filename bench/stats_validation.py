"""Benchmark: the study's statistics on simulated studies whose truth is known (Monte Carlo; not a test).

    python bench/stats_validation.py [--demo-results results] [--studies 10000] [--json PATH]

Draws per-seed scores of whole studies from known distributions (numpy, fixed seed: the figures
reproduce) and runs them through the project's own functions: `stats.welch_p`, `stats.paired_p`
and `stats.tost_p` over a stack of studies at once, `stats.holm` per study, and, on a subset,
`aggregate.verdicts` itself, whose better/worse verdicts must agree with the stacked path. A
seed's luck is shared between the arms as the engine shares it (common random numbers): the
baseline's score on seed s is b_s, a variant's rho * b_s + sqrt(1 - rho^2) * e_s + effect.

(a) false positives at alpha = 0.05 with no true effect, rho 0 and 0.6, n = 3, 5, 10 seeds:
    one variant by Welch's and by the paired t-test, and the family-wise rate of Holm over three
    null variants (any of them called better or worse), each with its binomial 95% interval
    (Clopper-Pearson, scipy.stats.binomtest). Each must be <= alpha: its interval must reach down
    to alpha. The paired t-test is exact, so its rate sits at alpha and a 95% interval misses it
    in one cell of twenty by chance: the pass criterion widens the interval by Bonferroni over
    every rate checked against alpha in (a) and (b), and both intervals are recorded.
(b) TOST at the boundary: the true difference exactly at +margin, Welch's and paired TOST; the
    rate of declared equivalence is the type-I error and must be <= alpha (same criterion).
(c) power at the planned N: N = stats.seeds_needed(effect, sd, power 0.8) for Welch's design
    (rho = 0) and the paired one (rho = 0.6); the power achieved at N, beside stats.power at N
    (N is an integer, so both are >= 0.8), must be within 3 points of 0.8.
(d) the demo: the correlation of baseline and variant outcomes over shared seeds, measured on the
    committed demo's aggregates (results/round{1,2,3}/aggregate.json: each variant's pairs
    centred on their own means, then pooled), and the seeds each design needs at it for effects
    of the demo's size, with the power each achieves at its N, and the correlation from which
    pairing needs fewer seeds than Welch's. A finding about the demo, not a check of the code.

Writes bench/results/stats/stats_validation.json. About a minute on one core.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from experiments import stats  # noqa: E402
from experiments.aggregate import verdicts  # noqa: E402
from experiments.results import BASELINE, BETTER, PAIRED, WELCH, WORSE, StudyAggregate  # noqa: E402

ALPHA = 0.05
SEED_COUNTS = (3, 5, 10)
CORRELATIONS = (0.0, 0.6)
NULL_VARIANTS = 3
MARGIN = 0.5
"""TOST margin in units of the seed-to-seed std (sd = 1 in the simulations)."""
POWER_TARGETS = ((0.5, 1.0), (0.8, 1.0))
"""(effect, sd) pairs for (c): seeds needed of about 10 to 65, where one seed more or less moves
the power by a point or two."""
AGREEMENT_STUDIES = 60
"""Studies per analysis on which aggregate.verdicts is run beside the stacked p-values."""


def draw(rng: np.random.Generator, studies: int, n: int, rho: float, effects) -> tuple:
    """(baseline (studies, n), [variant (studies, n) per effect]): seed-shared luck of correlation rho."""
    base = rng.standard_normal((studies, n))
    variants = [rho * base + np.sqrt(1 - rho ** 2) * rng.standard_normal((studies, n)) + e for e in effects]
    return base, variants


RATES_AGAINST_ALPHA = len(CORRELATIONS) * len(SEED_COUNTS) * (2 * 2 + 2)
"""Rates checked against alpha: (a) 2 analyses x (one variant, Holm family), (b) 2 analyses."""
CHECK_CONFIDENCE = 1 - 0.05 / RATES_AGAINST_ALPHA
"""Bonferroni: all of those intervals hold together with 95% confidence."""


def rate(hits) -> dict:
    """The share of studies with a hit, with its Clopper-Pearson 95% interval and the wider one
    the checks use (CHECK_CONFIDENCE)."""
    hits = np.asarray(hits, bool)
    k, n = int(hits.sum()), int(hits.size)
    test = sps.binomtest(k, n)
    ci, wide = test.proportion_ci(0.95), test.proportion_ci(CHECK_CONFIDENCE)
    return {"rate": k / n, "ci95": [float(ci.low), float(ci.high)],
            "ci_check": [float(wide.low), float(wide.high)], "hits": k, "studies": n}


def at_most(r: dict, bound: float) -> bool:
    """The rate is consistent with being <= bound (its check interval reaches down to it)."""
    return r["ci_check"][0] <= bound


def p_values(analysis: str, variant, base):
    return stats.paired_p(variant, base) if analysis == PAIRED else stats.welch_p(variant, base)


def false_positives(rng, studies: int) -> list:
    rows = []
    for rho in CORRELATIONS:
        for n in SEED_COUNTS:
            base, variants = draw(rng, studies, n, rho, [0.0] * NULL_VARIANTS)
            row = {"rho": rho, "seeds": n}
            for analysis in (WELCH, PAIRED):
                ps = np.stack([p_values(analysis, v, base) for v in variants], axis=1)  # (studies, variants)
                holm = np.array([stats.holm(row_p) for row_p in ps])
                single = rate(ps[:, 0] < ALPHA)
                family = rate(np.any(holm < ALPHA, axis=1))
                row[analysis] = {"single": single, "holm_family_wise": family,
                                 "ok": at_most(single, ALPHA) and at_most(family, ALPHA)}
            rows.append(row)
    return rows


def verdict_agreement(rng) -> dict:
    """aggregate.verdicts on whole studies against the stacked p-values with Holm: the same calls."""
    out = {}
    base, variants = draw(rng, AGREEMENT_STUDIES, 5, 0.6, [0.0, 0.0, 1.5])  # two nulls and a real gain
    names = [f"v{i}" for i in range(len(variants))]
    for analysis in (WELCH, PAIRED):
        ps = np.stack([p_values(analysis, v, base) for v in variants], axis=1)
        agree = 0
        for i in range(AGREEMENT_STUDIES):
            values = {BASELINE: list(base[i]), **{name: list(v[i]) for name, v in zip(names, variants)}}
            judged = verdicts(values, higher=True, alpha=ALPHA, analysis=analysis)
            stacked = np.array(stats.holm(ps[i])) < ALPHA
            agree += all((judged[name][1] in (BETTER, WORSE)) == bool(s) for name, s in zip(names, stacked))
        out[analysis] = {"studies": AGREEMENT_STUDIES, "agree": agree, "ok": agree == AGREEMENT_STUDIES}
    return out


def tost_at_the_margin(rng, studies: int) -> list:
    rows = []
    for rho in CORRELATIONS:
        for n in SEED_COUNTS:
            base, (variant,) = draw(rng, studies, n, rho, [MARGIN])
            row = {"rho": rho, "seeds": n, "margin": MARGIN, "true_difference": MARGIN}
            for analysis in (WELCH, PAIRED):
                r = rate(stats.tost_p(variant, base, MARGIN, paired=analysis == PAIRED) < ALPHA)
                row[analysis] = {**r, "ok": at_most(r, ALPHA)}
            rows.append(row)
    return rows


def achieved_power(rng, studies: int, n: int, effect: float, sd: float, rho: float, analysis: str) -> dict:
    base, (variant,) = draw(rng, studies, n, rho, [effect / sd])
    return rate(p_values(analysis, variant, base) < ALPHA)


def power_at_planned_n(rng, studies: int) -> list:
    rows = []
    for effect, sd in POWER_TARGETS:
        for analysis, rho in ((WELCH, 0.0), (PAIRED, 0.6)):
            paired = analysis == PAIRED
            n = stats.seeds_needed(effect, sd, ALPHA, stats.POWER, paired=paired, correlation=rho)
            planned = stats.power(effect, sd, n, n, ALPHA, paired=paired, correlation=rho)
            achieved = achieved_power(rng, studies, n, effect, sd, rho, analysis)
            rows.append({"effect": effect, "sd": sd, "analysis": analysis, "rho": rho, "seeds_needed": n,
                         "power_at_n": planned,
                         "power_at_n_minus_1": stats.power(effect, sd, n - 1, n - 1, ALPHA, paired=paired,
                                                           correlation=rho),
                         "achieved": achieved, "ok": abs(achieved["rate"] - stats.POWER) <= 0.03})
    return rows


def demo_pairs(results_dir: Path) -> dict:
    """Pearson's correlation of baseline and variant values over shared seeds in the demo's rounds."""
    pooled_base, pooled_variant, per_variant, within, files = [], [], {}, [], {}
    for path in sorted(results_dir.glob("round*/aggregate.json")):
        agg = StudyAggregate.load(path)
        files[str(path.relative_to(results_dir))] = hashlib.sha256(path.read_bytes()).hexdigest()
        base = {r.seed: r.value for r in agg.variants[BASELINE].runs if r.value is not None}
        within.append(agg.variants[BASELINE].values)
        for name, v in agg.variants.items():
            if name == BASELINE:
                continue
            mine = {r.seed: r.value for r in v.runs if r.value is not None}
            within.append(list(mine.values()))
            seeds = sorted(set(base) & set(mine))
            b, x = np.array([base[s] for s in seeds]), np.array([mine[s] for s in seeds])
            per_variant[f"{agg.study}/{name}"] = {"seeds": seeds, "correlation": stats.pair_correlation(x, b)}
            pooled_base += list(b - b.mean())
            pooled_variant += list(x - x.mean())
    if len(pooled_base) < 3:
        raise SystemExit(f"{results_dir}: fewer than 3 baseline/variant pairs in round*/aggregate.json")
    fit = sps.pearsonr(pooled_variant, pooled_base)
    ci = fit.confidence_interval(0.95)
    # The seed-to-seed std: pooled over every variant's and baseline's seeds, each about its own mean.
    sd = float(np.sqrt(sum(np.var(v, ddof=1) * (len(v) - 1) for v in within if len(v) > 1)
                       / sum(len(v) - 1 for v in within if len(v) > 1)))
    return {"aggregates_sha256": files, "pairs": len(pooled_base), "correlation": float(fit.statistic),
            "correlation_ci95": [float(ci.low), float(ci.high)],
            "correlation_ci_note": "pearsonr's interval over the pooled centred pairs; centring costs each "
                                   "variant one degree of freedom, so the true interval is wider",
            "per_variant": per_variant, "sd": sd}


def demo_designs(rng, studies: int, demo: dict) -> dict:
    rho_measured = demo["correlation"]
    rho = stats.design_correlation(rho_measured)
    sd = demo["sd"]
    rows = []
    for effect in (0.01, 0.02, 0.03, 0.05):
        welch_n = stats.seeds_needed(effect, sd, ALPHA)
        paired_n = stats.seeds_needed(effect, sd, ALPHA, paired=True, correlation=rho)
        row = {"effect": effect, "welch_seeds": welch_n, "paired_seeds": paired_n,
               "paired_fewer": paired_n < welch_n}
        if max(welch_n, paired_n) <= 200:  # the simulated power at each design's own N
            row["welch_achieved"] = achieved_power(rng, studies, welch_n, effect, sd, rho, WELCH)["rate"]
            row["paired_achieved"] = achieved_power(rng, studies, paired_n, effect, sd, rho, PAIRED)["rate"]
        # The smallest correlation at which pairing needs fewer seeds than Welch's design.
        grid = np.round(np.arange(0.0, 0.96, 0.01), 2)
        row["break_even_correlation"] = next(
            (float(r) for r in grid if stats.seeds_needed(effect, sd, ALPHA, paired=True, correlation=r) < welch_n),
            None)
        rows.append(row)
    return {"correlation_used": rho, "sd": sd, "effects": rows,
            "mde_at_3_seeds": {WELCH: stats.min_detectable_effect(sd, 3, 3, ALPHA),
                               PAIRED: stats.min_detectable_effect(sd, 3, 3, ALPHA, paired=True, correlation=rho),
                               "paired_at_rho_0.6": stats.min_detectable_effect(sd, 3, 3, ALPHA, paired=True,
                                                                                correlation=0.6)}}


def _fmt_rate(r: dict) -> str:
    return f"{r['rate']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--studies", type=int, default=10_000, help="simulated studies per condition (>= 1000)")
    p.add_argument("--demo-results", default=str(REPO / "results"),
                   help="the demo's results dir, holding round*/aggregate.json")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "stats" / "stats_validation.json"))
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()

    fp = false_positives(rng, args.studies)
    print(f"(a) false positives at alpha {ALPHA} ({args.studies} null studies each; rate [binomial 95% CI]):")
    for row in fp:
        for analysis in (WELCH, PAIRED):
            r = row[analysis]
            print(f"  rho {row['rho']:.1f} n {row['seeds']:>2} {analysis:>6}: one variant {_fmt_rate(r['single'])}; "
                  f"Holm over {NULL_VARIANTS}, family-wise {_fmt_rate(r['holm_family_wise'])}"
                  f"{'' if r['ok'] else '  ABOVE ALPHA'}")
    agreement = verdict_agreement(rng)
    for analysis, a in agreement.items():
        print(f"  aggregate.verdicts agrees with the stacked {analysis} p-values + Holm on {a['agree']}/{a['studies']} "
              f"studies")

    tost = tost_at_the_margin(rng, args.studies)
    print(f"(b) TOST with the true difference at the margin (+{MARGIN} sd): declared equivalent")
    for row in tost:
        print(f"  rho {row['rho']:.1f} n {row['seeds']:>2}: " + "; ".join(
            f"{a} {_fmt_rate(row[a])}{'' if row[a]['ok'] else ' ABOVE ALPHA'}" for a in (WELCH, PAIRED)))

    power_rows = power_at_planned_n(rng, args.studies)
    print("(c) power at the planned N (target 0.8):")
    for row in power_rows:
        print(f"  effect {row['effect']} sd {row['sd']} {row['analysis']:>6} (rho {row['rho']}): N = "
              f"{row['seeds_needed']}, stats.power at N {row['power_at_n']:.4f} (at N-1 "
              f"{row['power_at_n_minus_1']:.4f}), achieved {_fmt_rate(row['achieved'])}"
              f"{'' if row['ok'] else '  OFF BY MORE THAN 3 POINTS'}")

    demo = demo_pairs(Path(args.demo_results))
    designs = demo_designs(rng, args.studies, demo)
    print(f"(d) the demo ({', '.join(demo['aggregates_sha256'])}): correlation of baseline and variant over shared seeds "
          f"{demo['correlation']:+.3f} (95% CI [{demo['correlation_ci95'][0]:+.2f}, {demo['correlation_ci95'][1]:+.2f}], "
          f"{demo['pairs']} pairs, each variant centred); per variant: "
          + ", ".join(f"{k} {v['correlation']:+.2f}" if v["correlation"] is not None else f"{k} –"
                      for k, v in demo["per_variant"].items()))
    print(f"  seed-to-seed sd {demo['sd']:.4f}; the paired design uses rho = {designs['correlation_used']:.3f}")
    for row in designs["effects"]:
        sim = (f"; achieved power: Welch {row['welch_achieved']:.3f}, paired {row['paired_achieved']:.3f}"
               if "welch_achieved" in row else "")
        print(f"  effect {row['effect']}: Welch needs {row['welch_seeds']} seeds, paired {row['paired_seeds']} "
              f"({'fewer' if row['paired_fewer'] else 'not fewer'}){sim}; pairing saves seeds from rho >= "
              f"{row['break_even_correlation']}")
    mde = designs["mde_at_3_seeds"]
    print(f"  MDE at 3 seeds: Welch {mde[WELCH]:.4f}, paired at the demo's rho {mde[PAIRED]:.4f}, paired at rho 0.6 "
          f"{mde['paired_at_rho_0.6']:.4f}")

    checks = {"false_positives": all(r[a]["ok"] for r in fp for a in (WELCH, PAIRED)),
              "verdicts_agree": all(a["ok"] for a in agreement.values()),
              "tost_type_one": all(r[a]["ok"] for r in tost for a in (WELCH, PAIRED)),
              "power_at_planned_n": all(r["ok"] for r in power_rows)}
    fewer = [r["effect"] for r in designs["effects"] if r["paired_fewer"]]
    print(f"  at the demo's correlation the paired design needs fewer seeds than Welch's for effects "
          f"{fewer or 'none'} of {[r['effect'] for r in designs['effects']]}")
    elapsed = time.perf_counter() - started
    summary = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items())
    print(f"checks: {summary} ({elapsed:.0f} s)")
    out = {"alpha": ALPHA, "studies": args.studies, "seed": args.seed, "check_confidence": CHECK_CONFIDENCE,
           "false_positives": fp,
           "verdict_agreement": agreement, "tost_at_margin": tost, "power_at_planned_n": power_rows,
           "demo": demo, "demo_designs": designs, "checks": checks, "seconds": round(elapsed, 1)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The confirmation run: the tuned recipe against the original baseline, before anyone deploys it.

    python -m experiments confirm ROUND.gin... --results results --test data/arithmetic_test \
        --out reports/confirmation.json [--max-seeds 6]

The rounds chose their changes one at a time, each from a handful of seeds, each read on the
evaluation split that the next decision read again; the deployed models never ran the recipe the
rounds recommend (they trained a round at each setting in turn). This stage runs that recipe: the
first round's baseline as its runs got it (overrides included) against every adopted change
together, the last round's baseline as its runs got it plus its chosen variant's change, each from
the warm start and for the steps the rounds took together. It is a study of its own
(RESULTS/confirmation, one fixed design, run like any other: reruns skip what is done):

- **Fresh seeds**: above every seed a round ran, so no decision read them.
- **Seeds from the seed plan**, at the effect the rounds observed for their adopted changes,
  shrunk for selection: a change adopted because it looked best among those tried overestimates
  (the winner's curse), so each adopted difference is shrunk toward zero by empirical Bayes over
  every difference the rounds measured (a normal prior centred on no effect whose variance is the
  differences' spread beyond their standard errors, method of moments). Their sum is the effect
  planned for; at most `--max-seeds`, and the record says the power the seeds run give.
- **One pre-declared test**, on the test split (prompts no run and no decision read): the per-prompt
  pass@1 of each seed's final tuned model minus its baseline's, paired by seed and prompt, with
  `stats.two_level_interval` (resampling seeds and prompts: the split is a sample of the task's
  prompts too); the verdict is that interval's, at alpha 0.05 two-sided. The evaluation split's
  paired t is recorded beside it, not decisive.

The record (`--out`, JSON) is what `python -m experiments summary --confirmation` reads first
(`summary.Confirmation`; when the rounds adopted no change nothing runs, and the record says
`nothing_to_confirm`): 'bindings' (the tuned recipe's changes over the baseline's, as the runs got
them), 'difference', 'ci', 'p', 'n_units', 'model' (the tuned seed to ship: its eval-split value is the
median of the tuned seeds', not the best, which would be optimistic), 'baseline_model',
'seeds_needed', 'guardrail_violations'; beside them 'verdict' ('better' / 'worse' / 'no
difference'), 'export' (the `python -m rlhf.export` command that writes the model as a checkpoint
`from_pretrained` loads), the recipe's full bindings, the steps, the seeds, the evaluation split's
paired t, and 'plan' (the effect the seeds were planned for and how).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from experiments import stats
from experiments.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNS_FAILED, StudyError
from experiments.paths import portable
from experiments.results import BASELINE, RunStatus, StudyAggregate
from experiments.study import PAIRED, Study, Variant, split_binding

NAME = "confirmation"
TUNED = "tuned"
SCHEDULE = ("ppo.total_steps", "ppo.eval_every", "ppo.save_every")
"""The bindings a round sets for its own length; the confirmation sets them for the rounds' total."""
ALPHA = 0.05
POWER = 0.8
MAX_SEEDS = 6


def _by_key(bindings: Sequence[str]) -> Dict[str, str]:
    return {split_binding(b, "provenance")[0]: b for b in bindings}


def _ran(agg: StudyAggregate, study: Study) -> List[str]:
    """The baseline's engine bindings as its runs got them (overrides included), from the aggregate's
    provenance; the study file's when an older aggregate does not record them."""
    recorded = (agg.provenance or {}).get("baseline_bindings")
    return list(recorded) if recorded is not None else list(study.baseline_bindings)


def _steps(study_dir: Path) -> int:
    from experiments.collect import load_plan
    specs = load_plan(study_dir)
    if not specs:
        raise StudyError(f"{study_dir}: no plan.json with runs; run the round first")
    return int(specs[0].total_steps)


def recipes(rounds: Sequence[Tuple[Study, Path, StudyAggregate]]) -> Tuple[List[str], List[str], int]:
    """(the original baseline's bindings, the tuned recipe's, the rounds' steps together): each as
    the runs got them, less the rounds' own schedule bindings, plus the total's."""
    first_study, first_dir, first = rounds[0]
    last_study, _, last = rounds[-1]
    chosen = last.decision.chosen
    if chosen is None:
        raise StudyError(f"{last_study.name} has no decision ({last.decision.reason}): there is no tuned recipe "
                         f"to confirm")
    steps = sum(_steps(d) for _, d, _ in rounds)
    base = {k: b for k, b in _by_key(_ran(first, first_study)).items() if k not in SCHEDULE}
    tuned = {k: b for k, b in _by_key(_ran(last, last_study)).items() if k not in SCHEDULE}
    if chosen != BASELINE:
        tuned.update(_by_key(last.variants[chosen].bindings))
    schedule = [f"ppo.total_steps = {steps}", f"ppo.eval_every = {steps}", f"ppo.save_every = {steps}"]
    return [*base.values(), *schedule], [*tuned.values(), *schedule], steps


def shrunk_effects(rounds: Sequence[Tuple[Study, Path, StudyAggregate]]) -> Tuple[float, List[Dict]]:
    """(the sum of the adopted changes' shrunk differences, one record per adopted change): every
    difference a round measured (d_i, with its deciding analysis's standard error s_i from the
    interval) estimates the prior's variance tau^2 = mean(d_i^2 - s_i^2), at least 0; an adopted
    difference d becomes d tau^2 / (tau^2 + s^2), its posterior mean under that prior."""
    measured, adopted = [], []
    for study, _, agg in rounds:
        for name, v in agg.variants.items():
            own = v.comparison.decisive if v.comparison is not None else None
            if own is None or own.difference is None:
                continue
            lo, hi = own.difference_ci95
            if lo is None or hi is None:
                continue
            se = (hi - lo) / (2 * 1.959964)  # the interval's half-width in standard errors (normal approx.)
            sign = 1.0 if agg.direction == "higher" else -1.0
            measured.append((sign * own.difference, se))
            if agg.decision.chosen == name:
                adopted.append({"study": study.name, "variant": name, "difference": sign * own.difference, "se": se})
    if not measured:
        return 0.0, []
    d, s = np.array(measured).T
    tau2 = max(float(np.mean(d ** 2 - s ** 2)), 0.0)
    for a in adopted:
        a["shrunk"] = a["difference"] * tau2 / (tau2 + a["se"] ** 2) if tau2 + a["se"] ** 2 > 0 else 0.0
    return float(sum(a["shrunk"] for a in adopted)), adopted


def seed_count(rounds, max_seeds: int) -> Dict:
    """The confirmation's seeds: `stats.seeds_needed` (paired, at the last round's chosen arm's spread
    and no assumed correlation) for the shrunk effect, or for the rounds' target effect when the
    shrinkage leaves none; at most `max_seeds`, with the power that gives."""
    effect, adopted = shrunk_effects(rounds)
    last = rounds[-1][2]
    chosen = last.chosen
    sd = float(np.std(chosen.values, ddof=1)) if chosen is not None and len(chosen.values) >= 2 else math.nan
    target = next((s.target_effect for s, _, _ in reversed(rounds) if s.target_effect), None)
    basis = "the adopted changes' shrunk differences" if effect > 0 else "the rounds' target effect"
    planned_for = effect if effect > 0 else target
    needed = (stats.seeds_needed(planned_for, sd, ALPHA, POWER, paired=True, correlation=0.0)
              if planned_for and math.isfinite(sd) and sd > 0 else None)
    seeds = min(needed or max_seeds, max_seeds)
    at = stats.power(planned_for, sd, seeds, seeds, ALPHA, paired=True) if needed and planned_for else math.nan
    return {"effect": planned_for, "basis": basis, "adopted": adopted, "sd": sd if math.isfinite(sd) else None,
            "needed": needed, "seeds": max(seeds, 2), "power": at if math.isfinite(at) else None}


def confirmation_study(rounds, seeds: Sequence[int], results: Path) -> Study:
    """The study that runs the tuned recipe (variant 'tuned', every adopted change coupled) against
    the original baseline (the first round's bindings as its runs got them), from the warm start."""
    first_study = rounds[0][0]
    base, tuned, _ = recipes(rounds)
    base_keys = _by_key(base)
    changes = tuple(b for k, b in _by_key(tuned).items() if base_keys.get(k) != b)
    variants = (Variant(TUNED, changes, coupled=True),) if changes else ()
    return dataclasses.replace(
        first_study, name=NAME, description="The tuned recipe against the original baseline, on fresh seeds.",
        baseline_bindings=tuple(base), variants=variants, seeds=tuple(seeds), resume_from="", resume_variant="",
        resume_setting=False, analysis=PAIRED, target_effect=None, sequential=None, equivalence_margin=0.0,
        guardrails=rounds[-1][0].guardrails, pilot="")


def fresh_seeds(rounds, count: int) -> List[int]:
    """`count` seeds above every seed a round ran."""
    top = max((r.seed for _, _, agg in rounds for v in agg.variants.values() for r in v.runs), default=-1)
    return list(range(top + 1, top + 1 + count))


def _score(study: Study, study_dir: Path, agg: StudyAggregate, examples, samples_per_prompt: int) -> Dict:
    """Each completed seed's final model of both arms on the test split, per prompt:
    {arm: {seed: (pass@1 per prompt, the run's dir, its checkpoint, its eval-split value)}}."""
    from experiments.heldout import Scorer, run_config
    from experiments.run_records import latest_checkpoint

    scorer = Scorer(examples, samples_per_prompt)
    out: Dict[str, Dict[int, Dict]] = {}
    for arm, v in agg.variants.items():
        for r in v.runs:
            if r.status != RunStatus.COMPLETED:
                continue
            ckpt = latest_checkpoint(study_dir / r.run_dir)
            if ckpt is None:
                continue
            scores = scorer.score(run_config(study_dir / r.run_dir), ckpt / "actor", r.seed, study.name)
            per = (scores.get("per_prompt") or {}).get("accuracy")
            if per is None:
                continue
            out.setdefault(arm, {})[r.seed] = {
                "per_prompt": [c / per["samples"] for c in per["correct"]], "checkpoint": portable(ckpt),
                "eval": r.value if r.value is not None and math.isfinite(r.value) else None}
    return {"arms": out, "missing": scorer.missing}


def _median_seed(arm: Dict[int, Dict], seeds: Sequence[int]) -> int:
    """The seed whose eval-split value is the median of the arm's (the lower middle; ties by seed)."""
    ranked = sorted((s for s in seeds if arm[s]["eval"] is not None), key=lambda s: (arm[s]["eval"], s))
    return ranked[(len(ranked) - 1) // 2] if ranked else seeds[0]


def record(rounds, study: Study, agg: StudyAggregate, scored: Dict, plan: Dict, test_file: Path) -> Dict:
    """The confirmation's record (the module docstring lists its fields)."""
    base, tuned = scored["arms"].get(BASELINE, {}), scored["arms"].get(TUNED, {})
    seeds = sorted(set(base) & set(tuned))
    sign = 1.0 if study.direction == "higher" else -1.0
    changes = list(study.variants[0].bindings) if study.variants else []
    rails = [f"{name}: {', '.join(g.bound for g in v.guardrails.values() if not g.ok)} broken"
             for name, v in agg.variants.items() if name == TUNED and not v.guardrails_ok]
    out: Dict = {"study": NAME, "metric": "test-split pass@1", "test": portable(test_file), "seeds": seeds,
                 "n_seeds": len(seeds), "n_units": len(seeds), "plan": plan, "seeds_needed": plan.get("needed"),
                 "recipe": portable(study.baseline_recipe), "baseline_bindings": list(study.baseline_bindings),
                 "bindings": changes, "steps": recipes(rounds)[2], "alpha": ALPHA, "guardrail_violations": rails,
                 "missing": scored["missing"],
                 "declared_test": "per-prompt test-split pass@1, tuned minus baseline, paired by seed and prompt; "
                                  "two-level bootstrap over seeds and prompts (stats.two_level_interval); alpha 0.05 "
                                  "two-sided"}
    if len(seeds) < 2:
        return {**out, "verdict": "insufficient data", "difference": None, "ci": [None, None], "p": None,
                "model": "", "why": f"{len(seeds)} seed(s) completed on both arms; at least 2 are needed"}
    table = np.array([np.subtract(tuned[s]["per_prompt"], base[s]["per_prompt"]) for s in seeds])
    test = stats.two_level_interval(table, null=0.0)
    lo, hi = (float(x) for x in test["ci95"])
    diff, p = float(test["mean"]), float(test["p_value"])
    verdict = ("better" if (sign > 0 and lo > 0) or (sign < 0 and hi < 0) else
               "worse" if (sign > 0 and hi < 0) or (sign < 0 and lo > 0) else "no difference")
    evals = {s: (tuned[s]["eval"], base[s]["eval"]) for s in seeds if None not in (tuned[s]["eval"], base[s]["eval"])}
    eval_split = None
    if len(evals) >= 2:
        a, b = zip(*evals.values())
        eval_split = {"difference": float(np.mean(np.subtract(a, b))), "ci": list(stats.paired_ci(a, b)),
                      "p": stats.paired_p(a, b), "seeds": len(evals)}
    model = tuned[_median_seed(tuned, seeds)]["checkpoint"]
    return {**out, "verdict": verdict, "difference": diff, "ci": [lo, hi], "p": p,
            "per_seed": {str(s): float(np.mean(row)) for s, row in zip(seeds, table)}, "eval_split": eval_split,
            "model": model, "baseline_model": base[_median_seed(base, seeds)]["checkpoint"],
            "export": f"python -m rlhf.export {model} --out models/deploy"}


def cmd_confirm(args) -> int:
    """Runs the confirmation study (skipping what is done) and writes its record."""
    import json

    from rich.console import Console

    from experiments.driver import run_fixed
    from experiments.heldout import check_samples_per_prompt, read_rounds, read_test
    from experiments.paths import output_file
    from experiments.plan import expand, study_dir
    from experiments.results import read_aggregate
    from experiments.summary import NOTHING_TO_CONFIRM
    from rlhf import numerics
    from rlhf.atomic import write_text
    numerics.apply()

    if args.max_seeds < 2:
        raise StudyError(f"--max-seeds {args.max_seeds} is invalid: at least 2 (a paired test needs two seeds)")
    check_samples_per_prompt(args.samples_per_prompt)
    out_file = output_file(args.out)
    test_file, examples = read_test(args.test)
    rounds = read_rounds(args)
    plan = seed_count(rounds, args.max_seeds)
    seeds = fresh_seeds(rounds, plan["seeds"])
    study = confirmation_study(rounds, seeds, Path(args.results))
    console = Console(highlight=False)
    if not study.variants:  # the tuned recipe is the baseline's: nothing to run, nothing to confirm
        text = json.dumps({NOTHING_TO_CONFIRM: True, "bindings": [], "recipe": portable(study.baseline_recipe),
                           "why": "the rounds adopted no change: the tuned recipe is the baseline recipe"},
                          indent=2) + "\n"
        where = study_dir(study, args.results)  # the study's results dir holds the record too (a stage's output)
        where.mkdir(parents=True, exist_ok=True)
        write_text(where / "confirmation.json", text)
        write_text(out_file, text)
        console.print(f"wrote {args.out}: the rounds adopted no change, so there is nothing to confirm and nothing ran")
        return EXIT_OK
    console.print(f"confirmation: the tuned recipe against the original baseline, {len(seeds)} fresh seeds "
                  f"({seeds[0]}..{seeds[-1]}), {recipes(rounds)[2]} steps each", soft_wrap=True)
    args.argv = getattr(args, "argv", None) or ["confirm"]
    code = run_fixed(study, expand(study, args.results), args, console, None)
    if code == EXIT_INTERRUPTED:
        return code
    where = study_dir(study, args.results)
    agg = read_aggregate(where, f"{where}: no aggregate.json; the confirmation did not run")
    out = record(rounds, study, agg, _score(study, where, agg, examples, args.samples_per_prompt), plan, test_file)
    write_text(out_file, json.dumps(out, indent=2, allow_nan=False) + "\n")
    ci = out["ci"]
    shown = (f"{out['difference']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}] (p = {out['p']:.3g})"
             if out["difference"] is not None and None not in ci else "")
    console.print(f"wrote {args.out}: {out['verdict']} {shown}", soft_wrap=True)
    if out["difference"] is None:  # fewer than two seeds finished on both arms: no record the summary can read
        console.print(f"error: the confirmation has no verdict: {out['why']}; rerun `python -m experiments confirm` "
                      f"(finished runs are kept)", soft_wrap=True)
        return EXIT_RUNS_FAILED
    return EXIT_OK


def add_confirm_arguments(parser: argparse.ArgumentParser) -> None:
    from experiments.commands import add_run_arguments
    parser.add_argument("studies", nargs="+", help="the rounds' study recipes, in round order")
    parser.add_argument("-b", "--binding", action="append", default=[], help="a gin binding (repeatable)")
    parser.add_argument("--results", default="results", help="results root (default: %(default)s)")
    parser.add_argument("--test", required=True, help="the test split: a JSONL file, or the `testsplit` directory")
    parser.add_argument("--max-seeds", type=int, default=MAX_SEEDS,
                        help="the most seeds a side the seed plan may ask for (default: %(default)s)")
    parser.add_argument("--samples-per-prompt", type=int, default=0,
                        help="sampled responses per test prompt (default 0: the run's ppo.eval_samples_per_prompt)")
    parser.add_argument("--rerun-failed", action="store_true", help="also rerun runs that failed deterministically")
    parser.add_argument("--out", default="reports/confirmation.json", help="output (default: %(default)s)")
    add_run_arguments(parser)

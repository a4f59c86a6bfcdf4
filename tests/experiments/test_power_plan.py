"""Seeds planned for power (experiments/seed_plan.py): from a pilot's spread, before anything runs.

Pilots are small aggregate.json files written through results.py's dataclasses, not PPO runs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import stats
from experiments.cli import main
from experiments.errors import StudyError
from experiments.plan import expand
from experiments.results import (
    Comparison,
    Decision,
    RunOutcome,
    SeedPlan,
    StudyAggregate,
    VariantResult,
    load_aggregate,
)
from experiments.seed_plan import make_plan, plan_line, seed_plan, with_planned_waves
from experiments.study import load_study
from tests.experiments.conftest import fake_run
from tests.experiments.test_advise_recipe import synthetic_study
from tests.experiments.test_bad_input import one_line_error
from tests.experiments.test_plan import STUDY

REPO = Path(__file__).resolve().parents[2]

TARGET = ["study.target_effect = 0.05", "study.pilot = 'pilot'"]

PILOT = {  # per-seed gold accuracy of a finished round; 'lr' has one completed seed, so no spread
    "baseline": [0.40, 0.43, 0.46],
    "kl": [0.41, 0.45, 0.47],
    "lr": [0.44, None],
}


def write_pilot(results: Path, name: str = "pilot", values=PILOT) -> Path:
    """A finished study's results dir holding only its aggregate.json."""
    variants = {v: VariantResult(runs=tuple(RunOutcome(seed=i, status="completed" if x is not None else "failed",
                                                       value=x) for i, x in enumerate(vals)))
                for v, vals in values.items()}
    agg = StudyAggregate(study=name, study_file="", description="", metric="eval/accuracy", metric_from="final",
                         direction="higher", alpha=0.05, seeds=(0, 1, 2), guardrails=(), variants=variants,
                         decision=Decision("baseline", "test"))
    (results / name).mkdir(parents=True)
    agg.save(results / name / "aggregate.json")
    return results / name


def pilot_sigma() -> float:
    """The pilot's spread by hand: each variant with two or more seeds around its own mean."""
    groups = [np.array(v, float) for v in PILOT.values() if sum(x is not None for x in v) >= 2]
    return float(np.sqrt(sum(((g - g.mean()) ** 2).sum() for g in groups) / sum(len(g) - 1 for g in groups)))


def test_planned_seeds_are_seeds_needed_at_the_pilots_spread(write_study, tmp_path):
    write_pilot(tmp_path / "results")
    study = load_study(write_study(STUDY), TARGET)
    plan = seed_plan(study, tmp_path / "results")
    sigma = pilot_sigma()
    assert plan.sigma == pytest.approx(sigma, rel=1e-9) and plan.pilot == "pilot"
    assert (plan.pilot_seeds, plan.pilot_variants, plan.comparisons, plan.correlation) == (6, 2, 2, None)
    # Each arm by its own spread: the baseline continues the pilot's chosen arm (its baseline here),
    # the variants are planned at the spread pooled over the pilot's arms.
    chosen = float(np.std(PILOT["baseline"], ddof=1))
    assert (plan.sd_baseline, plan.sd_variant) == (pytest.approx(chosen), pytest.approx(sigma))
    expected = stats.seeds_needed(0.05, chosen, 0.05 / 2, 0.8, sd2=sigma)  # Bonferroni over 2 variants, Welch
    assert expected > 3 and plan.seeds == expected
    assert plan.power_at_seeds_run == pytest.approx(stats.power(0.05, chosen, 3, 3, 0.025, sd2=sigma), rel=1e-9)
    stricter = seed_plan(load_study(write_study(STUDY), [*TARGET, "study.power = 0.95"]), tmp_path / "results")
    assert stricter.seeds == stats.seeds_needed(0.05, chosen, 0.025, 0.95, sd2=sigma) > plan.seeds
    # A pilot that recorded the correlation between paired seeds (comparison.paired.correlation)
    # plans the paired design, at its smallest correlation.
    paired = StudyAggregate.load(tmp_path / "results" / "pilot" / "aggregate.json")
    for name, r in (("kl", 0.7), ("lr", 0.5)):
        cmp = Comparison()
        object.__setattr__(cmp, "paired", {"correlation": r})
        paired.variants[name] = dataclasses.replace(paired.variants[name], comparison=cmp)
    with_r = make_plan(paired, target_effect=0.05, power=0.8, alpha=0.05, variants=2, seeds_run=3)
    assert with_r.correlation == 0.5
    assert with_r.seeds == stats.seeds_needed(0.05, sigma, 0.025, 0.8, paired=True, correlation=0.5)


def test_plan_cli_prints_the_plan_and_the_shortfall(write_study, tmp_path):
    results = write_pilot(tmp_path / "results").parent
    path = write_study(STUDY + "study.target_effect = 0.05\nstudy.pilot = 'pilot'\n")
    out = subprocess.run([sys.executable, "-m", "experiments", "plan", str(path), "--results", str(results)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    sigma = pilot_sigma()
    n = stats.seeds_needed(0.05, sigma, 0.025, 0.8)
    at_3 = stats.power(0.05, sigma, 3, 3, 0.025)
    assert (f"plan: {n} seeds per variant detect +0.05 at 80% power (spread from pilot: sigma = {sigma:.2g}, "
            f"n = 3 seeds x 2 variants; alpha 0.05 / 2 variants)") in out.stdout
    assert (f"notice: this study runs 3 seeds per variant, fewer than the {n} planned: a true difference of +0.05 "
            f"is detected with {at_3:.0%} power; set study.seeds = {n}") in out.stdout
    assert sorted(p.name for p in results.iterdir()) == ["pilot"]  # planning wrote nothing


def test_enough_seeds_no_pilot_and_a_missing_pilot(write_study, tmp_path, capsys):
    results = write_pilot(tmp_path / "results").parent
    path = write_study(STUDY)
    n = stats.seeds_needed(0.05, pilot_sigma(), 0.025, 0.8)
    assert main(["plan", str(path), "--results", str(results), *sum((["-b", b] for b in TARGET), []),
                 "-b", f"study.seeds = {n}"]) == 0
    printed = capsys.readouterr().out
    assert f"plan: {n} seeds per variant" in printed and "notice" not in printed
    # No pilot and no resume_from: a pilot round is proposed, nothing fails.
    assert main(["plan", str(path), "--results", str(results), "-b", "study.target_effect = 0.05"]) == 0
    assert "plan: no spread to plan from: run a pilot round of 3 seeds first (study.pilot)" in capsys.readouterr().out
    # A pilot without two completed seeds in any variant: the same proposal, naming it.
    write_pilot(results, "thin", {"baseline": [0.4], "kl": [0.5, None]})
    assert main(["plan", str(path), "--results", str(results), "-b", "study.target_effect = 0.05",
                 "-b", "study.pilot = 'thin'"]) == 0
    assert "no spread to plan from (thin has no variant with two completed seeds)" in capsys.readouterr().out
    # A pilot that does not exist is one line naming it (by name, or as a results dir).
    err = one_line_error(capsys, ["plan", str(path), "--results", str(results), "-b", "study.target_effect = 0.05",
                                  "-b", "study.pilot = 'round0'"])
    assert "study.pilot = 'round0' does not exist" in err
    err = one_line_error(capsys, ["plan", str(path), "--results", str(results), "-b", "study.target_effect = 0.05",
                                  "-b", f"study.pilot = '{tmp_path}/nowhere'"])
    assert f"study.pilot = '{tmp_path}/nowhere' does not exist" in err


def test_resume_from_is_the_default_pilot(write_study, tmp_path):
    from tests.experiments.test_plan import _fake_previous_study
    prev = _fake_previous_study(tmp_path)  # two completed seeds of 'kl' with values
    agg = StudyAggregate.load(prev / "aggregate.json")
    runs = tuple(dataclasses.replace(r, value=v) for r, v in zip(agg.variants["kl"].runs, (0.5, 0.56)))
    agg.replace(variants={**agg.variants, "kl": dataclasses.replace(agg.variants["kl"], runs=runs)}).save(
        prev / "aggregate.json")
    study = load_study(write_study(STUDY + f"study.resume_from = '{prev}'\nstudy.target_effect = 0.1\n"))
    plan = seed_plan(study, tmp_path / "elsewhere")
    assert plan.pilot == "prev" and plan.sigma == pytest.approx(np.std([0.5, 0.56], ddof=1), rel=1e-9)
    assert plan.seeds == stats.seeds_needed(0.1, plan.sigma, 0.025, 0.8)


@pytest.mark.parametrize("binding, match", [
    ("study.target_effect = -0.02", "study.target_effect = -0.02 is invalid: must be a number > 0 in the units of "
                                    "eval/accuracy"),
    ("study.target_effect = 0", "study.target_effect = 0 is invalid"),
    ("study.target_effect = 'two points'", "study.target_effect = 'two points' is invalid"),
    ("study.target_effect = True", "study.target_effect = True is invalid"),
    ("study.power = 1.0", "study.power = 1.0 is invalid: must be a number in (0, 1)"),
    ("study.power = 0", "study.power = 0 is invalid: must be a number in (0, 1)"),
    ("study.power = '80%'", "study.power = '80%' is invalid"),
    ("study.pilot = 3", "study.pilot = 3 is invalid: must be a previous study's name"),
    ("study.pilot = 'round 1'", "study.pilot = 'round 1' is invalid: must be a previous study's name"),
    ("study.sequential = {'looks': 3}", "no 'max_seeds' and no study.target_effect"),
])
def test_bad_values_are_one_line(write_study, capsys, tmp_path, binding, match):
    err = one_line_error(capsys, ["plan", str(write_study(STUDY)), "--results", str(tmp_path), "-b", binding])
    assert match in err


def test_new_bindings_leave_every_run_unchanged(write_study, tmp_path):
    write_pilot(tmp_path / "results")
    path = write_study(STUDY)
    plain = [s.to_json() for s in expand(load_study(path), tmp_path / "results")]
    planned = [s.to_json() for s in expand(load_study(path, [*TARGET, "study.power = 0.9"]), tmp_path / "results")]
    assert planned == plain  # run hashes, config hashes, operative configs: byte for byte
    assert len({s["run_hash"] for s in plain}) == 9


def test_seed_waves_are_planned_from_the_pilot(write_study, tmp_path):
    """Seed waves without 'max_seeds' take the last wave the planner finds (at least the fixed
    design's N: waves pay a few seeds at most for stopping early), and `plan` prints the boundaries
    and the runs it expects; an explicit 'max_seeds' wins; with nothing to plan from, one line."""
    from experiments.seed_plan import plan_lines
    results = write_pilot(tmp_path / "results").parent
    path = write_study(STUDY)
    study = load_study(path, [*TARGET, "study.sequential = {'looks': 3}"])
    assert study.sequential.max_seeds is None and study.sequential.first == 3
    plan = seed_plan(study, results)
    filled = with_planned_waves(study, plan)
    assert filled.sequential.max_seeds == plan.seeds_run == plan.sequential["waves"][-1] >= plan.seeds
    assert plan.seeds == stats.seeds_needed(0.05, pilot_sigma(), 0.025, 0.8)
    assert len(plan.sequential["boundaries"]) == len(plan.sequential["waves"]) <= 3
    assert plan.sequential["runs_expected_null"] < plan.sequential["runs_fixed"] <= plan.sequential["runs_max"]
    lines = plan_lines(filled, plan)
    assert "in waves of " in lines[0] and lines[1].startswith("boundaries (obrien_fleming efficacy, pocock futility")
    explicit = load_study(path, [*TARGET, "study.sequential = {'max_seeds': 4}"])
    short = seed_plan(explicit, results)
    assert with_planned_waves(explicit, short).sequential.max_seeds == 4 and short.seeds_run == 4
    assert short.power_at_seeds_run is not None and short.power_at_seeds_run < 0.8
    bare = load_study(path, ["study.target_effect = 0.05", "study.sequential = {'looks': 2}"])
    with pytest.raises(StudyError, match=r"no 'max_seeds' and no seed plan gives one \(plan: no spread"):
        with_planned_waves(bare, seed_plan(bare, results))


def test_run_records_the_plan_in_plan_json_and_the_aggregate(write_study, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    results = write_pilot(tmp_path / "results").parent
    path = write_study(STUDY + "study.target_effect = 0.05\nstudy.pilot = 'pilot'\n")
    study = load_study(path)
    for spec in expand(study, results):  # every run finished: `run` launches nothing (no Ray)
        fake_run(spec, 0.5 + 0.01 * spec.seed)
    assert main(["run", str(path), "--results", str(results)]) == 0
    printed = capsys.readouterr().out
    plan = seed_plan(study, results)
    assert plan_line(plan) in printed and "notice: this study runs 3 seeds" in printed
    recorded = json.loads((results / "p" / "plan.json").read_text())["seed_plan"]
    assert SeedPlan.from_json(recorded) == plan and recorded["seeds"] == plan.seeds and recorded["pilot"] == "pilot"
    agg = load_aggregate(results / "p")
    assert agg.seed_plan == plan
    assert f"Seed plan: {plan.seeds} seeds per variant detect +0.05" in (results / "p" / "report.md").read_text()
    # `report` re-reads the plan plan.json recorded.
    (results / "p" / "aggregate.json").unlink()
    assert main(["report", str(path), "--results", str(results)]) == 0
    assert load_aggregate(results / "p").seed_plan == plan
    # An aggregate without the field was not written by this manager: refused, naming it.
    data = json.loads((results / "p" / "aggregate.json").read_text())
    del data["seed_plan"]
    with pytest.raises(ValueError,
                       match=r"^no seed_plan \(`python -m experiments report` writes the aggregate anew\)$"):
        StudyAggregate.from_json(data)


def test_the_next_round_carries_the_planned_seeds(tmp_path, capsys):
    study_dir = synthetic_study(tmp_path / "results")
    agg = StudyAggregate.load(study_dir / "aggregate.json")
    base = agg.variants["baseline"]
    runs = tuple(dataclasses.replace(r, value=v) for r, v in zip(base.runs, (0.40, 0.44)))
    agg.replace(variants={"baseline": dataclasses.replace(base, runs=runs)},
                seed_plan=SeedPlan(target_effect=0.05, power=0.8, alpha=0.05, comparisons=1)).save(
        study_dir / "aggregate.json")
    out = tmp_path / "next.gin"
    assert main(["advise", str(study_dir), "--out", str(out)]) == 0
    capsys.readouterr()
    n = stats.seeds_needed(0.05, float(np.std([0.40, 0.44], ddof=1)), 0.05 / 2, 0.8)  # two advised variants
    text = out.read_text()
    assert f"\nstudy.seeds = {n}\n" in text and "\nstudy.target_effect = 0.05\n" in text
    study = load_study(out)
    assert len(study.variants) == 2 and study.seeds == tuple(range(n)) and study.target_effect == 0.05
    # The header's line is the one `plan` prints for the next round (its pilot: resume_from, this round).
    line = plan_line(seed_plan(study, tmp_path / "results"))
    assert line.startswith(f"plan: {n} seeds per variant detect +0.05 at 80% power (spread from synth:")
    assert f"# Seeds, planned for study.target_effect from synth's spread:\n#   {line}\n" in text
    # Without a target effect the seeds carry over, as before.
    agg.save(study_dir / "aggregate.json")
    assert main(["advise", str(study_dir), "--out", str(out)]) == 0
    assert load_study(out).seeds == (0, 1) and "target_effect" not in out.read_text()

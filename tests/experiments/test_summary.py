"""The tuning path's summary on hand-made rounds (synthetic run dirs, no engine): its first line is
a verdict with its evidence (a confirmation run's, else that the setting is unconfirmed, with the
gain over the warm start), the setting is the bindings as the runs got them, one model is named
with the command that makes it loadable, a final choice that breaks a guardrail is never
recommended, and every interval counts lineages, not seeds."""

from __future__ import annotations

import json
import shutil
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from experiments.cli import main
from experiments.launch import write_plan
from experiments.plan import expand
from experiments.report import write_report
from experiments.results import StudyAggregate, aggregate_path
from experiments.study import load_study
from experiments.summary import Confirmation, model_to_ship, read_confirmation, render_summary
from tests.experiments.conftest import fake_checkpoint, fake_run

ROUND = """
study.name = '{name}'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 5']
study.variants = {variants}
study.seeds = {seeds}
study.guardrails = {{'kl_divergence': {{'max': 0.5}}}}
"""
R1 = {"baseline": [0.30, 0.34, 0.32]}
R2 = {"baseline": [0.30, 0.31, 0.32], "kl_up": [0.50, 0.52, 0.51]}
R3 = {"baseline": [0.50, 0.46, 0.52, 0.54, 0.44], "clip": [0.49, 0.47, 0.51, 0.53, 0.45]}
"""Round 3's seeds 3 and 4 resume round 2's seeds 0 and 1: three lineages, (0, 3), (1, 4) and (2)."""


def run_round(root: Path, name: str, values: dict, variants: str = "{}", extra: str = "", bindings=(),
              kl: float = 0.05) -> tuple:
    """A finished round under root/results: its study file, fake runs with the given final
    eval/accuracy per variant and seed, a checkpoint each, its plan and aggregate."""
    path = root / f"{name}.gin"
    path.write_text(textwrap.dedent(ROUND.format(name=name, variants=variants,
                                                 seeds=len(values["baseline"]))) + textwrap.dedent(extra))
    study = load_study(path, list(bindings))
    specs = expand(study, root / "results")
    out = root / "results" / name
    for spec in specs:
        fake_run(spec, values[spec.variant][spec.seed], kl=kl)
        fake_checkpoint(Path(spec.run_dir) / "checkpoints" / "step_5")
    write_plan(out, study, specs, None)
    return study, write_report(study, out, specs)


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory):
    """Rounds r1 (the baseline) and r2 (kl_up better), run once for the module from their root
    (paths are recorded relative to the working directory)."""
    root = tmp_path_factory.mktemp("path")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        run_round(root, "r1", R1)
        run_round(root, "r2", R2, "{'kl_up': 'ppo.kl_coef = 0.2'}", "study.resume_from = 'results/r1'\n")
    return root


@pytest.fixture
def path(two_rounds, tmp_path, monkeypatch):
    """A copy of r1 and r2 in tmp_path, the working directory: (root, r1, r2) with (study, aggregate) each."""
    root = tmp_path / "path"
    shutil.copytree(two_rounds, root)
    monkeypatch.chdir(root)
    return root, *((load_study(root / f"{name}.gin"), StudyAggregate.load(aggregate_path(root / "results" / name)))
                   for name in ("r1", "r2"))


def round3(root: Path, bindings=(), kl: float = 0.05) -> tuple:
    return run_round(root, "r3", R3, "{'clip': 'ppo.clip_range = 0.1'}",
                     "study.resume_from = 'results/r2'\nstudy.resume_setting = True\nstudy.target_effect = 0.05\n",
                     bindings, kl)


def lineage_means(values):
    return [np.mean([values[0], values[3]]), np.mean([values[1], values[4]]), values[2]]


def test_the_first_line_is_a_verdict_with_its_evidence(path):
    root, r1, r2 = path
    r3 = round3(root)
    assert r3[1].decision.chosen == "baseline" and len(r3[1].lineages) == 3
    text = render_summary([r1, r2, r3], root / "results")
    first = text.splitlines()[2]
    units = lineage_means(R3["baseline"])
    diff = np.mean(units) - 0.3  # every first-round seed evaluated 0.3 before training (fake_run)
    with warnings.catch_warnings():  # the warm start's evaluations tie: scipy warns, the p-value is right
        warnings.simplefilter("ignore", RuntimeWarning)
        p = sps.ttest_ind(units, [0.3, 0.3, 0.3], equal_var=False).pvalue
    assert first.startswith("**Not confirmed:** `ppo.kl_coef = 0.2` was chosen by r2 but never run against the "
                            "baseline recipe `")
    assert f"; gain over the warm start {diff:+.4f} [" in first
    assert f"(p = {p:.2g}; 3 lineages (5 seeds) against 3 first evaluations) on the eval split" in first
    assert "Deploy" not in text.split("## r1")[0]
    # The final choice and its gain count lineages, not seeds.
    lo, hi = sps.t.interval(0.95, 2, loc=np.mean(units), scale=sps.sem(units))
    assert (f"Final choice: `baseline` of r3, eval/accuracy = {np.mean(units):.4g}, the mean over 3 lineages "
            f"(5 seeds) (95% t interval over the lineage means [{lo:.4f}, {hi:.4f}]") in text
    # One model to ship, the median seed's, and the command that makes it loadable.
    assert "**Model to ship:** `results/r3/runs/baseline/seed0/checkpoints/step_5` (seed 0 of r3's `baseline`, " \
           "eval/accuracy 0.5: the median of its 5 seeds" in text
    assert ("`python -m rlhf.export results/r3/runs/baseline/seed0/checkpoints/step_5 --out "
            "models/r3-baseline-seed0-step5`") in text
    assert '`AutoModelForCausalLM.from_pretrained("models/r3-baseline-seed0-step5")`' in text
    assert "Tuned setting: `ppo.kl_coef = 0.2` (chosen by r2)" in text
    assert "The final choice's runs trained with `" in text and "`ppo.kl_coef = 0.2`; `ppo.total_steps = 5`" in text


def test_the_setting_is_what_the_runs_trained_with_overrides_included(path):
    """Round 3 ran with overrides (`--overrides params.yaml:r3` joins them to -b): one changes
    round 2's choice, one another parameter. The summary deploys the values the runs trained with,
    and the round's section names the overrides."""
    root, r1, r2 = path
    r3 = round3(root, ["ppo.kl_coef = 0.3", "ppo.max_grad_norm = 0.5"])
    assert r3[1].provenance["overrides"] == ["ppo.kl_coef = 0.3", "ppo.max_grad_norm = 0.5"]
    text = render_summary([r1, r2, r3], root / "results")
    first = text.splitlines()[2]
    assert first.startswith("**Not confirmed:** the tuned setting (`ppo.kl_coef = 0.3`, set by r3's overrides; "
                            "`ppo.max_grad_norm = 0.5`, set by r3's overrides) was never run against the baseline")
    assert "`ppo.kl_coef = 0.2`" not in first
    assert "Setting after r2: `ppo.kl_coef = 0.2`" in text
    assert "Setting after r3: `ppo.kl_coef = 0.3`, `ppo.max_grad_norm = 0.5`" in text
    assert "Run with overrides: `ppo.kl_coef = 0.3`; `ppo.max_grad_norm = 0.5`" in text.split("## r3")[1]
    # An aggregate written before the record: the study files' setting, as before.
    old = [(s, a.replace(provenance={k: v for k, v in a.provenance.items()
                                     if k not in ("baseline_bindings", "overrides")})) for s, a in (r1, r2, r3)]
    assert render_summary(old, root / "results").splitlines()[2].startswith(
        "**Not confirmed:** `ppo.kl_coef = 0.2` was chosen by r2")


def test_a_path_that_kept_its_baseline_deploys_the_baseline_recipe_as_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r1 = run_round(tmp_path, "r1", R1)
    text = render_summary([r1], tmp_path / "results")
    first = text.splitlines()[2]
    assert first.startswith("**No tuned change:** every round kept its baseline, so what is deployed is the "
                            "baseline recipe `") and "` as is; its training's gain over the warm start" in first
    assert "with these bindings" not in text and "Tuned setting" not in text
    assert "**Model to ship:** `results/r1/runs/baseline/seed2/checkpoints/step_5`" in text  # 0.32: the median


def test_a_final_choice_that_breaks_a_guardrail_is_never_recommended(path):
    root, r1, r2 = path
    r3 = round3(root, kl=0.9)  # every run of round 3 breaks kl_divergence <= 0.5: the baseline is kept
    assert r3[1].decision.chosen == "baseline" and not r3[1].chosen.guardrails_ok
    text = render_summary([r1, r2, r3], root / "results")
    first = text.splitlines()[2]
    assert first.startswith("**Nothing to deploy:** r3's final choice `baseline` breaks its guardrails "
                            "(kl_divergence <= 0.5: seeds 0, 1, 2, 3, 4)")
    assert "No model to ship" in text and "**Model to ship:**" not in text
    assert "Setting after r3: `ppo.kl_coef = 0.2` ⚠ its runs break a guardrail" in text


def test_a_confirmation_run_decides_the_first_line(path, tmp_path):
    root, r1, r2 = path
    r3 = round3(root)
    record = {"bindings": ["ppo.kl_coef = 0.2"], "difference": 0.031, "ci": [0.012, 0.05], "p": 0.004,
              "n_units": 6, "model": "results/confirm/runs/tuned/seed2/checkpoints/step_5", "study": "confirm"}
    file = tmp_path / "confirmation.json"
    file.write_text(json.dumps(record))
    text = render_summary([r1, r2, r3], root / "results", confirmation=read_confirmation(file))
    assert text.splitlines()[2] == ("**Deploy** `ppo.kl_coef = 0.2`: +0.0310 [0.0120, 0.0500] over the baseline "
                                    "(p = 0.004; 6 lineages per arm, `confirm`).")
    assert "**Model to ship:** `results/confirm/runs/tuned/seed2/checkpoints/step_5`" in text
    assert "--out models/confirm-tuned-seed2-step5" in text
    assert "Without the confirmation, the path's own evidence: gain over the warm start" in text

    weak = Confirmation(bindings=("ppo.kl_coef = 0.2",), difference=0.01, ci=(-0.05, 0.07), p=0.7, n_units=6,
                        model="m", baseline_model="results/confirm/runs/baseline/seed1/checkpoints/step_5")
    text = render_summary([r1, r2, r3], root / "results", confirmation=weak)
    first = text.splitlines()[2]
    assert first.startswith("**No evidence that the tuned recipe beats the baseline** (+0.0100 [-0.0500, 0.0700], "
                            "p = 0.7; 6 lineages per arm): keep the baseline recipe `")
    from experiments import stats
    needed = stats.seeds_needed(0.05, 0.12 / (2 * 1.96) * np.sqrt(3), 0.05)  # round 3's target effect
    assert needed > 6 and f"or run {needed - 6} more seeds per arm ({needed} detect +0.05 at 80% power)." in first
    assert "**Model to ship:** `results/confirm/runs/baseline/seed1/checkpoints/step_5`" in text
    powered = Confirmation(bindings=("ppo.kl_coef = 0.2",), difference=0.0, ci=(-0.01, 0.01), p=1.0, n_units=6,
                           model="m")
    assert render_summary([r1, r2, r3], root / "results", confirmation=powered).splitlines()[2].endswith(
        ": 6 lineages per arm detect +0.05 at 80% power, so a gain that size would likely have shown.")
    broken = Confirmation(bindings=("ppo.kl_coef = 0.2",), difference=0.05, ci=(0.02, 0.08), p=0.001, n_units=6,
                          model="m", guardrail_violations=("kl_divergence <= 0.5: seeds 1, 2",))
    assert render_summary([r1, r2, r3], root / "results", confirmation=broken).splitlines()[2].startswith(
        "**Nothing to deploy:** the confirmation runs of `ppo.kl_coef = 0.2` break a guardrail")
    other = Confirmation(bindings=("ppo.kl_coef = 0.1",), difference=0.05, ci=(0.02, 0.08), p=0.001, n_units=6,
                         model="m")
    assert "The confirmation ran `ppo.kl_coef = 0.1`, not the path's tuned setting (`ppo.kl_coef = 0.2`)" in \
        render_summary([r1, r2, r3], root / "results", confirmation=other)


def test_a_bad_confirmation_record_is_one_line(path, tmp_path, capsys):
    root, r1, r2 = path
    file = tmp_path / "bad.json"
    file.write_text(json.dumps({"bindings": [], "difference": "big"}))
    code = main(["summary", str(root / "r1.gin"), str(root / "r2.gin"), "--results", str(root / "results"),
                 "--confirmation", str(file), "--out", str(tmp_path / "s.md")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith(f"error: --confirmation {file}: not a confirmation record (")
    file.write_text(json.dumps({"bindings": [], "difference": 0.1, "ci": [0, 0.2], "p": 0.04, "n_units": 1,
                                "model": "m"}))
    with pytest.raises(Exception, match="n_units at least 2"):
        read_confirmation(file)


def test_the_test_split_counts_lineages_and_prompts(path):
    """The heldout record of round 3's choice: per-prompt scores give two-level intervals over its
    3 lineages and the prompts, and the power line says the split cannot detect the target effect."""
    root, r1, r2 = path
    r3 = round3(root)
    rng = np.random.default_rng(0)
    prompts = 40
    difficulty = rng.uniform(0, 1, prompts)
    gained = rng.normal(0.02, 0.25, prompts)  # training helps some prompts and hurts others

    def row(seed, shift, **extra):
        correct = rng.binomial(16, np.clip(difficulty + shift, 0, 1)).tolist()
        greedy = (np.asarray(correct) > 8).astype(int).tolist()
        return {"seed": seed, "path": extra.pop("path", "models/sft/model"), "accuracy": sum(correct) / (16 * prompts),
                "greedy_accuracy": sum(greedy) / prompts, "eval_accuracy": extra.pop("eval", 0.3),
                "per_prompt": {"accuracy": {"samples": 16, "correct": correct},
                               "greedy_accuracy": {"samples": 1, "correct": greedy}}, **extra}

    record = {"test": {"path": "data/test.jsonl", "prompts": prompts}, "samples_per_prompt": 16,
              "warm_start": {"study": "r1", "path": "models/sft/model", "seeds": [row(s, 0.0) for s in range(5)]},
              "final_choice": {"study": "r3", "variant": "baseline", "seeds": [
                  row(s, gained, path=f"results/r3/runs/baseline/seed{s}/checkpoints/step_5", step=5,
                      eval=R3["baseline"][s]) for s in range(5)]},
              "best_checkpoint": None, "missing": []}
    text = render_summary([r1, r2, r3], root / "results", heldout=record)
    section = text.split("## Test split")[1].split("**Next round")[0]
    assert "| final choice `baseline` (r3) | `results/r3/runs/baseline/seed*/checkpoints/step_5` | 3 lineages " \
           "(5 seeds) |" in section
    assert "(over 3 lineages (5 seeds) and 40 prompts, paired by seed and prompt)" in section
    assert "**The test split is too small to detect the target effect 0.05** (study.target_effect)" in section
    assert "cannot grow without retraining" in section
    # A record written before the per-prompt scores: said, and no traceback.
    for r in [*record["warm_start"]["seeds"], *record["final_choice"]["seeds"]]:
        r.pop("per_prompt")
    old = render_summary([r1, r2, r3], root / "results", heldout=record)
    assert "**This record has no per-prompt scores**" in old and "prompts ignored" in old


def test_the_model_to_ship_is_the_median_seed(path):
    root, r1, r2 = path
    agg = r2[1]
    ship = model_to_ship(agg, root / "results" / "r2")
    assert (ship["seed"], ship["value"], ship["n"]) == (2, 0.51, 3) and ship["exists"]
    even = agg.replace(variants={**agg.variants, "kl_up": agg.variants["kl_up"].__class__(
        **{**agg.variants["kl_up"].__dict__, "runs": agg.variants["kl_up"].runs[:2]})})
    assert model_to_ship(even, root / "results" / "r2")["seed"] == 0  # even: the lower middle
    assert isinstance(StudyAggregate.from_json(agg.to_json()), StudyAggregate)

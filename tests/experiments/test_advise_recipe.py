"""`python -m experiments advise RESULTS/STUDY` on a synthetic finished study: the table, and a
next-study recipe that parses and plans (one variant per change, resuming from the study)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.cli import main
from experiments.errors import StudyError
from experiments.plan import expand
from experiments.results import Decision, GuardrailCheck, RunOutcome, StudyAggregate, VariantResult
from experiments.study import load_study
from rlhf.configurable import RECIPES_DIR
from tests.experiments.conftest import fake_checkpoint

CONFIG_GIN = """# Parameters for ppo:
ppo.actor_learning_rate = 0.0003
ppo.clip_range = 0.2
ppo.critic_learning_rate = 0.0009
ppo.kl_coef = 0.05
ppo.max_response_length = 6
ppo.mini_batch_size = 32
ppo.num_rollout_batches = 2
ppo.rollout_micro_batch_size = 32
ppo.samples_per_prompt = 1
"""


def synthetic_study(root: Path, name: str = "synth", hacked: bool = False) -> Path:
    """A finished study's results dir: KL too high, responses far under the max, clean otherwise;
    `hacked`: held-out evaluations at steps 0, 10 and 20 where gold falls as the RM score rises."""
    study_dir = root / name
    runs, plan = [], []
    for seed in (0, 1):
        run_dir = study_dir / "runs" / "baseline" / f"seed{seed}"
        fake_checkpoint(run_dir / "checkpoints" / "step_20")
        (run_dir / "config.gin").write_text(CONFIG_GIN)
        rng = np.random.default_rng(seed)
        evals = {0: (0.30, 0.5), 10: (0.26, 1.2), 20: (0.21 + 0.01 * seed, 1.9)} if hacked else {}
        with open(run_dir / "metrics.jsonl", "w") as f:
            if hacked:  # the engine's initial evaluation: its own row, before any update
                f.write(json.dumps({"step": 0, "eval/accuracy": evals[0][0], "eval/rm_score": evals[0][1]}) + "\n")
            for step in range(1, 21):
                row = {"step": step, "reward_mean": 0.3 + 0.02 * step + rng.normal(0, 0.01),
                       "kl_divergence": 0.3, "clip_fraction": 0.3, "response_length_mean": 2.8,
                       "response_clip_ratio": 0.0, "rollout_success_rate": 1.0}
                if step in evals:
                    row.update({"eval/accuracy": evals[step][0], "eval/rm_score": evals[step][1]})
                f.write(json.dumps(row) + "\n")
        runs.append(RunOutcome(seed=seed, status="completed", value=0.4, run_dir=f"runs/baseline/seed{seed}"))
        plan.append({"variant": "baseline", "seed": seed, "recipe": str(RECIPES_DIR / "tiny.gin"), "cpus": 1,
                     "bindings": ["ppo.total_steps = 4", "ppo.eval_every = 2", f"ppo.seed = {seed}",
                                  "ppo.torch_threads = 1"]})
    rail = GuardrailCheck(bound="rollout_success_rate >= 0.95", min=0.95)
    agg = StudyAggregate(study=name, study_file="", description="", metric="eval/accuracy", metric_from="final",
                         direction="higher", alpha=0.05, seeds=(0, 1), guardrails=(rail.bound,),
                         decision=Decision("baseline", "baseline only"),
                         variants={"baseline": VariantResult(runs=tuple(runs), completed=len(runs),
                                                             guardrails={"rollout_success_rate": rail})})
    agg.save(study_dir / "aggregate.json")
    (study_dir / "plan.json").write_text(json.dumps({"study": name, "campaign": "camp", "runs": plan}))
    return study_dir


def test_advise_writes_a_next_study_that_parses_and_plans(tmp_path, capsys):
    study_dir = synthetic_study(tmp_path / "results")
    out, advice = tmp_path / "next.gin", tmp_path / "advice.json"
    assert main(["advise", str(study_dir), "--out", str(out), "--name", "synth2", "--json", str(advice)]) == 0
    printed = capsys.readouterr().out
    assert "kl_high" in printed and "response_length" in printed
    study = load_study(out)
    variants = {v.name: v.bindings for v in study.variants}
    assert variants == {"kl_coef_up": ("ppo.kl_coef = 0.06",),
                        "max_response_length_down": ("ppo.max_response_length = 5",)}
    assert study.name == "synth2" and study.resume_from == str(study_dir.resolve()) and study.seeds == (0, 1)
    assert study.campaign == "camp"  # the next round logs to the same W&B project
    assert study.baseline_bindings == ("ppo.total_steps = 4", "ppo.eval_every = 2")
    assert [g.describe() for g in study.guardrails] == ["rollout_success_rate >= 0.95"]
    specs = expand(study, tmp_path / "results")
    assert len(specs) == 3 * 2 and all(s.init_from.endswith("step_20") for s in specs)
    text = out.read_text()
    assert "kl_divergence = 0.3" in text  # the evidence travels in the header
    assert json.loads(advice.read_text())["changes"][0]["rule"] == "kl_high"


def test_advise_keeps_the_top_variants_and_names_bad_input(tmp_path, capsys):
    study_dir = synthetic_study(tmp_path / "results")
    out = tmp_path / "top.gin"
    assert main(["advise", str(study_dir), "--out", str(out), "--max-variants", "1"]) == 0
    assert [v.name for v in load_study(out).variants] == ["kl_coef_up"]
    assert main(["advise", str(tmp_path / "nowhere")]) == 2
    assert main(["advise", str(study_dir), "-t", "kl_high.kl_limit=1"]) == 2
    assert "kl_limit is not a threshold" in capsys.readouterr().err
    with pytest.raises(StudyError):
        load_study(tmp_path / "missing.gin")


def test_tuning_path_shows_the_advice_beside_the_round_that_tested_it(tmp_path):
    from experiments.advisor.evidence import advice_lines

    study_dir = synthetic_study(tmp_path / "results")
    aggregate = StudyAggregate.load(study_dir / "aggregate.json").replace(variants={
        "baseline": VariantResult(),
        "kl_coef_up": VariantResult(bindings=("ppo.kl_coef = 0.06",), verdict="better"),
        "lr_down": VariantResult(bindings=("ppo.actor_learning_rate = 0.0001",), verdict="worse")})
    text = "\n".join(advice_lines(study_dir, aggregate))
    assert "| kl_high | `ppo.kl_coef = 0.06` (from 0.05) | kl_divergence = 0.3" in text
    assert "| kl_coef_up | better |" in text
    # The rule's sizing (KL ~ 1 / kl_coef^2) predicts the KL at 0.06; no run of this study dir measured it.
    kl = [line for line in text.splitlines() if line.startswith("| kl_high |")][0]
    assert "| kl_divergence " in kl and "measured" not in kl
    assert "`ppo.max_response_length = 5` (from 6)" in text and "not tested this round" in text
    assert "| (none) | `ppo.actor_learning_rate = 0.0001` | no rule proposed it | - | lr_down | worse |" in text


def test_resume_setting_carries_the_previous_rounds_chosen_change(tmp_path, write_study):
    study_dir = synthetic_study(tmp_path / "results")
    agg = json.loads((study_dir / "aggregate.json").read_text())
    agg["variants"]["kl_up"] = {**agg["variants"]["baseline"], "bindings": ["ppo.kl_coef = 0.08"]}
    agg["decision"]["chosen"] = "kl_up"
    (study_dir / "aggregate.json").write_text(json.dumps(agg))
    text = (f"study.name = 'next'\nstudy.baseline_bindings = ['ppo.total_steps = 4']\nstudy.variants = {{}}\n"
            f"study.seeds = 2\nstudy.resume_from = {str(study_dir)!r}\n")
    inherited = expand(load_study(write_study(text + "study.resume_setting = True\n")), tmp_path / "results")
    assert inherited[0].bindings[0] == "ppo.kl_coef = 0.08" and "ppo.kl_coef = 0.08" in inherited[0].operative_config
    plain = expand(load_study(write_study(text, "plain.gin")), tmp_path / "results")
    assert "ppo.kl_coef = 0.08" not in plain[0].bindings


def test_over_optimisation_bracket_becomes_one_variant_per_value(tmp_path, capsys):
    """Gold falls while the RM score rises: the guide's kl_coef +20% gives way to a bracket, each
    value its own one-parameter variant of the next round, planned like any other."""
    study_dir = synthetic_study(tmp_path / "results", hacked=True)
    out, advice = tmp_path / "next.gin", tmp_path / "advice.json"
    assert main(["advise", str(study_dir), "--out", str(out), "--json", str(advice)]) == 0
    printed = capsys.readouterr().out
    assert "over_optimisation" in printed and "superseded" in printed
    study = load_study(out)
    variants = {v.name: v.bindings for v in study.variants}
    # KL 0.3 is 3.75x the band's top: sqrt(3.75) = 1.9 < the smallest step x2; the bracket's top is x3 of it.
    assert variants == {"kl_coef_x2": ("ppo.kl_coef = 0.1",), "kl_coef_x6": ("ppo.kl_coef = 0.3",),
                        "max_response_length_down": ("ppo.max_response_length = 5",)}
    specs = expand(study, tmp_path / "results")
    assert len(specs) == 4 * 2 and all(s.init_from.endswith("step_20") for s in specs)
    text = out.read_text()
    assert "1. kl_coef_x2, kl_coef_x6 [over_optimisation]" in text and "held-out gold accuracy fell 0.3" in text
    saved = json.loads(advice.read_text())
    assert saved["changes"][0]["bindings"] == ["ppo.kl_coef = 0.1", "ppo.kl_coef = 0.3"]
    assert [s["rule"] for s in saved["superseded"]] == ["kl_high"]
    # A variant budget counts variants: the bracket is cut, not the rule ranked below it kept.
    top = tmp_path / "top.gin"
    assert main(["advise", str(study_dir), "--out", str(top), "--max-variants", "1"]) == 0
    assert [v.name for v in load_study(top).variants] == ["kl_coef_x2"]


def test_tuning_path_shows_a_bracket_and_the_kl_step_it_superseded(tmp_path):
    from experiments.advisor.evidence import advice_lines

    study_dir = synthetic_study(tmp_path / "results", hacked=True)
    aggregate = StudyAggregate.load(study_dir / "aggregate.json").replace(variants={
        "baseline": VariantResult(),
        "kl_coef_x6": VariantResult(bindings=("ppo.kl_coef = 0.3",), verdict="better"),
        "kl_coef_up": VariantResult(bindings=("ppo.kl_coef = 0.06",), verdict="no detectable difference")})
    text = "\n".join(advice_lines(study_dir, aggregate))
    assert "| over_optimisation | `ppo.kl_coef = 0.1` (from 0.05) | gold_start = 0.3" in text
    assert "| over_optimisation | `ppo.kl_coef = 0.3` (from 0.05) | the bracket's next value" in text
    assert "| kl_coef_x6 | better |" in text
    assert "| kl_high (superseded) | `ppo.kl_coef = 0.06` (from 0.05) | kl_divergence = 0.3" in text
    assert "- over_optimisation: over-optimisation of the reward model: held-out gold accuracy fell" in text


def test_a_change_the_study_found_equivalent_or_worse_is_not_proposed_again(tmp_path, capsys):
    study_dir = synthetic_study(tmp_path / "results")
    agg = StudyAggregate.load(study_dir / "aggregate.json")
    tested = {"kl_coef_up": VariantResult(bindings=("ppo.kl_coef = 0.060",), verdict="equivalent")}
    agg.replace(variants={**agg.variants, **tested}, equivalence_margin=0.02).save(study_dir / "aggregate.json")
    out, advice = tmp_path / "next.gin", tmp_path / "advice.json"
    assert main(["advise", str(study_dir), "--out", str(out), "--json", str(advice)]) == 0
    assert "not proposed again: synth/kl_coef_up found it equivalent" in capsys.readouterr().out
    study = load_study(out)
    assert [v.name for v in study.variants] == ["max_response_length_down"]
    assert study.equivalence_margin == 0.02  # the margin carries over with the metric
    assert "settled [kl_high]: ppo.kl_coef = 0.06 not proposed again" in out.read_text()
    assert json.loads(advice.read_text())["settled"][0]["binding"] == "ppo.kl_coef = 0.06"
    # A worse verdict settles it too; no detectable difference does not.
    for verdict, proposed in (("worse", False), ("no detectable difference", True)):
        variant = VariantResult(bindings=("ppo.kl_coef = 0.06",), verdict=verdict)
        agg.replace(variants={**agg.variants, "kl_coef_up": variant}).save(study_dir / "aggregate.json")
        assert main(["advise", str(study_dir), "--out", str(out)]) == 0
        assert ("kl_coef_up" in {v.name for v in load_study(out).variants}) == proposed, verdict

"""Aggregate, verdicts, guardrails and the report on synthetic run dirs (no engine needed)."""

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.collect import band
from experiments.plan import expand
from experiments.report import write_report
from experiments.study import load_study
from rlhf.atomic import write_json
from tests.experiments.conftest import fake_run

STUDY = """
study.name = 'synthetic'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 5']
study.variants = {'good': 'ppo.kl_coef = 0.1', 'same': 'ppo.clip_range = 0.1', 'hot': 'ppo.actor_learning_rate = 0.01',
                  'broken': 'ppo.adam_eps = 1e-300'}
study.seeds = 4
study.guardrails = {'kl_divergence': {'max': 0.5}, 'rollout_success_rate': {'min': 0.95}}
"""

ACCURACY = {  # final eval/accuracy per seed
    "baseline": [0.50, 0.52, 0.49, 0.51],
    "good": [0.70, 0.72, 0.69, 0.71],
    "same": [0.51, 0.49, 0.53, 0.50],
    "hot": [0.80, 0.82, 0.79, 0.81],
}


@pytest.fixture
def study_dir(write_study, tmp_path):
    study = load_study(write_study(STUDY))
    specs = expand(study, tmp_path / "results")
    for spec in specs:
        if spec.variant == "broken":
            fake_run(spec, 0.0, diverged=True)
        else:
            acc = ACCURACY[spec.variant][spec.seed]
            fake_run(spec, acc, kl=0.9 if spec.variant == "hot" and spec.seed == 2 else 0.05)
    return study, specs, tmp_path / "results" / "synthetic"


def test_verdicts_guardrails_and_decision(study_dir):
    study, specs, out = study_dir
    agg = write_report(study, out, specs).to_json()  # the documented file format
    v = agg["variants"]
    assert v["good"]["verdict"] == "better"
    assert v["hot"]["verdict"] == "better" and not v["hot"]["guardrails_ok"]
    assert v["hot"]["guardrails"]["kl_divergence"]["violated_seeds"] == [2]
    assert v["same"]["verdict"] == "no detectable difference"
    assert v["broken"]["verdict"] == "failed" and v["broken"]["summary"]["n"] == 0
    assert agg["decision"]["chosen"] == "good"  # 'hot' is better but breaks a guardrail
    assert agg["decision"]["guardrail_violations"] == ["hot"]
    base = np.array(ACCURACY["baseline"])
    assert v["baseline"]["summary"]["mean"] == pytest.approx(base.mean())
    assert v["good"]["comparison"]["difference"] == pytest.approx(np.mean(ACCURACY["good"]) - base.mean())
    # Holm over the testable variants: the smallest raw p (of the deciding analysis: paired, the
    # study's seeds being every variant's) is multiplied by their number. 'good' is 0.2 above the
    # baseline on every seed to the last bit: no variance, no p-value, decided by the sign.
    assert {v[n]["comparison"]["analysis"] for n in ("good", "same", "hot")} == {"paired"}
    assert v["good"]["comparison"]["paired"]["p_value"] is None and "zero variance" in v["good"]["explanation"]
    raw = {n: v[n]["comparison"]["paired"]["p_value"] for n in ("hot", "same")}
    smallest = min(raw, key=raw.get)
    assert v[smallest]["comparison"]["p_value_holm"] == pytest.approx(min(1, 2 * raw[smallest]))


def test_report_files(study_dir):
    study, specs, out = study_dir
    write_report(study, out, specs)
    report = (out / "report.md").read_text()
    for text in ("Decision table", "Per-seed values", "Guardrails", "Provenance", "`good`", "diverged",
                 "plots/reward_mean.png"):
        assert text in report
    saved = json.loads((out / "aggregate.json").read_text())
    assert saved["decision"]["chosen"] == "good"
    assert {p.name for p in (out / "plots").glob("*.png")} == {
        "reward_mean.png", "kl_divergence.png", "clip_fractions.png", "response_length_mean.png",
        "eval_accuracy.png"}


def test_underpowered_when_few_seeds(write_study, tmp_path):
    study = load_study(write_study(STUDY), ["study.seeds = 2"])
    specs = expand(study, tmp_path / "r")
    for spec in specs:
        acc = {"baseline": [0.50, 0.56], "good": [0.53, 0.57]}.get(spec.variant, [0.5, 0.5])[spec.seed]
        fake_run(spec, acc, diverged=spec.variant == "broken")
    agg = write_report(study, tmp_path / "r" / "synthetic", specs).to_json()
    good = agg["variants"]["good"]
    assert good["verdict"] == "no detectable difference" and good["underpowered"]
    assert good["comparison"]["seeds_needed"] > 2
    assert "underpowered" in (tmp_path / "r" / "synthetic" / "report.md").read_text()


def test_band_aligns_steps_across_seeds():
    steps, mean, std = band([(np.array([0, 5]), np.array([1.0, 3.0])), (np.array([0, 2, 5]), np.array([3.0, 7.0, 5.0]))])
    assert steps.tolist() == [0, 2, 5]
    assert mean.tolist() == [2.0, 7.0, 4.0]
    assert std.tolist() == [1.0, 0.0, 1.0]


def test_baseline_only_study_reports_and_keeps_the_baseline(write_study, tmp_path):
    study = load_study(write_study(STUDY), ["study.variants = {}", "study.seeds = 2"])
    specs = expand(study, tmp_path / "r")
    for spec in specs:
        fake_run(spec, ACCURACY["baseline"][spec.seed])
    agg = write_report(study, tmp_path / "r" / "synthetic", specs)
    assert list(agg.variants) == ["baseline"] and agg.decision.chosen == "baseline"
    assert agg.variants["baseline"].summary.n == 2
    agg = agg.to_json()
    assert list(agg["variants"]) == ["baseline"] and agg["decision"]["chosen"] == "baseline"
    assert agg["variants"]["baseline"]["summary"]["n"] == 2


def test_runs_from_different_hardware_are_named_in_the_report(study_dir):
    study, specs, out = study_dir
    for spec in specs:
        cpu = {"vendor": "AuthenticAMD", "model_name": "AMD EPYC 9654"} if spec.seed == 3 else \
            {"vendor": "GenuineIntel", "model_name": "Intel Xeon Platinum 8480+"}
        write_json(Path(spec.run_dir) / "provenance.json", {"versions": {"torch": "x"},
                                                           "hardware": {"hostname": "h", "cpu_info": cpu}})
    agg = write_report(study, out, specs)
    mixed = agg.provenance["hardware_mixed"]
    assert len(mixed) == 2 and sum(len(runs) for runs in mixed.values()) == len(specs)
    amd = next(runs for fp, runs in mixed.items() if "EPYC" in fp)
    assert sorted(amd) == sorted(s.key for s in specs if s.seed == 3)
    assert "**Runs from different hardware:** 2 machines" in (out / "report.md").read_text()
    write_report(study, out, specs[:1])  # one machine: nothing to say
    assert "different hardware" not in (out / "report.md").read_text()


def test_reward_model_score_is_reported_beside_gold_accuracy(write_study, tmp_path):
    """A study deciding on gold accuracy shows the reward model's final score next to it (and the
    other way round), so a reward model pushed up while accuracy falls is visible in the report."""
    study = load_study(write_study(STUDY), ["study.variants = {'good': 'ppo.kl_coef = 0.1'}"])
    specs = expand(study, tmp_path / "results")
    rm = {"baseline": [1.0, 1.2, 1.1, 0.9], "good": [2.0, 2.2, 2.1, 1.9]}
    for spec in specs:
        fake_run(spec, ACCURACY[spec.variant][spec.seed])
        summary = Path(spec.run_dir) / "summary.json"
        data = json.loads(summary.read_text())
        data["final"]["eval/rm_score"] = rm[spec.variant][spec.seed]
        data["initial"]["eval/rm_score"] = 0.5
        write_json(summary, data)
    agg = write_report(study, tmp_path / "results" / "synthetic", specs)
    beside = agg.variant("good").beside
    assert set(beside) == {"eval/rm_score"} and beside["eval/rm_score"].mean == pytest.approx(2.05)
    assert "eval/accuracy" not in agg.variant("baseline").beside  # the decision metric is not repeated
    assert agg.to_json()["variants"]["good"]["beside"]["eval/rm_score"]["n"] == 4
    report = (tmp_path / "results" / "synthetic" / "report.md").read_text()
    assert "| variant | eval/rm_score |" in report and "2.05 +- " in report
    from experiments.report import render_summary
    from experiments.results import StudyAggregate
    assert StudyAggregate.from_json(agg.to_json()) == agg
    text = render_summary([(study, agg)], tmp_path / "results")
    assert "eval/rm_score" in text and "(the warm start): eval/accuracy = 0.3000; eval/rm_score = 0.5000" in text

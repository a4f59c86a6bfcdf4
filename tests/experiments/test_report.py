"""Aggregate, verdicts, guardrails and the report on synthetic run dirs (no engine needed)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments.collect import band
from experiments.plan import expand
from experiments.report import render, write_report
from experiments.study import load_study
from rlhf.atomic import write_json
from tests.experiments.conftest import fake_checkpoint, fake_run

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
    # Holm over the 4 declared variants (the family is fixed before any run: 'broken', which
    # failed, still takes its share): the smallest raw p is multiplied by 4.
    raw = {n: v[n]["comparison"]["p_value"] for n in ("good", "same", "hot")}
    smallest = min(raw, key=raw.get)
    assert v[smallest]["comparison"]["p_value_holm"] == pytest.approx(min(1, 4 * raw[smallest]))
    assert v["good"]["comparison"]["alpha_per_test"] == pytest.approx(0.05 / 4)


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


def test_overrides_the_runs_got_are_recorded_and_reported(write_study, tmp_path):
    """Bindings beyond the study file (`--overrides FILE:KEY` joins them to -b) are what the runs
    trained with: the aggregate records them from the plan, so a report written later without them
    (`report` with the study file alone) still names them, and an aggregate written before the
    record reads as it did."""
    from experiments.collect import load_plan
    from experiments.launch import write_plan
    from experiments.results import StudyAggregate

    path = write_study(STUDY)
    study = load_study(path, ["study.variants = {'good': 'ppo.kl_coef = 0.1'}", "ppo.max_grad_norm = 0.5"])
    specs = expand(study, tmp_path / "results")
    for spec in specs:
        fake_run(spec, ACCURACY[spec.variant][spec.seed])
    out = tmp_path / "results" / "synthetic"
    write_plan(out, study, specs, None)  # as `run` launches it
    agg = write_report(study, out, specs)
    assert agg.provenance["baseline_bindings"] == ["ppo.total_steps = 5", "ppo.max_grad_norm = 0.5"]
    assert agg.provenance["overrides"] == ["ppo.max_grad_norm = 0.5"]
    report = (out / "report.md").read_text()
    assert "**Run with overrides:** `ppo.max_grad_norm = 0.5`" in report
    assert "- the baseline's bindings as its runs got them: `ppo.total_steps = 5`; `ppo.max_grad_norm = 0.5`" in report
    later = write_report(load_study(path, ["study.variants = {'good': 'ppo.kl_coef = 0.1'}"]), out, load_plan(out))
    assert later.provenance["overrides"] == ["ppo.max_grad_norm = 0.5"]
    plain = write_report(load_study(path, ["study.variants = {'good': 'ppo.kl_coef = 0.1'}"]), out,
                         expand(load_study(path, ["study.variants = {'good': 'ppo.kl_coef = 0.1'}"]), tmp_path / "r2"))
    assert plain.provenance["overrides"] == [] and "Run with overrides" not in render(plain)
    saved = agg.to_json()
    saved["provenance"] = {k: v for k, v in saved["provenance"].items() if k not in ("baseline_bindings", "overrides")}
    old = StudyAggregate.from_json(saved)
    assert "overrides" not in old.provenance and "Run with overrides" not in render(old)


def test_underpowered_when_few_seeds(write_study, tmp_path):
    study = load_study(write_study(STUDY), ["study.seeds = 2"])
    specs = expand(study, tmp_path / "r")
    for spec in specs:
        acc = {"baseline": [0.50, 0.56], "good": [0.53, 0.59]}.get(spec.variant, [0.5, 0.5])[spec.seed]
        fake_run(spec, acc, diverged=spec.variant == "broken")
    agg = write_report(study, tmp_path / "r" / "synthetic", specs).to_json()
    good = agg["variants"]["good"]
    assert good["verdict"] == "no detectable difference" and good["underpowered"]
    assert good["comparison"]["seeds_needed"] > 2
    assert "underpowered" in (tmp_path / "r" / "synthetic" / "report.md").read_text()


def test_band_aligns_steps_across_seeds():
    steps, mean, std = band([(np.array([0, 5]), np.array([1.0, 3.0])),
                             (np.array([0, 2, 5]), np.array([3.0, 7.0, 5.0]))])
    assert steps.tolist() == [0, 2, 5]
    assert mean.tolist() == [2.0, 7.0, 4.0]
    # ddof = 1, as the tables: seeds are a sample. A step one seed logged has no band.
    assert std[[0, 2]].tolist() == pytest.approx([np.std([1.0, 3.0], ddof=1), np.std([3.0, 5.0], ddof=1)])
    assert np.isnan(std[1])


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
    from experiments.results import StudyAggregate
    from experiments.summary import render_summary
    assert StudyAggregate.from_json(agg.to_json()) == agg
    text = render_summary([(study, agg)], tmp_path / "results")
    assert "eval/rm_score" in text and ("At the warm start (each first-round baseline seed's evaluation before "
                                        "training): eval/accuracy = 0.3000; eval/rm_score = 0.5000") in text


def test_a_side_metric_that_is_not_a_number_is_missing_not_nan(write_study, tmp_path):
    """A NaN or inf side metric is no value: left out of its summary, and the report and the tuning
    summary print the mean of the others and how many seeds had none, never 'nan +- –'."""
    study = load_study(write_study(STUDY), ["study.variants = {'good': 'ppo.kl_coef = 0.1'}"])
    specs = expand(study, tmp_path / "results")
    rm = {"baseline": [math.nan] * 4, "good": [2.0, math.nan, 2.2, math.inf]}
    for spec in specs:
        fake_run(spec, ACCURACY[spec.variant][spec.seed])
        summary = Path(spec.run_dir) / "summary.json"
        data = json.loads(summary.read_text())
        data["final"]["eval/rm_score"] = rm[spec.variant][spec.seed]
        data["initial"]["eval/rm_score"] = math.nan if spec.seed == 0 else 0.5
        summary.write_text(json.dumps(data))  # another writer's bare NaN and Infinity tokens
    agg = write_report(study, tmp_path / "results" / "synthetic", specs)
    good, base = agg.variant("good").beside["eval/rm_score"], agg.variant("baseline").beside["eval/rm_score"]
    assert good.n == 2 and good.mean == pytest.approx(2.1) and good.std == pytest.approx(0.1414, abs=1e-4)
    assert base.n == 0 and base.mean is None
    report = (tmp_path / "results" / "synthetic" / "report.md").read_text()
    assert "| good | 2.1 +- 0.1414 (2 of 4 missing) |" in report and "| baseline | – (4 of 4 missing) |" in report
    assert "nan +-" not in report and "inf +-" not in report
    from experiments.summary import render_summary
    text = render_summary([(study, agg)], tmp_path / "results")
    assert "eval/rm_score = 2.1 +- 0.1414 (2 of 4 missing)" in text  # the final choice
    assert "eval/rm_score = 0.5000 (1 of 4 missing)" in text  # the warm start
    assert "| – (4 of 4 missing) |" in text and "nan +-" not in text


def checkpointed_run(run_dir: Path, gold: dict, checkpoints, damaged=()) -> None:
    """Eval rows of gold accuracy {step: value} in a run dir's metrics.jsonl, and checkpoints/step_N
    for the given steps (those in `damaged` truncated after their manifest was written)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip().endswith("}")]
    for row in rows:
        row.pop("eval/accuracy", None)
        if row["step"] in gold:
            row["eval/accuracy"] = gold[row["step"]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step in checkpoints:
        ckpt = fake_checkpoint(run_dir / "checkpoints" / f"step_{step}", content=b"weights-of-a-step")
        if step in damaged:
            (ckpt / "actor" / "model.safetensors").write_bytes(b"cut")


def test_best_gold_checkpoint_of_a_run(tmp_path):
    from experiments.run_records import best_checkpoint

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.1}) + "\n"
                                                   for s in range(6)))
    assert best_checkpoint(run_dir) is None  # no checkpoint, no eval
    # Step 3 scored best but kept no checkpoint; step 4's checkpoint is damaged; step 0 is the warm start.
    checkpointed_run(run_dir, {0: 0.9, 1: 0.40, 2: 0.55, 3: 0.80, 4: 0.70, 5: 0.50}, checkpoints=(2, 4, 5),
                     damaged=(4,))
    assert best_checkpoint(run_dir) == (2, 0.55)
    checkpointed_run(run_dir, {2: 0.55, 5: 0.55}, checkpoints=())
    assert best_checkpoint(run_dir) == (2, 0.55)  # a tie: the earliest
    checkpointed_run(run_dir, {2: float("nan"), 5: 0.55}, checkpoints=())
    assert best_checkpoint(run_dir) == (5, 0.55)  # a NaN is no score
    assert best_checkpoint(run_dir, "eval/rm_score") is None


def test_report_points_to_the_checkpoint_with_the_best_gold(study_dir):
    study, specs, out = study_dir
    for spec in specs:
        if spec.variant == "broken":
            continue
        final = ACCURACY[spec.variant][spec.seed]
        peak = final + 0.1 if (spec.variant, spec.seed) == ("same", 2) else final  # step 3 beat the last step
        checkpointed_run(Path(spec.run_dir), {0: 0.3, 3: peak, 5: final}, checkpoints=(3, 5))
    agg = write_report(study, out, specs)
    record = agg.best_checkpoints
    assert record.metric == "eval/accuracy" and len(record.runs) == 16
    runs = {(c.variant, c.seed): c for c in record.runs}
    assert (runs["same", 2].step, runs["same", 2].value) == (3, pytest.approx(0.63))
    assert (runs["good", 1].step, runs["good", 1].path) == (3, "runs/good/seed1/checkpoints/step_3")  # a tie: earliest
    assert (record.best.variant, record.best.seed, record.best.value) == ("hot", 1, pytest.approx(0.82))
    saved = json.loads((out / "aggregate.json").read_text())
    assert saved["best_checkpoints"]["best"] == {"variant": "hot", "seed": 1, "step": 3, "value": 0.82,
                                                 "path": "runs/hot/seed1/checkpoints/step_3"}
    report = (out / "report.md").read_text()
    assert "## Best checkpoint by gold (eval/accuracy)" in report
    assert ("Best of the study: `runs/hot/seed1/checkpoints/step_3` (hot, seed 1, step 3): "
            "eval/accuracy = 0.82") in report
    assert "| same | 2 | 3 | 0.63 | `runs/same/seed2/checkpoints/step_3` |" in report
    from experiments.results import StudyAggregate
    from experiments.summary import render_summary
    summary = render_summary([(study, agg)], out.parent)
    where = f"{out}/runs/hot/seed1/checkpoints/step_3` (hot, seed 1, step 3)"  # a path that exists
    assert (out / "runs/hot/seed1/checkpoints/step_3").is_dir()
    assert f"Best gold checkpoint of synthetic (on the eval split that made the decisions): `{where}" in summary
    assert f"Best single checkpoint on the eval split: `{where}" in summary
    # A study without an evaluated checkpoint has no best one, and its report says nothing of it.
    saved["best_checkpoints"] = None
    old = StudyAggregate.from_json(saved)
    assert old.best_checkpoints is None and "Best checkpoint" not in render(old)
    assert "Best gold checkpoint" not in render_summary([(study, old)], out.parent)
    assert "Best single checkpoint" not in render_summary([(study, old)], out.parent)


def test_report_says_when_the_runs_on_disk_are_stale_as_status_does(write_study, tmp_path, capsys):
    """`report -b 'ppo.total_steps = 3'` after 5-step runs: `status` with the same -b calls them stale,
    and `report` reports them as they ran with a notice saying so, never silently."""
    from experiments.cli import main
    from experiments.launch import write_plan
    path, results = write_study(STUDY), tmp_path / "results"
    study = load_study(path)
    specs = expand(study, results)
    for spec in specs:
        if spec.variant == "broken":
            fake_run(spec, 0.0, diverged=True)
        else:
            fake_run(spec, ACCURACY[spec.variant][spec.seed],
                     kl=0.9 if spec.variant == "hot" and spec.seed == 2 else 0.05)
    write_plan(results / "synthetic", study, specs, None)  # what `run` records at launch
    argv = ["report", str(path), "--results", str(results)]
    assert main(argv) == 0
    assert "notice" not in capsys.readouterr().out  # the runs are what the study gives now

    changed = ["-b", "ppo.total_steps = 3"]
    assert main(["status", str(path), "--results", str(results), *changed]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "20 stale"
    assert main(argv + changed) == 0
    out = capsys.readouterr().out
    notices = [line for line in out.splitlines() if line.startswith("notice:")]
    assert notices == [f"notice: 20 of 20 runs on disk ran with another configuration than {path} with these -b "
                       f"bindings gives now (stale in `status`: config, code, data or start changed); this report is "
                       f"of the runs as last launched; `python -m experiments run {path} -b 'ppo.total_steps = 3' "
                       f"--results {results}` would rerun them"]
    assert json.loads((results / "synthetic" / "aggregate.json").read_text())["decision"]["chosen"] == "good"
    # A study-level binding changes no run: nothing is stale.
    assert main(argv + ["-b", "study.alpha = 0.1"]) == 0 and "notice" not in capsys.readouterr().out

"""A study's results hold exactly its current plan's runs: after `run`, runs of variants or seeds
the plan no longer has (and the ones moved aside when their hash changed) are removed, never a
run of the plan, and never while another manager holds the study's lock."""

from pathlib import Path

from experiments.cli import main
from experiments.launch import StudyLock, prune_superseded
from experiments.plan import expand
from experiments.run_records import supersede
from experiments.study import load_study
from tests.experiments.conftest import fake_run

PLAN = """
study.name = 'pr'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 5']
study.variants = VARIANTS
study.seeds = 2
"""


def run_dirs(study_dir: Path) -> set:
    return {str(p) for p in study_dir.glob("runs/*/seed*")}


def test_a_rerun_after_a_change_keeps_exactly_the_new_plans_runs(write_study, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    results, study_dir = tmp_path / "results", (tmp_path / "results" / "pr").resolve()
    old = expand(load_study(write_study(PLAN.replace("VARIANTS", "{'kl': 'ppo.kl_coef = 0.1', "
                                                                 "'clip': 'ppo.clip_range = 0.1'}"), "a.gin")), results)
    for spec in old:  # plan A has run
        fake_run(spec, 0.5 + 0.01 * spec.seed)
    path = write_study(PLAN.replace("VARIANTS", "{'kl': 'ppo.kl_coef = 0.2'}"), "b.gin")
    new = expand(load_study(path), results)
    for spec in new:  # plan B: its changed variant ran again (the old run moved aside, as `run` does)
        if spec.variant == "kl":
            assert supersede(spec.run_dir) is not None
            fake_run(spec, 0.6 + 0.01 * spec.seed)
    assert len(run_dirs(study_dir)) == 6 and len(list((study_dir / "superseded").iterdir())) == 2
    records = {s.run_dir: (Path(s.run_dir) / "run.json").read_text() for s in new}

    with StudyLock(study_dir):  # another manager is running the study: nothing is removed
        assert prune_superseded(study_dir, new) is None
    assert len(run_dirs(study_dir)) == 6 and (study_dir / "superseded").is_dir()

    assert main(["run", str(path), "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert "0 completed, 4 already done" in out and "removed 4 superseded runs" in out
    assert run_dirs(study_dir) == {s.run_dir for s in new}
    assert not (study_dir / "superseded").exists() and not (study_dir / "runs" / "clip").exists()
    assert {s.run_dir: (Path(s.run_dir) / "run.json").read_text() for s in new} == records  # none ran again

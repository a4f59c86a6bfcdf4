"""A run whose final metric is NaN fails alone: every stage after it reads the aggregate the manager
wrote (a missing value is null there and '–' in report.md), and a file that is not an aggregate is
refused naming the field; `summary` refuses a held-out record it cannot use in one line."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.launch import write_plan
from experiments.plan import expand
from experiments.report import write_report
from experiments.results import StudyAggregate
from experiments.study import load_study
from tests.conftest import REPO
from tests.experiments.conftest import fake_run
from tests.experiments.test_advise_recipe import CONFIG_GIN
from tests.experiments.test_report import checkpointed_run

STUDY = """
study.name = 'nanround'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 5']
study.variants = {'good': 'ppo.kl_coef = 0.1'}
study.seeds = 3
"""
NAN_RUN = ("good", 1)


def experiments(*argv, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture
def nan_round(write_study, tmp_path):
    """A finished round (as `run` leaves it) where one run's eval/accuracy went NaN at every step."""
    path = write_study(STUDY)
    study = load_study(path)
    specs = expand(study, tmp_path / "results")
    for i, spec in enumerate(specs):
        nan = (spec.variant, spec.seed) == NAN_RUN
        acc = float("nan") if nan else 0.5 + 0.01 * i
        fake_run(spec, acc)
        checkpointed_run(Path(spec.run_dir), {0: 0.3, 3: acc, 5: acc}, checkpoints=(3, 5))
        (Path(spec.run_dir) / "config.gin").write_text(CONFIG_GIN)  # the operative config advise reads
    out = tmp_path / "results" / "nanround"
    write_plan(out, study, specs, None)
    write_report(study, out, specs)
    return path, out


def test_a_nan_run_fails_alone_and_every_stage_reads_the_round(nan_round, tmp_path):
    path, out = nan_round
    saved = json.loads((out / "aggregate.json").read_text())
    runs = {r["seed"]: r for r in saved["variants"]["good"]["runs"]}
    assert runs[1]["status"] == "failed" and runs[1]["value"] is None
    assert len(saved["best_checkpoints"]["runs"]) == 5  # the NaN run has no best checkpoint
    for argv in (["report", path, "--results", tmp_path / "results"],
                 ["export", path, "--results", tmp_path / "results", "--out", tmp_path / "reports"],
                 ["summary", path, "--results", tmp_path / "results", "--out", tmp_path / "reports" / "summary.md"],
                 ["advise", out, "--out", tmp_path / "my_round2.gin"]):
        done = experiments(*argv, cwd=tmp_path)
        assert "not a study aggregate" not in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)
        assert done.returncode in (0, 1), (argv, done.stderr)  # 1: a failed run, said, not a refusal
    report = (out / "report.md").read_text()
    assert not re.search(r"\bnan\b", report, re.IGNORECASE) and "| good | 1 | failed | – |" in report
    # status counts a finished run's steps as its updates (step 0 is the initial evaluation).
    done = experiments("status", path, "--results", tmp_path / "results", cwd=tmp_path)
    assert done.stdout.count("5/5") == 6 and "6/5" not in done.stdout, done.stdout
    # advise names the next study after the file it writes.
    assert "study.name = 'my_round2'" in (tmp_path / "my_round2.gin").read_text()


def test_a_missing_checkpoint_value_is_null_and_shown_missing(nan_round):
    """An aggregate whose best-checkpoint table holds null for a value (NaN written by the strict
    writer) loads, and its report shows the value as missing, never 'nan'."""
    from experiments.report import render
    _, out = nan_round
    saved = json.loads((out / "aggregate.json").read_text())
    saved["best_checkpoints"]["runs"][3]["value"] = None
    agg = StudyAggregate.from_json(saved)
    assert agg.best_checkpoints.runs[3].value is None
    row = next(line for line in render(agg).splitlines() if agg.best_checkpoints.runs[3].path in line)
    assert "| – |" in row and "nan" not in row


def test_a_bad_aggregate_names_the_field(nan_round, tmp_path):
    path, out = nan_round
    saved = json.loads((out / "aggregate.json").read_text())
    saved["best_checkpoints"]["runs"][3]["value"] = "high"
    (out / "aggregate.json").write_text(json.dumps(saved))
    done = experiments("export", path, "--results", tmp_path / "results", "--out", tmp_path / "reports", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "not a study aggregate (best_checkpoints.runs[3].value: Input should be a valid number" in done.stderr


@pytest.mark.parametrize("record, match", [
    ("[]", "not a record of the `heldout` stage (a JSON object with 'studies' and 'final_choice'; it holds a list)"),
    ('{"studies": ["round1", "round2"], "final_choice": {}}',
     "is a record of the studies ['round1', 'round2'], not of these rounds ['nanround']"),
    ('{"studies": ["nanround"], "final_choice": {"summary": {"accuracy": {"mean": NaN}}}}',
     "not a record of the `heldout` stage (it holds a bare NaN; `heldout` writes a missing value as null)"),
])
def test_summary_refuses_a_heldout_record_it_cannot_use(nan_round, tmp_path, record, match):
    path, _ = nan_round
    held = tmp_path / "heldout.json"
    held.write_text(record)
    done = experiments("summary", path, "--results", tmp_path / "results", "--heldout", held,
                       "--out", tmp_path / "summary.md", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and match in done.stderr, done.stderr
    assert f"--heldout '{held}'" in done.stderr and not (tmp_path / "summary.md").exists()

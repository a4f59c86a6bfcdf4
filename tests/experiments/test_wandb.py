"""W&B: the offline files of two real studies, rounds of one campaign, read back: one project,
one W&B run per run configuration (its run hash) recording what made it, runs grouped by study and
variant, each aggregate its own run with its table, summary and Artifact version; a rerun that
changes nothing logs nothing; WANDB_PROJECT is honoured; the whole W&B tree has one folder per run
id (what `wandb sync` needs); a resumed offline run replaces its folder; a temporary DVC experiment
keeps its W&B files; W&B failures never reach a run."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments.plan import git_commit
from experiments.results import StudyAggregate
from experiments.wandb_sink import (
    AGGREGATE_COLUMNS,
    RunDirStreamer,
    WandbRun,
    aggregate_state_path,
    job_type_for,
    log_aggregate_dir,
    offline_folders,
)
from tests.conftest import REPO
from tests.experiments.test_wandb_report import finished  # noqa: F401 - a study dir of fake runs, reported
from tests.experiments.wandb_offline import find_runs, read_run

ROUND1 = """
study.name = 'wb'
study.campaign = 'wb-campaign'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 3', 'ppo.eval_every = 3', 'ppo.save_every = 3',
                           'ppo.final_window = 2', 'task.eval_size = 16']
study.variants = {'clip_up': 'ppo.clip_range = 0.3'}
study.seeds = 2
"""

ROUND2 = """
study.name = 'wb2'
study.campaign = 'wb-campaign'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 2', 'ppo.eval_every = 2', 'ppo.save_every = 2',
                           'ppo.final_window = 2', 'task.eval_size = 16']
study.variants = {}
study.seeds = 1
study.resume_from = '{results}/wb'
study.resume_variant = 'baseline'
"""
CAMPAIGN = "wb-campaign"


def run_study(path: Path, results: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", "run", str(path), "--results", str(results), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _aggregate_files(wandb_dir: Path) -> list:
    return sorted(p for p in find_runs(wandb_dir) if "-aggregate" in p.name)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """Round 1 (two variants x two seeds), round 2 resuming it, then round 1 again as it is (nothing
    to run or send), then round 1 again with WANDB_PROJECT set, then round 1 with a third seed: the
    W&B files after each."""
    root = tmp_path_factory.mktemp("wb")
    results = root / "results"
    (root / "wb.gin").write_text(textwrap.dedent(ROUND1))
    (root / "wb2.gin").write_text(textwrap.dedent(ROUND2).replace("{results}", str(results)))
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(root / "wandb"))
    env.pop("WANDB_PROJECT", None)
    out = {"root": root, "results": results, "commit": git_commit()}
    for name, path, extra, args in (("round1", "wb.gin", {}, ()), ("round2", "wb2.gin", {}, ()),
                                    ("rerun", "wb.gin", {}, ()), ("env", "wb.gin", {"WANDB_PROJECT": "from-env"}, ()),
                                    ("seed", "wb.gin", {}, ("-b", "study.seeds = 3"))):
        proc = run_study(root / path, results, {**env, **extra}, *args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        # What each step left: later steps rewrite round 1's aggregate.json and the W&B state.
        aggregate = root / f"aggregate-{name}.json"
        shutil.copyfile(results / "wb" / "aggregate.json", aggregate)
        state = aggregate_state_path(root / "wandb", CAMPAIGN, "wb")
        out[name] = {"stdout": proc.stdout, "aggregates": _aggregate_files(root / "wandb"),
                     "runs": find_runs(root / "wandb"), "aggregate": aggregate,
                     "state": json.loads(state.read_text()) if state.exists() else None}
    return out


@pytest.mark.slow
def test_offline_runs_read_back(campaign):
    runs = [read_run(p) for p in campaign["round1"]["runs"]]
    per_run = [r for r in runs if r["job_type"] != "aggregate"]
    assert len(per_run) == 4 and all(r["project"] == CAMPAIGN for r in runs)
    assert {r["group"] for r in per_run} == {"wb/baseline", "wb/clip_up"}
    assert {r["job_type"] for r in per_run} == {"baseline", "ppo.clip_range=0.3"}
    for r in per_run:
        clip = 0.3 if r["group"] == "wb/clip_up" else 0.2
        # The operative config nested by gin scope: W&B's panels address it as ppo.clip_range.
        assert r["config"]["ppo"]["clip_range"] == clip and r["config"]["seed"] in (0, 1)
        assert r["config"]["study"] == "wb" and r["config"]["variant"] == r["group"].split("/")[1]
        assert r["config"]["provenance"]["data_sha256"] and r["tags"] == ["wb", r["config"]["variant"]]
        # What made it: no DVC experiment here, and this checkout's commit.
        assert r["config"]["revision"] == {"dvc_experiment": None, "git_commit": campaign["commit"]}
        assert r["id"] == f"wb-{r['config']['run_hash'][:12]}"
        steps = [row["_step"] for row in r["history"]]
        assert steps == [0, 1, 2, 3]  # step 0 (initial evaluation) and 3 PPO steps
        assert "reward_mean" in r["history"][1] and "policy_ratio_hist/_type" in r["history"][1]
        assert r["summary"]["status"] == "completed" and "final.eval/accuracy" in r["summary"]
    (aggregate,) = [r for r in runs if r["job_type"] == "aggregate"]
    assert aggregate["group"] == "wb" and aggregate["id"].startswith("wb-aggregate-")
    assert aggregate["tags"] == ["wb", "aggregate"]
    assert aggregate["config"]["revision"]["git_commit"] == campaign["commit"]
    (aggregate_file,) = campaign["round1"]["aggregates"]  # round 1's own aggregate run: its table, not round 2's
    (table_file,) = aggregate_file.parent.rglob("variants_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == AGGREGATE_COLUMNS
    assert sorted(row[0] for row in table["data"]) == ["baseline", "clip_up"]
    assert all(row[2] == 2 for row in table["data"])
    assert any(k.startswith("plots/") for k in aggregate["summary"])


@pytest.mark.slow
def test_a_campaign_is_one_wandb_project(campaign):
    """Both rounds in the campaign's project, each study's runs in their own groups."""
    runs = [read_run(p) for p in campaign["round2"]["runs"]]
    assert {r["project"] for r in runs} == {CAMPAIGN}
    assert sorted((r["group"], r["job_type"]) for r in runs) == [
        ("wb", "aggregate"), ("wb/baseline", "baseline"), ("wb/baseline", "baseline"),
        ("wb/clip_up", "ppo.clip_range=0.3"), ("wb/clip_up", "ppo.clip_range=0.3"),
        ("wb2", "aggregate"), ("wb2/baseline", "baseline")]
    (round2,) = [r for r in runs if r["group"] == "wb2/baseline"]
    assert round2["config"]["study"] == "wb2" and round2["config"]["provenance"]["start_checkpoint_sha256"]


@pytest.mark.slow
def test_the_aggregate_summary_holds_each_variants_statistics(campaign):
    """The aggregate run's summary: the table's values per variant, std and 95% CI included."""
    aggregate = StudyAggregate.load(campaign["round1"]["aggregate"])
    (run,) = [read_run(p) for p in campaign["round1"]["aggregates"]]
    summary = run["summary"]
    assert summary["chosen"] == aggregate.decision.chosen and summary["metric"] == "final.eval/accuracy"
    for name, v in aggregate.variants.items():
        s = v.summary
        assert s.n == 2 and s.std is not None and s.ci95[0] is not None
        assert [summary[f"{name}.{k}"] for k in ("n", "mean", "std", "se", "ci95_low", "ci95_high")] == pytest.approx(
            [s.n, s.mean, s.std, s.se, s.ci95[0], s.ci95[1]])
    assert summary["clip_up.verdict"] == aggregate.variants["clip_up"].verdict
    assert "clip_up.difference_ci95_low" in summary and "clip_up.p_value_holm" in summary
    assert [row["_step"] for row in run["history"]] == [0]


@pytest.mark.slow
def test_a_rerun_that_changes_nothing_logs_nothing(campaign):
    """Round 1 again, as it is: no run to run, and no new W&B file, not even the aggregate's."""
    assert "0 completed, 4 already done, 0 failed" in campaign["rerun"]["stdout"]
    assert campaign["rerun"]["runs"] == campaign["round2"]["runs"]
    assert campaign["rerun"]["aggregates"] == campaign["round2"]["aggregates"]
    state = campaign["rerun"]["state"]
    (aggregate,) = [read_run(p) for p in campaign["round1"]["aggregates"]]
    assert state == {**campaign["round1"]["state"], "run_id": aggregate["id"], "mode": "offline"}


@pytest.mark.slow
def test_wandb_project_from_the_environment(campaign):
    """WANDB_PROJECT wins over the campaign: round 1's aggregate (its runs all done) goes there."""
    new = sorted(set(campaign["env"]["runs"]) - set(campaign["rerun"]["runs"]))
    (run,) = [read_run(p) for p in new]
    assert (run["project"], run["job_type"]) == ("from-env", "aggregate") and run["id"].startswith("wb-aggregate-")
    assert [row["_step"] for row in run["history"]] == [0]


@pytest.mark.slow
def test_a_results_tree_syncs_as_one_run_per_id(campaign):
    """What `wandb sync` of the whole W&B directory would upload after every launch above: no two
    offline folders share an id (sync would keep only one of them), each run configuration (run
    hash) is exactly one run, and each aggregate sent is its own run holding its Artifact version."""
    runs = [read_run(p) for p in campaign["seed"]["runs"]]
    ids = [r["id"] for r in runs]
    assert len(ids) == len(set(ids)) == len({Path(r["path"]).parent for r in runs})
    per_run = [r for r in runs if r["job_type"] != "aggregate"]
    assert len(per_run) == 6 + 1  # round 1: 2 variants x 3 seeds (the third added last); round 2: 1
    assert len({r["config"]["run_hash"] for r in per_run}) == len(per_run)
    assert sorted((r["config"]["variant"], r["config"]["seed"]) for r in per_run if r["config"]["study"] == "wb") == [
        ("baseline", 0), ("baseline", 1), ("baseline", 2), ("clip_up", 0), ("clip_up", 1), ("clip_up", 2)]
    aggregates = [r for r in runs if r["job_type"] == "aggregate"]
    # round 1's three contents (two seeds; the same in another project; three seeds) and round 2's
    assert sorted((r["project"], r["config"]["study"]) for r in aggregates) == [
        ("from-env", "wb"), (CAMPAIGN, "wb"), (CAMPAIGN, "wb"), (CAMPAIGN, "wb2")]
    for r in aggregates:
        (artifact,) = [a for a in r["artifacts"] if a["type"] == "aggregate"]
        assert artifact["name"] == f"{r['config']['study']}-aggregate"
        assert sorted(artifact["files"]) == ["aggregate.json", "report.md"]
        assert all(Path(f).is_relative_to(Path(r["path"]).parent) for f in artifact["files"].values())
    (latest,) = [r for r in aggregates if r["id"] == campaign["seed"]["state"]["run_id"]]
    (artifact,) = [a for a in latest["artifacts"] if a["type"] == "aggregate"]
    assert Path(artifact["files"]["aggregate.json"]).read_bytes() == campaign["seed"]["aggregate"].read_bytes()
    assert campaign["seed"]["aggregate"].read_bytes() != campaign["round1"]["aggregate"].read_bytes()


def _fake_run_dir(path: Path, steps: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n")


def _read_back(wandb_dir, timeout_s: float = 20.0) -> list:
    """The offline run files, once each holds its run record: W&B's service may still be writing
    them for a moment after finish() returns on a loaded machine."""
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [read_run(p) for p in find_runs(wandb_dir)]
        if (runs and all("id" in r for r in runs)) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def test_a_resumed_offline_run_replaces_its_folder_with_the_whole_history(tmp_path, monkeypatch):
    """Killed after 3 steps, resumed to 6: one offline folder of the id, holding steps 0..5, since
    `wandb sync` would upload a second folder of the id in place of the first."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    _fake_run_dir(run_dir, 3)

    def start():
        return WandbRun(project="p", group="s/v", job_type="baseline", name="v-seed0", run_id="s-abc", config={},
                        directory=str(tmp_path / "wandb"))

    first = RunDirStreamer(run_dir, start())
    assert first.poll() == 3
    first.wandb_run.finish(exit_code=1)  # killed here
    (other := tmp_path / "wandb" / "wandb" / "offline-run-20260101_000000-x-s-abc").mkdir()  # another id's folder
    assert len(offline_folders(tmp_path / "wandb", "s-abc")) == 1
    _fake_run_dir(run_dir, 6)  # the resumed engine rewrote its metrics up to step 5
    second = RunDirStreamer(run_dir, start())
    assert second.last_step == -1  # offline: sent again from the start
    second.close(exit_code=0)
    (run,) = [r for r in _read_back(tmp_path / "wandb") if r["id"] == "s-abc"]
    assert [row["_step"] for row in run["history"]] == [0, 1, 2, 3, 4, 5]
    assert len(offline_folders(tmp_path / "wandb", "s-abc")) == 1 and other.is_dir()


def test_wandb_failure_never_reaches_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where W&B wants its directory")
    run_dir = tmp_path / "run"
    _fake_run_dir(run_dir, 2)
    streamer = RunDirStreamer(run_dir, WandbRun(project="p", group="g", job_type="baseline", name="n",
                                                 run_id="r1", config={}, directory=str(blocker / "wandb")))
    assert streamer.poll() == 0
    streamer.close(exit_code=0)  # no exception
    assert not streamer.wandb_run.active


def test_disabled_mode_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = WandbRun(project="p", group="g", job_type="j", name="n", run_id="r2", config={}, directory=str(tmp_path))
    assert not run.active
    assert not list(tmp_path.rglob("*.wandb"))


def test_job_type_names_the_change():
    assert job_type_for({}) == "baseline"
    assert job_type_for({"ppo.kl_coef": 0.1}) == "ppo.kl_coef=0.1"


def test_each_aggregate_is_its_own_run_and_artifact_version(finished, monkeypatch):  # noqa: F811
    """The aggregate of a study, sent again: unchanged, nothing is opened; changed (here another set
    of runs), another W&B run with its own id and a version of the study's aggregate Artifact;
    the first content again replaces its own folder. No two folders share an id."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = finished[2]
    wandb_dir = out.parent / "wandb"
    (out / "report.md").write_text("# the report")
    assert log_aggregate_dir(out, "p", ["run-a", "run-b"], files=[out / "report.md"])
    assert not log_aggregate_dir(out, "p", ["run-b", "run-a"], files=[out / "report.md"])
    assert len(find_runs(wandb_dir)) == 1
    assert log_aggregate_dir(out, "p", ["run-a", "run-c"], files=[out / "report.md"])
    assert log_aggregate_dir(out, "p", ["run-a", "run-b"], files=[out / "report.md"])
    runs = _read_back(wandb_dir)
    assert len(runs) == 2 and len({r["id"] for r in runs}) == 2
    assert {r["project"] for r in runs} == {"p"} and all(r["id"].startswith("synthetic-aggregate-") for r in runs)
    state = json.loads(aggregate_state_path(wandb_dir, "p", "synthetic").read_text())
    assert state["run_id"] in {r["id"] for r in runs}
    for r in runs:
        assert [row["_step"] for row in r["history"]] == [0]
        assert r["config"]["aggregate_sha256"] == hashlib.sha256((out / "aggregate.json").read_bytes()).hexdigest()
        assert r["summary"]["good.ci95_high"] > r["summary"]["good.mean"] > r["summary"]["good.ci95_low"]
        (artifact,) = [a for a in r["artifacts"] if a["type"] == "aggregate"]  # W&B's own: the table's
        assert artifact["name"] == "synthetic-aggregate"
        # The files the Artifact uploads lie in the run's own offline folder, as they were sent.
        folder = Path(r["path"]).parent
        assert sorted(artifact["files"]) == ["aggregate.json", "report.md"]
        assert all(Path(f).parent.parent == folder for f in artifact["files"].values())
        assert Path(artifact["files"]["report.md"]).read_text() == "# the report"


STAGE = """
from experiments.wandb_sink import WandbRun, files_dir, revision

WandbRun(project="p", group="g", job_type="j", name="n", run_id="made-in-a-copy", config={"revision": revision()},
         directory=files_dir("results")).finish()
open("out.txt", "w").write("done")
"""


def test_a_temporary_dvc_experiment_keeps_its_wandb_files(tmp_path):
    """`dvc exp run --temp` (queued experiments run the same way) runs the stage in a copy of the
    repository that DVC deletes afterwards: the W&B files go to the repository it was started from,
    and the run records the experiment and its baseline commit."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "stage.py").write_text(STAGE)
    (repo / "params.yaml").write_text("x: 1\n")
    (repo / "dvc.yaml").write_text("stages:\n  log:\n    cmd: python stage.py\n    deps: [stage.py]\n"
                                   "    params: [x]\n    outs: [out.txt]\n")
    (repo / ".gitignore").write_text("/results/\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DVC_")}
    env.update(PYTHONPATH=str(REPO), WANDB_MODE="offline")

    def call(*argv):
        proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{argv}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        return proc.stdout

    user = ["-c", "user.name=test", "-c", "user.email=test@localhost"]
    call("git", "init", "-q")
    call("git", "config", "user.name", "test")  # `dvc exp run` commits
    call("git", "config", "user.email", "test@localhost")
    call(sys.executable, "-m", "dvc", "init", "-q")
    call("git", *user, "add", "-A")
    call("git", *user, "commit", "-qm", "a pipeline")
    head = call("git", "rev-parse", "HEAD").strip()
    call(sys.executable, "-m", "dvc", "exp", "run", "--temp", "-n", "kl-up", "-S", "x=2")
    (run,) = [read_run(p) for p in find_runs(repo / "results" / "wandb")]
    assert run["id"] == "made-in-a-copy"
    assert run["config"]["revision"] == {"dvc_experiment": "kl-up", "git_commit": head}
    assert not (repo / "out.txt").exists()  # it did run in a copy, not in this workspace

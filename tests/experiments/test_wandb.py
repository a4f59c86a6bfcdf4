"""W&B: the offline files of a real study read back; a resumed run continues its W&B run; W&B
failures never reach a run."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.experiments.wandb_offline import find_runs, read_run
from experiments.wandb_sink import RunDirStreamer, WandbRun, job_type_for
from tests.conftest import REPO

STUDY = """
study.name = 'wb'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 3', 'ppo.eval_every = 3', 'ppo.save_every = 3',
                           'ppo.final_window = 2', 'task.eval_size = 16']
study.variants = {'clip_up': 'ppo.clip_range = 0.3'}
study.seeds = 2
study.wandb_project = 'wb-test'
"""


def run_study(path: Path, results: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", "run", str(path), "--results", str(results)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def offline_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("wb")
    (root / "wb.gin").write_text(textwrap.dedent(STUDY))
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(root / "wandb"))
    proc = run_study(root / "wb.gin", root / "results", env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


@pytest.mark.slow
def test_offline_runs_read_back(offline_study):
    runs = [read_run(p) for p in find_runs(offline_study / "wandb")]
    per_run = [r for r in runs if r["job_type"] != "aggregate"]
    assert len(per_run) == 4 and all(r["project"] == "wb-test" for r in runs)
    assert {r["group"] for r in per_run} == {"wb/baseline", "wb/clip_up"}
    assert {r["job_type"] for r in per_run} == {"baseline", "ppo.clip_range=0.3"}
    for r in per_run:
        clip = 0.3 if r["group"] == "wb/clip_up" else 0.2
        assert r["config"]["ppo.clip_range"] == clip and r["config"]["seed"] in (0, 1)
        assert r["config"]["provenance.data_sha256"]
        steps = [row["_step"] for row in r["history"]]
        assert steps == [0, 1, 2, 3]  # step 0 (initial evaluation) and 3 PPO steps
        assert "reward_mean" in r["history"][1] and "policy_ratio_hist/_type" in r["history"][1]
        assert r["summary"]["status"] == "completed" and "final.eval/accuracy" in r["summary"]
    (aggregate,) = [r for r in runs if r["job_type"] == "aggregate"]
    assert aggregate["group"] == "wb"
    table_files = [p for p in Path(offline_study / "wandb").rglob("variants_*.table.json")]
    table = json.loads(table_files[0].read_text())
    assert table["columns"][:4] == ["variant", "change", "n", "mean"]
    assert sorted(row[0] for row in table["data"]) == ["baseline", "clip_up"]
    assert all(row[2] == 2 for row in table["data"])
    assert any(k.startswith("plots/") for k in aggregate["summary"])


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


def test_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    _fake_run_dir(run_dir, 3)

    def start():
        return WandbRun(project="p", group="s/v", job_type="baseline", name="v-seed0", run_id="s-abc", config={},
                        directory=str(tmp_path / "wandb"))

    first = RunDirStreamer(run_dir, start())
    assert first.poll() == 3
    first.wandb_run.finish(exit_code=1)  # killed here
    _fake_run_dir(run_dir, 6)  # the resumed engine rewrote its metrics up to step 5
    second = RunDirStreamer(run_dir, start())
    assert second.last_step == 2
    second.close(exit_code=0)
    runs = _read_back(tmp_path / "wandb")
    assert {r["id"] for r in runs} == {"s-abc"}
    steps = sorted(row["_step"] for r in runs for row in r["history"])
    assert steps == [0, 1, 2, 3, 4, 5]


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

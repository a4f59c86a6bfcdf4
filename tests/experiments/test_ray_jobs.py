"""A study submitted to a cluster as a Ray job, as docs/scaling.md tells users to: `ray job submit
--working-dir . -- python -m experiments run STUDY --results URI`, against a `ray start --head` cluster
with its dashboard (the job server) and token authentication. Its runs are Ray tasks of the job, the job
ends, and the results are in the storage location asked for (a `file://` URI through pyarrow.fs). A job
stopped mid-study (`ray job stop`: the manager killed, its runs with it) loses no finished run, and the
job submitted again skips the finished run and resumes the interrupted one from its last checkpoint.

Beside it, without Ray: how a local copy syncs with a storage location (experiments/storage.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from experiments import storage
from tests.conftest import REPO
from tests.experiments.test_ray_cluster import RayNode, clean_env, free_port, ray_cli

SMOKE = "recipes/studies/smoke.gin"
BINDINGS = ["ppo.total_steps = 3", "ppo.eval_every = 3", "ppo.save_every = 1", "ppo.final_window = 2",
            "task.eval_size = 16", "study.variants = {'longer': 'ppo.total_steps = 40'}", "study.seeds = 1",
            "study.cpus_per_run = 1"]
"""A run of three steps and one of forty, a checkpoint each step; one CPU on the cluster runs them one
after the other, and the longer one is far from its end when its first checkpoint reaches the location
(with fifteen steps, a loaded machine's `ray job stop` could land after it had finished)."""


class JobCluster:
    """A head node of 1 CPU with its dashboard (Ray's job server) and token authentication."""

    def __init__(self, root: Path):
        self.root = root
        (root / "token").write_text(os.urandom(32).hex())
        self.env = clean_env(RAY_AUTH_TOKEN_PATH=str(root / "token"))
        self.dashboard = free_port()
        self.port = free_port()
        self.head = RayNode(["--head", "--port", str(self.port), "--num-cpus", "1", "--temp-dir", str(root / "head"),
                             "--include-dashboard", "true", "--dashboard-port", str(self.dashboard),
                             "--ray-client-server-port", str(free_port()),
                             "--dashboard-agent-listen-port", str(free_port())], self.env, root / "head.log")

    def job(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """`ray job ARGS` against the job server, as a user with the cluster's token runs it, from the repository."""
        return subprocess.run(ray_cli("job", *args[:1], "--address", f"http://127.0.0.1:{self.dashboard}", *args[1:]),
                              cwd=REPO, env={**self.env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                              timeout=timeout)

    def submit(self, job_id: str, results: str, wait: bool) -> subprocess.CompletedProcess:
        argv = ["submit", "--submission-id", job_id, "--working-dir", ".", *([] if wait else ["--no-wait"]), "--",
                "python", "-m", "experiments", "run", SMOKE, *[x for b in BINDINGS for x in ("-b", b)],
                "--results", results]
        return self.job(*argv)

    def status(self, job_id: str) -> str:
        proc = self.job("status", job_id, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def job_cluster():
    root = Path(tempfile.mkdtemp(prefix="rayj-"))  # short: Ray's socket paths must fit in 107 bytes
    made = JobCluster(root)
    try:
        made.head.wait_started()
        yield made
    finally:
        made.head.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store(workdir):
    """A storage location (a dir, given to the manager as a file:// URI); its local copy is removed afterwards."""
    path = workdir / "store"
    yield path
    shutil.rmtree(storage.staging_dir(path.as_uri()), ignore_errors=True)


def wait_for(what: str, check, timeout: float = 400):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)
    return found


def attempts(run_dir: Path) -> list:
    return json.loads((run_dir / "attempts.json").read_text())["attempts"]


@pytest.mark.slow
def test_a_study_as_a_ray_job_keeps_finished_runs_when_stopped_and_the_resubmitted_job_resumes(job_cluster, store):
    uri = store.as_uri()
    proc = job_cluster.submit("study-1", uri, wait=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {name: store / "smoke" / "runs" / name / "seed0" for name in ("baseline", "longer")}

    def one_done_one_checkpointed():  # what the storage location holds, as the runs push it
        done = [n for n, d in runs.items() if (d / "summary.json").exists()]
        begun = [n for n, d in runs.items() if n not in done and list(d.glob("checkpoints/step_*"))]
        return (done[0], begun[0]) if done and begun else None
    finished, interrupted = wait_for("a finished run and a checkpoint of the other", one_done_one_checkpointed)
    stopped = job_cluster.job("stop", "study-1", timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "Job 'study-1' was stopped" in job_cluster.status("study-1")  # `ray job stop` waits for it

    # Nothing finished was lost; the interrupted run left no summary, only checkpoints.
    assert json.loads((runs[finished] / "summary.json").read_text())["status"] == "completed"
    assert not (runs[interrupted] / "summary.json").exists()
    steps_before = len((runs[interrupted] / "metrics.jsonl").read_text().splitlines())

    again = job_cluster.submit("study-2", uri, wait=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Job 'study-2' succeeded" in job_cluster.status("study-2")
    assert "smoke: 1 completed, 1 already done, 0 failed" in again.stdout, again.stdout
    assert len(attempts(runs[finished])) == 1  # skipped, not run again
    last = attempts(runs[interrupted])[-1]
    assert last["resumed"] and last["exit_code"] == 0, last
    assert len((runs[interrupted] / "metrics.jsonl").read_text().splitlines()) >= steps_before
    assert json.loads((runs[interrupted] / "summary.json").read_text())["status"] == "completed"
    assert (store / "smoke" / "report.md").exists() and (store / "smoke" / "plan.json").exists()

    # The runs were tasks of the jobs, under their names; the records say where the results are.
    listed = subprocess.run(ray_cli("list", "tasks", "--address", f"127.0.0.1:{job_cluster.port}", "--format", "json",
                                    "--limit", "1000"), env={**job_cluster.env, "RAY_AUTH_MODE": "token"},
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-3000:]
    names = {t["name"] for t in json.loads(listed.stdout)}
    assert {"smoke:baseline/seed0", "smoke:longer/seed0"} <= names
    manager = json.loads((runs[interrupted] / "provenance.json").read_text())["manager"]
    assert manager["results_dir"] == uri and manager["results_uri"] == uri


def test_a_local_copy_syncs_with_a_storage_location(tmp_path):
    """Pull replaces the copy's files with the location's; push makes the location hold the copy's,
    removing what the copy removed, except W&B run files (other nodes add theirs); an unchanged file
    is not copied back and forth; local-only files (the lock, the marker) stay local."""
    location, copy = tmp_path / "location", tmp_path / "copy"
    (location / "s" / "runs" / "a").mkdir(parents=True)
    (location / "s" / "runs" / "a" / "metrics.jsonl").write_text("1\n")
    (location / "wandb" / "offline-run-x").mkdir(parents=True)
    (location / "wandb" / "offline-run-x" / "run.wandb").write_text("w")
    uri = location.as_uri()
    storage.pull(uri, copy)
    assert (copy / "s" / "runs" / "a" / "metrics.jsonl").read_text() == "1\n"

    shutil.rmtree(copy / "wandb")
    shutil.rmtree(copy / "s" / "runs" / "a")
    (copy / "s" / "runs" / "b").mkdir(parents=True)
    (copy / "s" / "runs" / "b" / "summary.json").write_text("{}")
    (copy / "s" / ".lock").write_text("")
    storage.push(copy, uri)
    assert not (location / "s" / "runs" / "a" / "metrics.jsonl").exists()  # removed here: removed there
    assert (location / "s" / "runs" / "b" / "summary.json").read_text() == "{}"
    assert (location / "wandb" / "offline-run-x" / "run.wandb").exists()  # W&B files only gain
    assert not (location / "s" / ".lock").exists()

    pushed = (location / "s" / "runs" / "b" / "summary.json").stat().st_mtime_ns
    storage.pull(uri, copy)
    storage.push(copy, uri)
    assert (location / "s" / "runs" / "b" / "summary.json").stat().st_mtime_ns == pushed  # not copied again
    assert (copy / "s" / ".lock").exists()


def test_a_results_location_pyarrow_cannot_reach_is_one_line_before_anything_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments", "status", SMOKE, "--results", "nosuch://bucket/r"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("error: --results 'nosuch://bucket/r': ") and "pyarrow.fs" in lines[0], lines[0]

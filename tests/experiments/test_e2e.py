"""End to end on the tiny default: the real engine, a real local Ray with 2 CPUs, the CLI.

Slow (minutes): each study runs real PPO runs. The SFT warm start is shared through the
repo's cache, so only the first run of a fresh checkout pays for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_cli(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def attempts(run_dir: Path) -> list:
    return json.loads((run_dir / "attempts.json").read_text())["attempts"]


def steps_logged(run_dir: Path) -> list:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_smoke_study_end_to_end_then_skip_then_only_new_runs(workdir):
    results = workdir / "results"
    out = run_cli("run", "recipes/studies/smoke.gin", "--results", str(results), "--num-cpus", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    study = results / "smoke"
    agg = json.loads((study / "aggregate.json").read_text())
    assert set(agg["variants"]) == {"baseline", "kl_coef_x2"}
    for name, v in agg["variants"].items():
        assert v["summary"]["n"] == 2 and [r["seed"] for r in v["runs"]] == [0, 1]
        assert all(0.0 <= r["value"] <= 1.0 for r in v["runs"])
    variant = agg["variants"]["kl_coef_x2"]
    assert variant["verdict"] in ("better", "worse", "no detectable difference")
    assert variant["comparison"]["p_value"] is None or 0 <= variant["comparison"]["p_value"] <= 1
    assert agg["decision"]["chosen"] in agg["variants"]
    report = (study / "report.md").read_text()
    assert "## Decision table" in report and "kl_coef_x2" in report and "## Provenance" in report
    for stem in ("reward_mean", "kl_divergence", "clip_fractions", "response_length_mean", "eval_accuracy"):
        assert (study / "plots" / f"{stem}.png").stat().st_size > 1000
    run_dir = study / "runs" / "kl_coef_x2" / "seed1"
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["manager"]["exit_status"] == 0 and prov["manager"]["variant"] == "kl_coef_x2"
    assert prov["manager"]["changes_from_baseline"] == {"ppo.kl_coef": 0.1}
    assert prov["manager"]["start_time"] and prov["manager"]["end_time"] and prov["manager"]["run_hash"]
    assert "run" in prov["manager"]["manager_command"]
    assert "versions" in prov and "git" in prov  # the engine's own fields are kept
    plan = {r["variant"] + str(r["seed"]): r for r in json.loads((study / "plan.json").read_text())["runs"]}
    assert prov["data_sha256"] == plan["kl_coef_x21"]["data_hash"]  # one data hash, the engine's
    assert prov["manager"]["engine_code"]["engine_sha256"] and "config_sha256_without_placement" in prov["manager"]
    from rlhf.metrics import is_known_metric
    logged = {k for line in (run_dir / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    assert {k for k in logged if k != "step" and not is_known_metric(k)} == set()  # rlhf/metrics.py names them all
    assert "ppo.kl_coef = 0.1" in (run_dir / "config.gin").read_text()

    # Rerun: every run is finished with the same hash, so nothing runs (and Ray is not started).
    t0 = time.monotonic()
    again = run_cli("run", "recipes/studies/smoke.gin", "--results", str(results), "--num-cpus", "2")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 completed, 4 already done" in again.stdout
    assert time.monotonic() - t0 < 60
    assert all(len(attempts(d)) == 1 for d in (study / "runs").glob("*/seed*"))

    # A third seed: only its two runs execute.
    more = run_cli("run", "recipes/studies/smoke.gin", "--results", str(results), "--num-cpus", "2",
                   "-b", "study.seeds = [0, 1, 2]")
    assert more.returncode == 0, more.stdout + more.stderr
    assert "2 completed, 4 already done" in more.stdout
    assert json.loads((study / "aggregate.json").read_text())["variants"]["baseline"]["summary"]["n"] == 3
    status = run_cli("status", "recipes/studies/smoke.gin", "--results", str(results), "-b", "study.seeds = [0, 1, 2]")
    assert status.returncode == 0 and status.stdout.count("completed") >= 6
    (study / "report.md").unlink()
    report = run_cli("report", "recipes/studies/smoke.gin", "--results", str(results))
    assert report.returncode == 0 and "decision:" in report.stdout and (study / "report.md").exists()


DIVERGING = """
study.name = 'diverge'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 6', 'ppo.eval_every = 6', 'ppo.save_every = 2', 'ppo.final_window = 2']
# A vanishing Adam epsilon divides by ~0: the losses become NaN within a few steps.
study.variants = {'tiny_adam_eps': 'ppo.adam_eps = 1e-300'}
study.seeds = 1
study.retries = 2
"""


def _engine_pid(run_dir: Path):
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rlhf.train" in cmd and str(run_dir).encode() in cmd:
            return int(proc.name)
    return None


def test_failures_are_recorded_retried_or_not_and_do_not_stop_others(workdir):
    """The variant diverges (exit 3: recorded, never retried); the baseline's engine is killed
    mid-run like an out-of-memory kill (recorded, retried, completes)."""
    path = workdir / "diverge.gin"
    path.write_text(textwrap.dedent(DIVERGING))
    results = workdir / "results"
    study = results / "diverge"
    base = study / "runs" / "baseline" / "seed0"
    proc = subprocess.Popen([sys.executable, "-m", "experiments", "run", str(path), "--results", str(results),
                             "--num-cpus", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not ((base / "metrics.jsonl").exists() and len(steps_logged(base)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        time.sleep(0.2)
    pid = _engine_pid(base)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, output  # some runs failed

    bad = study / "runs" / "tiny_adam_eps" / "seed0"
    tries = attempts(bad)
    assert len(tries) == 1, "a divergence is deterministic: never retried"
    assert tries[0]["exit_code"] == 3 and "diverged" in tries[0]["error"]
    assert json.loads((bad / "provenance.json").read_text())["manager"]["exit_status"] == 3

    tries = attempts(base)
    assert len(tries) == 2, tries
    assert tries[0]["exit_code"] == -signal.SIGKILL and "killed by SIGKILL" in tries[0]["error"]
    assert tries[1]["exit_code"] == 0 and tries[1]["attempt"] == 2
    assert steps_logged(base) == list(range(7))

    agg = json.loads((study / "aggregate.json").read_text())
    assert agg["variants"]["tiny_adam_eps"]["verdict"] == "failed"
    assert agg["variants"]["baseline"]["summary"]["n"] == 1
    assert agg["decision"]["chosen"] == "baseline"
    assert "diverged" in (study / "report.md").read_text()
    # Rerun: the same hash would diverge again, so it is reported, not rerun.
    again = run_cli("run", str(path), "--results", str(results), "--num-cpus", "2")
    assert again.returncode == 1 and len(attempts(bad)) == 1 and len(attempts(base)) == 2


def _alive(proc) -> bool:
    import psutil
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _completed(study: Path) -> list:
    out = []
    for d in sorted((study / "runs").glob("*/seed*")):
        s = d / "summary.json"
        if s.exists() and json.loads(s.read_text()).get("status") == "completed":
            out.append(d)
    return out


def _checkpoint_steps(run_dir: Path) -> list:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def _midway(study: Path, latest_at_most: int) -> list:
    """Unfinished runs whose latest checkpoint is at most `latest_at_most`: such a run still has
    several steps to go, so a stop that lands now cannot race with its completion."""
    done = set(_completed(study))
    return [d for d in (study / "runs").glob("*/seed*")
            if d not in done and _checkpoint_steps(d) and _checkpoint_steps(d)[-1] <= latest_at_most]


def _start(results: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "experiments", "run", "recipes/studies/smoke.gin", "--results",
                             str(results), "--num-cpus", "2", "-b", "ppo.total_steps = 16"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"study ended early: {proc.stdout.read()}"
        assert time.monotonic() < deadline, "timed out waiting for progress"
        time.sleep(0.5)


def _engines_writing_to(study: Path) -> list:
    """Engine processes still running with --out inside this study (there must be none)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rlhf.train" in cmd and any(str(study).encode() in part for part in cmd):
            found.append(proc.name)
    return found


def test_interrupt_and_kill_then_rerun_loses_nothing_and_repeats_nothing(workdir):
    results = workdir / "results"
    study = results / "smoke"

    # 1. Ctrl-C once a run has finished and another is early on with a checkpoint: a clean stop.
    proc = _start(results)
    _wait_for(lambda: len(_completed(study)) >= 1 and _midway(study, latest_at_most=4), proc)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=90)
    said = proc.stdout.read()
    assert code == 130, said
    finished_first = {d.name + d.parent.name for d in _completed(study)}
    assert not _engines_writing_to(study)
    # Unfinished runs with a checkpoint, as the stop left them: each must resume on the rerun.
    interrupted = {d: len(attempts(d)) for d in _midway(study, latest_at_most=16)}
    assert interrupted, ("the stop landed while a run was early on, so it must have left one unfinished; runs: "
                         + "; ".join(f"{d.parent.name}/{d.name} checkpoints {_checkpoint_steps(d)}"
                                     f"{' completed' if d in _completed(study) else ''}"
                                     for d in sorted((study / "runs").glob("*/seed*"))) + "\n" + said)

    # 2. Rerun, then SIGKILL the manager once a run has saved a checkpoint it did not have
    #    before and still has steps to go: an abrupt stop. (Every resumed run passes through
    #    that state; "once another run finished" could be missed by runs in lockstep.)
    saved_before = {d: _checkpoint_steps(d)[-1] for d in interrupted}
    proc = _start(results)
    _wait_for(lambda: any(_checkpoint_steps(d)[-1] > saved_before.get(d, 0)
                          for d in _midway(study, latest_at_most=12)), proc)
    import psutil
    ray_daemons = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "watchdog" not in " ".join(p.cmdline())]  # GCS, raylet, dashboard and runtime-env agents...
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while _engines_writing_to(study) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _engines_writing_to(study), "an engine outlived its killed manager"
    deadline = time.monotonic() + 30
    lingering = ray_daemons
    while lingering and time.monotonic() < deadline:
        time.sleep(1)
        lingering = [p for p in lingering if _alive(p)]
    assert not lingering, f"Ray processes outlived the killed manager: {[p.name() for p in lingering]}"
    for d in _midway(study, latest_at_most=16):
        interrupted.setdefault(d, len(attempts(d)))

    # 3. Rerun to the end.
    out = run_cli("run", "recipes/studies/smoke.gin", "--results", str(results), "--num-cpus", "2",
                  "-b", "ppo.total_steps = 16")
    assert out.returncode == 0, out.stdout + out.stderr
    runs = sorted((study / "runs").glob("*/seed*"))
    assert len(runs) == 4 and len(_completed(study)) == 4
    for d, tries_before in interrupted.items():
        assert attempts(d)[tries_before]["resumed"], f"{d} had a checkpoint but started over"
    for d in runs:
        tries = attempts(d)
        # A run may complete just as the interrupt lands (summary written, exit code never seen),
        # so "finished once" is: at most one clean exit, and no attempt after the completing one.
        assert sum(t["exit_code"] == 0 for t in tries) <= 1, f"{d} finished more than once"
        assert tries[-1]["exit_code"] in (0, None), tries[-1]  # None: stopped as it completed
        assert steps_logged(d) == sorted(set(steps_logged(d))), f"{d}: a step was logged twice"
        assert steps_logged(d)[-1] == 16
        if d.name + d.parent.name in finished_first:
            assert len(tries) == 1, f"{d} finished before the interrupt but ran again"
    agg = json.loads((study / "aggregate.json").read_text())
    assert all(v["summary"]["n"] == 2 for v in agg["variants"].values())

"""One run per run dir: a second `rlhf.train` on a busy --out is refused at once, a run dir that
holds a run is refused unless --resume or --overwrite says what to do with it, and nothing
finished is lost or rewritten by a refused or redundant rerun."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.metrics import read_metrics
from rlhf.run_dir import RUN_LOCK, DirLock, LockBusy, is_locked
from tests.conftest import REPO, run_train, run_trains
from tests.rlhf.test_faults import one_error_line

ARGS = ["recipes/tiny.gin", "-b", "ppo.total_steps = 3", "-b", "ppo.eval_every = 3", "-b", "ppo.save_every = 1",
        "-b", "task.eval_size = 32", "--quiet"]


def snapshot(root: Path) -> dict:
    """Every file under `root` with its bytes and modification time."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A completed run, and a second `rlhf.train` on its --out started while it ran."""
    out = tmp_path_factory.mktemp("run") / "run"
    first = subprocess.Popen([sys.executable, "-m", "rlhf.train", *ARGS, "--out", str(out)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / RUN_LOCK).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    second = run_train([*ARGS, "--out", out], check=False, timeout=120)
    still_running = first.poll() is None
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err[-3000:]
    return {"out": out, "second": second, "first_pid": first.pid, "overlapped": still_running}


def test_a_second_run_on_a_busy_out_exits_2_and_the_first_finishes_intact(finished):
    out = finished["out"]
    assert finished["overlapped"], "the first run ended before the second started: nothing was tested"
    line = one_error_line(finished["second"])
    assert line.startswith(f"error: --out {str(out)!r} is in use by another rlhf.train "
                           f"(pid {finished['first_pid']}, lock {out / RUN_LOCK})"), line
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert not (out / RUN_LOCK).exists()  # released, and removed, when the run ended


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    lock = tmp_path / RUN_LOCK
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from rlhf.run_dir import DirLock\n"
                               f"with DirLock({str(lock)!r}):\n    print('held', flush=True); time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(LockBusy) as busy:
        DirLock(lock).__enter__()
    assert busy.value.pid == holder.pid and is_locked(lock)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock.exists() and not is_locked(lock)  # the file stays, the kernel dropped the lock
    with DirLock(lock):
        assert lock.read_text().strip() == str(os.getpid())
    assert not lock.exists()


@pytest.fixture
def copy(finished, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(finished["out"], out)
    return out


def test_rerunning_the_same_completed_run_is_done_and_rewrites_nothing(copy):
    before = snapshot(copy)
    proc = run_train([*ARGS, "--out", copy], check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == (f"--out {str(copy)!r} already holds this run, completed (see its summary.json): "
                                   f"nothing to do; --overwrite runs it again")
    assert snapshot(copy) == before


@pytest.mark.parametrize("damage, expected", [
    (None, "holds a completed run of another configuration (ppo.kl_coef = 0.2 here, 0.05 before); choose "
           "another --out, or pass --overwrite to replace it"),
    ("unfinished", "holds an unfinished run (checkpoints up to step_3; another configuration: ppo.kl_coef = 0.2 here, "
                   "0.05 before); pass --resume to continue it, --overwrite to start over, or choose another --out"),
    ("diverged", "holds a run that diverged (see its summary.json); choose another --out, or pass --overwrite "
                 "to replace it"),
], ids=["completed", "unfinished", "diverged"])
def test_another_run_into_a_run_dir_that_holds_one_is_refused(copy, damage, expected):
    if damage == "unfinished":  # killed before the end: no summary
        (copy / "summary.json").unlink()
    elif damage == "diverged":
        (copy / "summary.json").write_text(json.dumps({"status": "diverged", "error": "non-finite loss"}))
    before = snapshot(copy)
    line = one_error_line(run_train([*ARGS, "-b", "ppo.kl_coef = 0.2", "--out", copy], check=False, timeout=120))
    assert line == f"error: --out {str(copy)!r} {expected}", line
    assert snapshot(copy) == before


def test_an_interrupted_run_without_resume_is_refused(copy):
    (copy / "summary.json").unlink()
    line = one_error_line(run_train([*ARGS, "--out", copy], check=False, timeout=120))
    assert line == (f"error: --out {str(copy)!r} holds an unfinished run (checkpoints up to step_3); pass --resume "
                    f"to continue it, --overwrite to start over, or choose another --out")


def test_overwrite_replaces_the_earlier_run_once_the_new_one_passes_its_checks(copy):
    before = snapshot(copy)
    line = one_error_line(run_train([*ARGS, "-b", "ppo.kl_coef = -1", "--overwrite", "--out", copy], check=False))
    assert "ppo.kl_coef = -1 is invalid" in line
    line = one_error_line(run_train([*ARGS, "--overwrite", "--resume", "--out", copy], check=False))
    assert "--resume and --overwrite exclude each other" in line
    assert snapshot(copy) == before  # a refused --overwrite keeps the earlier run
    proc = run_train(["recipes/tiny.gin", "-b", "ppo.total_steps = 1", "-b", "task.eval_size = 32",
                      "-b", "ppo.kl_coef = 0.2", "--quiet", "--overwrite", "--out", copy])
    assert f"--overwrite: removed the earlier run's outputs from {copy} (completed)" in proc.stderr
    # Nothing of the earlier run is left to mix with the new one (its step_2 and step_3 would be
    # what a later --resume picks up).
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step_1"]
    assert [r["step"] for r in read_metrics(copy / "metrics.jsonl")] == [0, 1]
    assert json.loads((copy / "summary.json").read_text())["steps"] == 1
    assert "ppo.kl_coef = 0.2" in (copy / "config.gin").read_text()
    assert not any(p.name.startswith(".") for p in copy.iterdir())  # no lock, no removal folder left


def test_removing_outputs_takes_only_the_engines_and_needs_no_dir(tmp_path):
    from rlhf.run_dir import remove_outputs
    remove_outputs(tmp_path / "not_made_yet")  # the manager clears a run dir before it exists
    assert not (tmp_path / "not_made_yet").exists()
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    for name in ("config.gin", "metrics.jsonl", "summary.json", "provenance.json", "run.json", "stderr.log"):
        (tmp_path / name).write_text("x")
    remove_outputs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["provenance.json", "run.json", "stderr.log"]


def test_two_runs_of_one_config_write_the_same_bytes_outside_the_machine_records(tmp_path):
    """Same seed, same config, same code: every file of the run dir (metrics, summary, config, every
    checkpoint file, the saved RNG states included) is byte-identical; only MACHINE_RECORDS differ,
    and those hold the machine's measurements, none of the results."""
    from rlhf.metrics import MACHINE_NAMESPACES, METRICS_FILE, PERF_FILE
    from rlhf.run_dir import MACHINE_RECORDS

    outs = [tmp_path / "a", tmp_path / "b"]
    run_trains(*([*ARGS, "-b", "ppo.save_every = 3", "--out", out] for out in outs))  # side by side
    files = [{k: v[0] for k, v in snapshot(out).items() if Path(k).name not in MACHINE_RECORDS} for out in outs]
    assert files[0].keys() == files[1].keys() and "checkpoints/step_3/state.json" in files[0]
    assert [k for k in files[0] if files[0][k] != files[1][k]] == []
    rows = [json.loads(line) for line in (outs[0] / METRICS_FILE).read_text().splitlines()]
    perf = [json.loads(line) for line in (outs[0] / PERF_FILE).read_text().splitlines()]
    assert not any(k.startswith(MACHINE_NAMESPACES) for r in rows for k in r)
    assert [r["step"] for r in perf] == [r["step"] for r in rows] and "timing_s/step" in perf[-1]
    joined = read_metrics(outs[0] / METRICS_FILE)  # readers see one record per step with every name
    assert joined[-1]["timing_s/step"] == perf[-1]["timing_s/step"] and joined[-1]["step"] == rows[-1]["step"]

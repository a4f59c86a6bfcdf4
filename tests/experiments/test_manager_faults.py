"""Faults around a study: a failed run's cause is its exception, W&B online without a login falls
back to offline (said once), Ray's daemons do not outlive a killed manager, a full disk stops the
manager in one line with nothing lost, engines sharing a GPU start one at a time, a Ctrl-C that a
blocking call swallows still stops the study, and a run's cancellation stops its engine whenever it lands."""

import errno
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from experiments.execute import _supervise, describe_failure, failure_cause
from experiments.launch import _interrupts_remembered, wandb_fallback

VLLM_STDERR = """INFO 12-01 10:00:00 engine.py:100] starting
Traceback (most recent call last):
  File "/x/rlhf/train.py", line 70, in main
    trainer = PPOTrainer(cfg, out)
  File "/x/vllm/worker.py", line 200, in determine_num_available_blocks
    raise ValueError(
ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` \
when initializing the engine.
[rank0]:[W1201 10:00:05 ProcessGroupNCCL.cpp:1250] Warning: WARNING: process group has NOT been destroyed \
before we destruct ProcessGroupNCCL.
"""


def test_failed_run_cause_is_its_exception_not_the_last_stderr_line():
    assert failure_cause(VLLM_STDERR).startswith("ValueError: No available memory for the cache blocks")
    assert describe_failure(1, VLLM_STDERR).startswith("exit 1: ValueError: No available memory")
    assert failure_cause("noise\nerror: ppo.kl_coef = -1 is invalid: must be >= 0\n") == \
        "ppo.kl_coef = -1 is invalid: must be >= 0"
    assert failure_cause("just one line") == "just one line"
    chained = ("Traceback (most recent call last):\n  File \"a\", line 1\nKeyError: 'x'\n\nDuring handling ...\n\n"
               "Traceback (most recent call last):\n  File \"b\", line 2\nsafetensors_rust.SafetensorError: "
               "Error while deserializing header\nW1201 shutdown warning\n")
    assert failure_cause(chained) == "safetensors_rust.SafetensorError: Error while deserializing header"


class _Display:
    def __init__(self):
        self.buffer = io.StringIO()
        self.console = Console(file=self.buffer, width=300)


def test_wandb_online_without_login_says_so_once_and_logs_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    display = _Display()
    assert wandb_fallback(display, str(tmp_path / "wandb")) == "offline"
    text = display.buffer.getvalue()
    assert text.count("warning: W&B: WANDB_MODE=online but this machine is not logged in") == 1
    assert f"wandb sync {tmp_path / 'wandb'}/wandb/offline-run-*" in text
    assert f"W&B offline run files: {tmp_path / 'wandb'}\n" in text
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_fallback(_Display(), str(tmp_path / "wandb")) == "online"


def test_the_wandb_run_files_directory_is_said_and_honours_wandb_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    display = _Display()
    assert wandb_fallback(display, str(tmp_path / "results" / "wandb")) == "offline"
    assert display.buffer.getvalue() == f"W&B offline run files: {tmp_path / 'elsewhere'}\n"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    display = _Display()
    assert wandb_fallback(display, str(tmp_path)) == "disabled" and display.buffer.getvalue() == ""


MANAGER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
watchdog = subprocess.Popen([sys.executable, "-m", "experiments.watchdog", str(__import__("os").getpid())],
                            start_new_session=True)
time.sleep(120)
"""


def test_watchdog_stops_the_daemons_of_a_killed_manager():
    from tests.conftest import REPO
    manager = subprocess.Popen([sys.executable, "-c", MANAGER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    daemon = psutil.Process(int(manager.stdout.readline()))
    time.sleep(3)  # the watchdog has seen the daemon
    os.kill(manager.pid, signal.SIGKILL)
    manager.wait()
    deadline = time.monotonic() + 20
    while daemon.is_running() and daemon.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE


def _no_space_for(name: str, monkeypatch) -> None:
    """Every atomic write of a file called `name` fails as on a full disk, at its rename."""
    real = os.replace

    def replace(src, dst, *a, **kw):
        if Path(dst).name == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst, *a, **kw)
    monkeypatch.setattr(os, "replace", replace)


SMALL = """
study.name = 'full'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 5']
study.variants = {'kl': 'ppo.kl_coef = 0.1'}
study.seeds = 2
"""


def test_a_full_disk_is_one_line_loses_nothing_and_a_rerun_picks_up(write_study, tmp_path, monkeypatch, capsys):
    from experiments.cli import main
    from experiments.execute import execute
    from experiments.launch import _outcome
    from experiments.plan import expand
    from experiments.study import load_study
    from tests.experiments.conftest import fake_run
    monkeypatch.setenv("WANDB_MODE", "disabled")
    path, results = write_study(SMALL), tmp_path / "results"
    specs = expand(load_study(path), results)
    for spec in specs:
        fake_run(spec, 0.5 + 0.1 * (spec.variant == "kl") + 0.01 * spec.seed)
    run_dir = Path(specs[0].run_dir)
    record = (run_dir / "run.json").read_text()

    # A Ray task recording its attempt in run.json: the old record stays whole, no temporary is left...
    _no_space_for("run.json", monkeypatch)
    with pytest.raises(OSError) as raised:
        execute(specs[0].to_json(), False, 2, {}, str(tmp_path / "cache"))
    assert raised.value.errno == errno.ENOSPC and (run_dir / "run.json").read_text() == record
    assert not list(run_dir.glob(".*.tmp"))
    # ... and the manager stops on it rather than retrying the run.
    import ray
    from ray.exceptions import RayTaskError
    failed = RayTaskError("execute", "Traceback ...", raised.value).as_instanceof_cause()
    monkeypatch.setattr(ray, "get", lambda ref: (_ for _ in ()).throw(failed))
    with pytest.raises(OSError, match="No space left on device"):
        _outcome(None, specs[0])

    # The manager's own writes: one line, exit 4 (as the engine's), no traceback, nothing half-written.
    study_dir = (results / "full").resolve()
    _no_space_for("aggregate.json", monkeypatch)
    assert main(["run", str(path), "--results", str(results)]) == 4
    err = capsys.readouterr().err  # the live view's lines, then the one error line
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("error:")] == [
        err.strip().splitlines()[-1]]
    assert err.strip().splitlines()[-1] == (
        f"error: No space left on device writing {study_dir / 'aggregate.json'}: free some space, then run "
        f"the same command again (what was written is kept: finished runs are skipped, interrupted ones "
        f"resume)")
    assert not (study_dir / "aggregate.json").exists() and not list(study_dir.rglob(".*.tmp"))
    monkeypatch.setattr(os, "replace", os.rename)  # space freed
    assert main(["run", str(path), "--results", str(results)]) == 0
    assert "0 completed, 4 already done" in capsys.readouterr().out
    assert (study_dir / "aggregate.json").is_file() and (run_dir / "run.json").read_text() == record


def _no_space_at_sync(monkeypatch) -> None:
    """Every atomic write fails as a real full disk does: at its fsync, whose OSError names no file."""
    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_names_the_file_it_could_not_write_though_the_os_names_none(write_study, tmp_path, monkeypatch,
                                                                               capsys):
    import pickle

    from experiments.cli import main
    from experiments.errors import disk_full_line
    from experiments.execute import execute
    from experiments.plan import expand
    from experiments.study import load_study
    from tests.experiments.conftest import fake_run
    monkeypatch.setenv("WANDB_MODE", "disabled")
    path, results = write_study(SMALL), tmp_path / "results"
    specs = expand(load_study(path), results)
    for spec in specs:
        fake_run(spec, 0.5 + 0.1 * (spec.variant == "kl") + 0.01 * spec.seed)
    study_dir = (results / "full").resolve()
    _no_space_at_sync(monkeypatch)
    # The manager's own write: the one line names the file, exit 4, no traceback.
    assert main(["run", str(path), "--results", str(results)]) == 4
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"error: No space left on device writing {study_dir / 'plan.json'}: free some space, then run the same "
        f"command again (what was written is kept: finished runs are skipped, interrupted ones resume)")
    assert not list(study_dir.rglob(".*.tmp"))
    # A Ray task's write: the error it raises carries the file, pickled back to the manager.
    with pytest.raises(OSError) as raised:
        execute(specs[0].to_json(), False, 2, {}, str(tmp_path / "cache"))
    back = pickle.loads(pickle.dumps(raised.value))
    assert back.errno == errno.ENOSPC and back.filename == str(Path(specs[0].run_dir) / "attempts.json")
    assert disk_full_line(back).startswith(f"error: No space left on device writing {specs[0].run_dir}/attempts.json: ")
    # No file to name (an error without a traceback): the results dir it was writing under.
    bare = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert disk_full_line(bare, str(study_dir)).startswith(
        f"error: No space left on device writing under {study_dir}: ")
    assert disk_full_line(OSError(errno.EACCES, "Permission denied")) is None


FAILING_ENGINE = """
import sys
print("INFO starting the engine", file=sys.stderr)
print("Traceback (most recent call last):", file=sys.stderr)
print('  File "/x/vllm/worker.py", line 200, in determine_num_available_blocks', file=sys.stderr)
print("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.", file=sys.stderr)
print("[rank0]:[W1201 ProcessGroupNCCL.cpp:1250] Warning: WARNING: destroy_process_group() was not called",
      file=sys.stderr)
sys.exit(1)
"""


def test_a_failed_runs_cause_is_its_exception_in_the_record_the_status_and_the_report(write_study, tmp_path,
                                                                                     monkeypatch):
    import experiments.execute as execute_module
    from experiments.collect import read_run
    from experiments.plan import expand
    from experiments.run_records import last_attempt
    from experiments.study import load_study
    monkeypatch.setenv("WANDB_MODE", "disabled")
    study = load_study(write_study(SMALL))
    spec = expand(study, tmp_path / "results")[0]
    monkeypatch.setattr(execute_module, "engine_argv", lambda *a: [sys.executable, "-c", FAILING_ENGINE])
    outcome = execute_module.execute(spec.to_json(), False, 1, {}, str(tmp_path / "cache"))
    cause = "exit 1: ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`."
    assert outcome["error"] == cause and outcome["retriable"]  # the live line shows it when retrying
    assert last_attempt(spec.run_dir)["error"] == cause  # `status`
    assert read_run(spec, study).error == cause  # the report
    import ray
    from ray.exceptions import RayTaskError

    from experiments.launch import _outcome
    raised = RayTaskError("execute", "Traceback ...", ValueError("boom\nmore")).as_instanceof_cause()
    monkeypatch.setattr(ray, "get", lambda ref: (_ for _ in ()).throw(raised))
    assert _outcome(None, spec)["error"] == "ValueError: boom"  # what the task raised, not Ray's banner
    vllm_v1 = ("(EngineCore_0 pid=7) Traceback (most recent call last):\n(EngineCore_0 pid=7)   File \"core.py\"\n"
               "(EngineCore_0 pid=7) ValueError: No available memory for the cache blocks.\n"
               "Traceback (most recent call last):\n  File \"llm.py\"\nRuntimeError: Engine core initialization "
               "failed. See root cause above. Failed core proc(s): {}\nW1201 destroy_process_group() warning\n")
    assert failure_cause(vllm_v1) == "ValueError: No available memory for the cache blocks."
    assert failure_cause("INFO x\nERROR 12-01 core.py:50] RuntimeError: CUDA error: out of memory\nWARNING bye\n") == \
        "RuntimeError: CUDA error: out of memory"


def test_a_ctrl_c_that_a_blocking_call_swallows_is_still_remembered():
    """While a study waits on its runs, Ctrl-C raises KeyboardInterrupt and sets the remembered stop,
    so a call that runs the handler and drops its exception (as C code calling Python's signal
    check may) cannot lose it; the previous handler is back afterwards."""
    before = signal.getsignal(signal.SIGINT)
    with _interrupts_remembered() as stop:
        assert not stop.is_set()
        try:  # a blocking call that swallows the KeyboardInterrupt its signal check raised
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            pass
        assert stop.is_set()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_cancellation_while_the_wandb_run_opens_stops_the_engine():
    """Ray cancels a running task by interrupting its main thread (`_thread.interrupt_main`). The engine
    starts first and the W&B run opens beside it (seconds); a cancellation that lands then must stop
    the engine as one landing later does, not leave it training to its end unwatched."""
    import _thread

    class Streamer:
        closed = None

        def poll(self):
            return 0

        def close(self, exit_code):
            Streamer.closed = exit_code

    def opening_wandb():
        _thread.interrupt_main()  # Ray's non-force cancel, as it lands during W&B's start
        time.sleep(5)
        return Streamer()

    # As a Ray worker has it (the manager's rlhf.errors.honour_interrupts), whatever this process was given.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    start = time.monotonic()
    try:
        assert _supervise(engine, opening_wandb) == (None, True)
        assert engine.returncode == -signal.SIGTERM and time.monotonic() - start < 5
    finally:
        engine.kill()
        engine.wait()
    # Once open, the streamer is closed as the run ends: on a cancellation with the failure code.
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    def open_then_cancelled():
        threading.Timer(0.5, _thread.interrupt_main).start()
        return Streamer()

    try:
        assert _supervise(engine, open_then_cancelled) == (None, True)
        assert engine.returncode == -signal.SIGTERM and Streamer.closed == 1
    finally:
        engine.kill()
        engine.wait()
        signal.signal(signal.SIGINT, previous)

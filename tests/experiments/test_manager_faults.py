"""Faults around a study: a failed run's cause is its exception, W&B online without a login falls
back to offline (said once), and Ray's daemons do not outlive a killed manager."""

import io
import os
import signal
import subprocess
import sys
import time

import psutil
from rich.console import Console

from experiments.execute import describe_failure, failure_cause
from experiments.launch import wandb_fallback

VLLM_STDERR = """INFO 12-01 10:00:00 engine.py:100] starting
Traceback (most recent call last):
  File "/x/rlhf/train.py", line 70, in main
    trainer = PPOTrainer(cfg, out)
  File "/x/vllm/worker.py", line 200, in determine_num_available_blocks
    raise ValueError(
ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.
[rank0]:[W1201 10:00:05 ProcessGroupNCCL.cpp:1250] Warning: WARNING: process group has NOT been destroyed before we destruct ProcessGroupNCCL.
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

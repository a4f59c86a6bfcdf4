"""Shared test set-up: runs are subprocesses of the real engine; the tiny default's SFT warm
start is built once (cached under RLHF_CACHE) and reused by every test."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("RLHF_CACHE", str(REPO / ".cache" / "rlhf"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The engine's CPU numerics profile, before any test imports torch (rlhf/numerics.py): in-process
# engine code then takes the same kernels as the `python -m rlhf.train` subprocesses.
sys.path.insert(0, str(REPO))
from rlhf import numerics  # noqa: E402

numerics.apply()


def run_train(args, timeout=900, check=True, cwd=REPO):
    """Runs `python -m rlhf.train ARGS` and returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "rlhf.train", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlhf.train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO

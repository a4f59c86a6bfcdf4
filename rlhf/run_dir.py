"""A run dir and who writes it: an exclusive lock for the whole run, what an earlier run left
there.

The engine writes `ENGINE_OUTPUTS` (plus `provenance.json`, which the experiment manager extends);
`MACHINE_RECORDS` are the ones that describe the machine rather than the result.
One process at a time: `DirLock` is an flock(2) on a file in the directory, so the kernel
releases it however its holder ends (a SIGKILL included) and a lock is never stale; the holder's
pid is in the file for the message of whoever is refused. The experiment manager locks a study's
results dir with the same class.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

PROFILE_DIR = "profile"
"""Where `python -m rlhf.train --profile STEP` writes its trace and summary (rlhf/profiling.py)."""
ENGINE_OUTPUTS = ("config.gin", "metrics.jsonl", "perf.jsonl", "summary.json", "perf.json", "checkpoints", PROFILE_DIR)
"""What a run writes into its run dir; an earlier run's copies are what --overwrite replaces and
what the experiment manager clears before it starts a run over."""
MACHINE_RECORDS = ("provenance.json", "perf.jsonl", "perf.json", "attempts.json", "stdout.log", "stderr.log")
"""The files of a run dir (and `provenance.json` of a study's results dir) that record the machine
and the moment rather than the result: the git commit, host, hardware and library versions, wall
times and throughput, each attempt's command, pid and exit, the logs. Everything else a run dir
holds (config, metrics, summary, checkpoints, the manager's `run.json`) is a function of the
code, config, data and seed, the same bits on every machine. `.dvcignore` names these, so a
round's versioned results hash the same wherever `dvc repro` reproduces them, while each
machine's record stays beside them (tests/test_dvcignore.py checks the two lists agree)."""
RUN_LOCK = ".train.lock"
"""The lock file of a run dir, held by the `python -m rlhf.train` writing it."""

COMPLETED, DIVERGED, UNFINISHED = "completed", "diverged", "unfinished"


class LockBusy(RuntimeError):
    """Another live process holds the lock; `pid` is its pid (None if it had not written it yet)."""

    def __init__(self, path: Path, pid: Optional[int]):
        super().__init__(f"{path} is held by pid {pid if pid is not None else 'unknown'}")
        self.path, self.pid = path, pid


class DirLock:
    """`with DirLock(path):` holds an exclusive lock on the file `path` or raises LockBusy at once.
    The file holds the holder's pid and is removed on release."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd: Optional[int] = None

    def __enter__(self) -> "DirLock":
        while True:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _holder_pid(fd)
                os.close(fd)
                raise LockBusy(self.path, pid) from None
            # The previous holder removes the file on release: between our open and our lock it
            # may have, and then the lock is on a file no one else will open. Lock the one there.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.path.unlink()  # while still held: a waiter that opened it sees it is gone
        except FileNotFoundError:
            pass
        assert self.fd is not None, "__exit__ follows __enter__"
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def is_locked(path: str | Path) -> bool:
    """True while a live process holds the lock file `path`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _holder_pid(fd: int, wait_s: float = 0.5) -> Optional[int]:
    """The pid the holder wrote (it writes it right after locking: wait a moment for it)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def earlier_run(out: str | Path) -> Optional[str]:
    """What an earlier run left in `out`: COMPLETED or DIVERGED (its summary.json says so),
    UNFINISHED (outputs without a summary: interrupted or killed), or None (none of the engine's
    outputs; the manager's files and provenance.json alone are not a run)."""
    out = Path(out)
    present = [name for name in ENGINE_OUTPUTS if (out / name).exists()]
    if present == ["checkpoints"] and not any((out / "checkpoints").iterdir()):
        present = []
    if not present:
        return None
    try:
        status = json.loads((out / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    outcomes: dict[Any, str] = {COMPLETED: COMPLETED, DIVERGED: DIVERGED}  # `status` is whatever the JSON held
    return outcomes.get(status, UNFINISHED)


def remove_outputs(out: str | Path) -> None:
    """Removes an earlier run's outputs (ENGINE_OUTPUTS): each is first renamed into one hidden
    folder, so the run dir never holds part of them (a kill mid-removal leaves only that folder,
    which the next removal clears)."""
    out = Path(out)
    trash = out / ".removed-outputs"
    shutil.rmtree(trash, ignore_errors=True)
    present = [name for name in ENGINE_OUTPUTS if (out / name).exists()]
    if not present:
        return
    trash.mkdir()
    for name in present:
        os.replace(out / name, trash / name)
    shutil.rmtree(trash)

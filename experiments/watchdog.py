"""Ties a local Ray instance to the manager's life: `python -m experiments.watchdog MANAGER_PID`.

`ray.init()` starts its daemons (GCS, raylet, the dashboard and runtime-env agents, log
monitor, workers) as descendants of the manager. `ray.shutdown()` stops them on a normal exit,
but after a `kill -9` of the manager the agents linger for minutes. The launcher starts this
small process in a session of its own: while the manager lives it records the manager's
descendants (pid and start time) every second; once the manager is gone it kills those that
still run (the same pid and start time, so a reused pid is never hit) and exits.
"""

from __future__ import annotations

import os
import sys
import time

import psutil

POLL_S = 1.0


def _descendants(manager: psutil.Process) -> dict:
    try:
        return {p.pid: p.create_time() for p in manager.children(recursive=True) if p.pid != os.getpid()}
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {}


def watch(manager_pid: int, poll_s: float = POLL_S) -> int:
    """Returns the number of processes killed after the manager died."""
    try:
        manager = psutil.Process(manager_pid)
        started = manager.create_time()
    except psutil.NoSuchProcess:
        return 0
    known: dict = {}
    while True:
        try:
            alive = manager.is_running() and manager.create_time() == started and \
                manager.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            break
        known.update(_descendants(manager))
        time.sleep(poll_s)
    killed = 0
    for pid, created in known.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                proc.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


if __name__ == "__main__":
    sys.exit(0 if watch(int(sys.argv[1])) >= 0 else 1)

"""The start gate of a shared GPU: engines that share one GPU start one at a time, and an engine
that ends waits while another is starting.

A vLLM engine sizes its KV cache from the free memory it measures while it starts (load, memory
profile, CUDA graphs). Another engine's allocations during that window are counted as its own
(it then finds no room for its cache), and memory another process frees during it fails vLLM's
own check ("Error in memory profiling ... current free memory" above the initial). So each GPU
has a gate file naming the engine that started last and when: the experiment manager waits at
the gate before it starts an engine (`wait_to_start`), and an engine about to release its memory
waits while the last starter is still starting (`wait_for_starter`). A starter is still starting
until it has logged a metrics row, at most `gap_s` seconds.

The manager tells the engine where its gate is through `GATE_ENV` and `GAP_ENV`; without them
(a run outside a study, or a GPU of its own) nothing waits.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from rlhf.atomic import write_json

GATE_ENV = "RLHF_GPU_GATE"
"""Path of the gate file of the GPU this engine shares (set by the experiment manager)."""
GAP_ENV = "RLHF_GPU_GATE_GAP_S"
"""The longest a start holds the gate, in seconds (`study.start_gap_s`)."""


def gate_path(gpu: str, gate_dir: Optional[str] = None) -> Path:
    """The gate file of GPU `gpu` of this host and user."""
    root = Path(gate_dir or tempfile.gettempdir())
    return root / f"rlhf-gpu-start-{os.getuid()}-{socket.gethostname()}-gpu{gpu}.json"


def shared_gpu() -> Optional[str]:
    """The one GPU this process was given (CUDA_VISIBLE_DEVICES, which Ray sets for a fractional
    GPU), or None without one or with several."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return gpu if gpu and "," not in gpu else None


def _read(gate: Path) -> dict:
    try:
        return json.loads(gate.read_text())
    except (OSError, ValueError):
        return {}


def _logged_since(run_dir: Optional[str], since: float) -> bool:
    """The engine of `run_dir` has written a metrics row since `since` (its start-up is over)."""
    try:
        return run_dir is not None and os.path.getmtime(Path(run_dir) / "metrics.jsonl") > since
    except OSError:
        return False


def _wait_while_starting(last: dict, gap_s: float) -> None:
    started = float(last.get("time", 0))
    while time.time() - started < gap_s and not _logged_since(last.get("run_dir"), started):
        time.sleep(min(1.0, max(0.01, gap_s - (time.time() - started))))


def wait_to_start(run_dir: Path, gap_s: float, gate_dir: Optional[str] = None) -> float:
    """Before an engine starts on this task's GPU: waits until the engine started last on it has
    logged a step, at most `gap_s` seconds after it started, then records `run_dir` as the last.
    Returns the seconds waited; 0 without a shared GPU or a gap."""
    gpu = shared_gpu()
    if gap_s <= 0 or gpu is None:
        return 0.0
    gate = gate_path(gpu, gate_dir)
    t0 = time.monotonic()
    try:
        with open(gate.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the next starter waits here for this one's turn
            _wait_while_starting(_read(gate), gap_s)
            write_json(gate, {"run_dir": str(run_dir), "time": time.time()})
    except OSError as err:  # the gate is an aid: without it the engine starts now
        print(f"warning: GPU start gate {gate}: {err} (starting without waiting)", file=sys.stderr)
    return time.monotonic() - t0


def engine_env(gap_s: float, gate_dir: Optional[str] = None) -> dict:
    """The variables that tell an engine on this task's shared GPU where its gate is ({} when
    nothing waits)."""
    gpu = shared_gpu()
    if gap_s <= 0 or gpu is None:
        return {}
    return {GATE_ENV: str(gate_path(gpu, gate_dir)), GAP_ENV: repr(float(gap_s))}


def wait_for_starter(run_dir: Path) -> float:
    """Before this engine releases its GPU memory (it ends): waits while another engine on the
    GPU is starting (see the module's docstring), at most the gap. Returns the seconds waited."""
    gate, gap = os.environ.get(GATE_ENV), os.environ.get(GAP_ENV)
    if not gate or not gap:
        return 0.0
    last = _read(Path(gate))
    if not last or Path(last.get("run_dir", "")).resolve() == Path(run_dir).resolve():
        return 0.0
    t0 = time.monotonic()
    try:
        _wait_while_starting(last, float(gap))
    except ValueError:
        return 0.0
    return time.monotonic() - t0

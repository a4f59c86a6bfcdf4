"""One attempt of one run: the engine in its own process, its outcome written to the run dir.

This is the body of a Ray task (see `launch.py`), but it is plain Python: it starts
`python -m rlhf.train` in a subprocess, so gin and torch state never leak between runs, and
limits its threads to the CPUs the task holds. The child is tied to this process (it dies with
it), so a killed study never leaves an orphan writing into a run dir. Outputs: `stdout.log`,
`stderr.log`, the attempt appended to `run.json`, and the manager's fields merged into the
engine's `provenance.json`.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from experiments.errors import (
    DETERMINISTIC_FAILURES,
    EXIT_CONFIG,
    EXIT_DIVERGED,
    EXIT_OUT_OF_MEMORY,
    name_unwritten_path,
)
from experiments.results import RunStatus
from experiments.run_records import read_json, read_record, write_record
from experiments.storage import pull_run_dir, push_run_dir, with_sync
from rlhf import gpu_gate
from rlhf.atomic import write_json

STDERR_TAIL = 2000
CAUSE_SEARCH = 64_000
"""Bytes of a failed attempt's stderr searched for its exception (a traceback can be long)."""
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def engine_argv(spec: dict, resume: bool, ray_address: Optional[str] = None) -> list:
    argv = [sys.executable, "-m", "rlhf.train", spec["recipe"]]
    for binding in spec["bindings"]:
        argv += ["-b", binding]
    argv += ["--out", spec["run_dir"]]
    if spec.get("placement", "local") != "local" and ray_address:
        argv += ["--ray-address", ray_address]  # the engine's ranks join the manager's cluster
    return argv + (["--resume"] if resume else [])


WANDB_POLL_S = 1.0


class _NoStreamer:
    def poll(self) -> int:
        return 0

    def close(self, exit_code: int) -> None:
        pass


def _wandb_streamer(spec: dict, manager: dict):
    """Streams the run's metrics to its W&B run from this (task) process; W&B stays optional
    and its failures never reach the run."""
    try:
        from experiments.wandb_sink import RunDirStreamer, run_for_spec, wandb_mode
        if manager.get("wandb_mode"):  # the manager's choice (e.g. offline: online without a login)
            os.environ["WANDB_MODE"] = manager["wandb_mode"]
        if wandb_mode() == "disabled":
            return _NoStreamer()
        run = run_for_spec(spec, operative_flat(spec.get("operative_config", "")), manager.get("wandb_dir"),
                           manager["wandb_project"], manager.get("wandb_revision"))
        return RunDirStreamer(spec["run_dir"], run)
    except Exception as err:  # noqa: BLE001 - e.g. wandb not installed
        print(f"warning: W&B: {err} (continuing without it)", file=sys.stderr)
        return _NoStreamer()


def operative_flat(text: str) -> dict:
    """gin's operative config text as {'ppo.kl_coef': 0.05, ...}, read by gin's own parser (a value
    may span lines)."""
    from gin import config_parser

    from rlhf.configurable import statements
    return {f"{s.scope + '/' if s.scope else ''}{s.selector}.{s.arg_name}": s.value
            for s in statements(text, "operative config") if isinstance(s, config_parser.BindingStatement)}


def _tail(path: Path, limit: int = STDERR_TAIL) -> str:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure|Warning)|"
                             r"[A-Za-z_][\w.]*\.[A-Z]\w*)(?::\s?(.*))?$")
_LOGGED_EXCEPTION = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): \S.*$")
_PROCESS_PREFIX = re.compile(r"^\((?:pid=\d+|[\w.-]+ pid=\d+)(?:, ip=[\w.:-]+)?\)\s?")
"""A line's process tag: Ray's `(pid=N)` / `(execute pid=N, ip=...)`, vLLM's `(EngineCore_0 pid=N)`."""
_SEE_ABOVE = re.compile(r"(root cause|see above|the above exception)", re.I)
"""A wrapper's message that points at an earlier exception (vLLM: 'Engine core initialization
failed. See root cause above.')."""


def failure_cause(stderr: str) -> str:
    """What a failed engine said about its failure: its own one-line `error: ...`, else the
    exception (type and message) its last traceback ends with (the one before when that one only
    points at it, as vLLM's engine start-up does), else the last exception line logged, else its
    last stderr line. Lines printed after the traceback (a library's shutdown warnings) are not
    the cause."""
    lines = [_PROCESS_PREFIX.sub("", line.rstrip()) for line in stderr.strip().splitlines()]
    own = [line for line in lines if line.startswith("error: ")]
    if own:
        return own[-1][len("error: "):]
    raised = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            raised.append(next((ln for ln in lines[i + 1:] if ln and not ln[0].isspace()
                                and _EXCEPTION_LINE.match(ln)), None))
    raised = [line for line in raised if line]
    if raised:
        return next((line for line in reversed(raised) if not _SEE_ABOVE.search(line)), raised[-1])
    logged = [m.group(0) for m in map(_LOGGED_EXCEPTION.search, lines) if m]
    if logged:
        return logged[-1]
    return lines[-1] if lines else ""


def describe_failure(exit_code: Optional[int], stderr_tail: str) -> str:
    last = failure_cause(stderr_tail)
    if exit_code == EXIT_DIVERGED:
        return f"diverged (exit 3): {last}"
    if exit_code == EXIT_CONFIG:
        return f"configuration error (exit 2): {last}"
    if exit_code == EXIT_OUT_OF_MEMORY:
        return f"out of GPU memory (exit 5): {last}"
    if exit_code is not None and exit_code < 0:
        name = signal.Signals(-exit_code).name if -exit_code in signal.Signals._value2member_map_ else -exit_code
        hint = " (out of memory?)" if exit_code == -signal.SIGKILL else ""
        return f"killed by {name}{hint}: {last}"
    if "OutOfMemoryError" in stderr_tail or "out of memory" in stderr_tail.lower():
        return f"out of memory (exit {exit_code}): {last}"
    return f"exit {exit_code}: {last}"


def _record(spec: dict) -> dict:
    record = read_record(spec["run_dir"])
    if record is None or record.get("run_hash") != spec["run_hash"]:
        record = {"run_hash": spec["run_hash"], "attempts": []}
    record["spec"] = spec
    for attempt in record["attempts"]:
        if attempt.get("end") is None:  # its process was killed before it could say so
            attempt.update(interrupted=True, error="stopped without a record (manager or node killed)")
    return record


def merge_provenance(run_dir: Path, spec: dict, record: dict, manager: dict) -> None:
    """Adds a `manager` section to the engine's provenance.json (or starts one if the engine
    stopped before writing it)."""
    path = run_dir / "provenance.json"
    prov = read_json(path) or {}
    attempts = record["attempts"]
    prov["manager"] = {
        **manager,
        "study": spec["study"], "variant": spec["variant"], "seed": spec["seed"],
        # One name per meaning (docs/studies.md, "Provenance"): the engine's own fields say what ran
        # (config_sha256 of the full operative config, data_sha256 = the plan's data hash,
        # start_checkpoint_sha256, git);
        # the manager's say how the run was identified and planned.
        "run_hash": spec["run_hash"], "config_sha256_without_placement": spec["config_hash"],
        "engine_code": spec["code_version"],
        "init_from": spec["init_from"], "init_from_sha256": spec["init_from_hash"],
        "changes_from_baseline": spec["changes"],
        "engine_command": attempts[-1].get("command"),
        "start_time": attempts[0].get("start"), "end_time": attempts[-1].get("end"),
        "exit_status": attempts[-1].get("exit_code"), "error": attempts[-1].get("error"),
        "attempts": attempts,
    }
    write_json(path, prov)


def _supervise(child: subprocess.Popen, make_streamer) -> tuple:
    """(exit code, False) once the engine `child` has ended, its new metrics streamed to W&B
    meanwhile; (None, True) when a cancellation (or any exception) came first: the engine is
    stopped (terminated, killed after 10 s), then W&B closed. `make_streamer()` opens the run's W&B
    streamer (seconds, for a W&B run) while the engine starts: inside the guard, so a cancellation
    that lands while it opens stops the engine too, rather than leaving it to train on unwatched."""
    streamer = None
    try:
        streamer = make_streamer()
        # Poll rather than block in wait(): Ray delivers a cancellation between bytecodes,
        # which a blocking wait() would postpone until the run ends by itself. The same
        # loop streams new metrics to W&B.
        last_stream = 0.0
        while child.poll() is None:
            time.sleep(0.2)
            if time.monotonic() - last_stream > WANDB_POLL_S:
                streamer.poll()
                last_stream = time.monotonic()
        exit_code = child.returncode
        streamer.close(exit_code)
        return exit_code, False
    except BaseException:
        child.terminate()  # first: the engine must stop now, not after W&B has flushed
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if streamer is not None:
            streamer.close(1)
        return None, True


def execute(spec: dict, resume: bool, attempt: int, manager: dict, cache_dir: str) -> dict:
    """Runs one attempt and returns its outcome: {key, exit_code, error, status, seconds}.

    `manager` holds the study-level provenance (command line, host, results dir). A Ray
    cancellation arrives as KeyboardInterrupt: the child is stopped, the attempt recorded as
    interrupted, and the interrupt re-raised. A full disk is raised with the file it stopped as
    the error's filename (`errors.name_unwritten_path`): the manager's one line names it, though
    the traceback stays in the task.
    """
    try:
        return _execute(spec, resume, attempt, manager, cache_dir)
    except OSError as err:
        name_unwritten_path(err)
        raise


def _execute(spec: dict, resume: bool, attempt: int, manager: dict, cache_dir: str) -> dict:
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    pull_run_dir(spec, manager)  # results in a storage location: the run dir as last pushed, from any node
    if 0 < spec["gpus"] < 1:  # runs share this GPU: their engines start one at a time
        gpu_gate.wait_to_start(run_dir, manager.get("start_gap_s", 0.0))
    record = _record(spec)
    argv = engine_argv(spec, resume, manager.get("ray_address"))
    entry = {"attempt": attempt, "resumed": resume, "command": argv, "start": now(), "end": None,
             "exit_code": None, "error": None, "host": socket.gethostname(), "pid": os.getpid()}
    record["attempts"].append(entry)
    write_record(run_dir, record)

    threads = str(spec["cpus"])
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, RLHF_CACHE=cache_dir,
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if 0 < spec["gpus"] < 1:  # an engine that ends waits while another starts on its GPU
        env.update(gpu_gate.engine_env(manager.get("start_gap_s", 0.0)))
    banner = f"=== attempt {attempt} {'(resume) ' if resume else ''}{entry['start']} ===\n"
    start = time.monotonic()
    with open(run_dir / "stdout.log", "a") as out, open(run_dir / "stderr.log", "a") as err:
        out.write(banner)
        err.write(banner)
        out.flush()
        err.flush()
        stderr_start = err.tell()
        # Own session: a terminal's Ctrl-C reaches the manager, which stops runs in order,
        # rather than every engine at once. Started where the manager was started, so paths
        # in recipes mean what they meant to the user.
        child = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=manager.get("cwd"),
                                 start_new_session=True,
                                 preexec_fn=_die_with_parent if platform.system() == "Linux" else None)
        exit_code, interrupted = _supervise(child, lambda: with_sync(_wandb_streamer(spec, manager), spec, manager))
    seconds = time.monotonic() - start
    stderr_tail = _tail(run_dir / "stderr.log", CAUSE_SEARCH)
    new_stderr = stderr_tail if stderr_start == 0 else stderr_tail.split(banner.strip())[-1].strip()
    entry.update(end=now(), seconds=round(seconds, 2), exit_code=exit_code,
                 interrupted=interrupted, stderr_tail=new_stderr[-STDERR_TAIL:] if exit_code else None,
                 error=None if exit_code in (0, None) else describe_failure(exit_code, new_stderr))
    write_record(run_dir, record)
    merge_provenance(run_dir, spec, record, manager)
    push_run_dir(spec, manager)
    if interrupted:
        raise KeyboardInterrupt(f"{spec['variant']}/seed{spec['seed']} interrupted")
    return {"key": f"{spec['variant']}/seed{spec['seed']}", "exit_code": exit_code, "error": entry["error"],
            "status": RunStatus.COMPLETED if exit_code == 0 else RunStatus.FAILED, "seconds": seconds,
            "retriable": exit_code not in (0, *DETERMINISTIC_FAILURES)}

"""What a run dir says about its run: the manager's record, its state, its latest metrics.

The engine writes config.gin, provenance.json, metrics.jsonl, summary.json and checkpoints/;
the manager adds `run.json` (the run's spec and hash, and one entry per attempt). Every
decision on rerun (skip, resume, start over) is read from these files, so the state of a study
is whatever is on disk, whoever wrote it and however it stopped.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Dict, Iterator, Optional

from experiments.plan import RunSpec, latest_checkpoint

from rlhf.run_dir import remove_outputs, write_atomic  # noqa: E402  (the engine owns its run dir's layout)
from rlhf.train import EXIT_CONFIG, EXIT_DIVERGED  # noqa: E402  (the engine owns its exit codes)

RECORD = "run.json"
DETERMINISTIC_FAILURES = (EXIT_CONFIG, EXIT_DIVERGED)
"""Exit codes that a retry would only repeat: a bad configuration and a diverged loss."""

# Run states, as `state()` reports them.
COMPLETED, FAILED, INTERRUPTED, PENDING, STALE = "completed", "failed", "interrupted", "pending", "stale"


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: dict) -> None:
    """Atomic write: readers never see half a file."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def read_record(run_dir: str | Path) -> Optional[dict]:
    return read_json(Path(run_dir) / RECORD)


def summary(run_dir: str | Path) -> Optional[dict]:
    return read_json(Path(run_dir) / "summary.json")


def is_completed(run_dir: str | Path) -> bool:
    s = summary(run_dir)
    return bool(s) and s.get("status") == "completed"


def state(spec: RunSpec) -> str:
    """completed | failed | interrupted | pending | stale, for this spec's run dir.

    `stale`: the dir holds a run of another hash (the config, code, data or start changed).
    `failed`: the last attempt exited nonzero and no later attempt started.
    """
    run_dir = Path(spec.run_dir)
    record = read_record(run_dir)
    if record is None:
        return STALE if run_dir.exists() and any(run_dir.iterdir()) else PENDING
    if record.get("run_hash") != spec.run_hash:
        return STALE
    if is_completed(run_dir):
        return COMPLETED
    attempts = record.get("attempts", [])
    if attempts and attempts[-1].get("exit_code") not in (None, 0):
        return FAILED
    return INTERRUPTED if latest_checkpoint(run_dir) is not None else PENDING


def last_attempt(run_dir: str | Path) -> dict:
    record = read_record(run_dir) or {}
    attempts = record.get("attempts") or [{}]
    return attempts[-1]


def supersede(run_dir: str | Path) -> Optional[Path]:
    """Moves an old run (another hash) aside to `<study>/superseded/`, keeping it for reference."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return None
    old = (read_record(run_dir) or {}).get("run_hash", "unknown")[:12]
    study_dir = run_dir.parent.parent.parent
    target = study_dir / "superseded" / f"{run_dir.parent.name}-{run_dir.name}-{old}-{int(time.time())}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(target))
    return target


def clear_engine_outputs(run_dir: str | Path) -> None:
    """Removes a run's partial outputs (no checkpoint to resume from) before starting over: the
    engine's own rule (what `rlhf.train --overwrite` removes)."""
    remove_outputs(run_dir)


def iter_metrics(run_dir: str | Path) -> Iterator[dict]:
    """metrics.jsonl rows; a torn last line (a run killed mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row:
                yield row


def scalar(value) -> Optional[float]:
    """A float for a finite or non-finite number; None for anything else (e.g. histograms)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def tail_metrics(run_dir: str | Path, max_bytes: int = 65536) -> Dict:
    """The last complete row of metrics.jsonl, reading only the file's end."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
            if isinstance(row, dict) and "step" in row:
                return row
        except ValueError:
            continue
    return {}

"""What a run dir says about its run: the manager's record, its state, its latest metrics.

The engine writes config.gin, provenance.json, metrics.jsonl, perf.jsonl, summary.json, perf.json
and checkpoints/; the manager adds `run.json` (the run's spec and hash) and `attempts.json` (one
entry per attempt). Every
decision on rerun (skip, resume, start over) is read from these files, so the state of a study
is whatever is on disk, whoever wrote it and however it stopped.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Dict, Iterable, Iterator, Optional, Tuple

from experiments.paths import spec_record
from experiments.results import RunStatus
from rlhf.atomic import write_json
from rlhf.checkpoint import latest_checkpoint as engine_latest_checkpoint  # the engine's checkpoint layout
from rlhf.checkpoint import list_checkpoints, verify_checkpoint
from rlhf.metrics import last_record, read_metrics
from rlhf.run_dir import COMPLETED as ENGINE_COMPLETED  # summary.json's status of a finished run
from rlhf.run_dir import remove_outputs  # the engine owns its run dir's layout

RECORD, ATTEMPTS = "run.json", "attempts.json"
"""The manager's record of a run, in two files: `run.json` (the run's hash and spec: what it is,
the same in every checkout) and `attempts.json` (one entry per attempt: command, host, pid,
start and end, exit: a machine record, rlhf/run_dir.py's MACHINE_RECORDS)."""


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_record(run_dir: str | Path) -> Optional[dict]:
    """{run_hash, spec, attempts} of a run dir, None without a run.json; `attempts` are those of
    attempts.json for the same run hash."""
    record = read_json(Path(run_dir) / RECORD)
    if record is None:
        return None
    kept = read_json(Path(run_dir) / ATTEMPTS) or {}
    record["attempts"] = kept.get("attempts", []) if kept.get("run_hash") == record.get("run_hash") else []
    return record


def write_record(run_dir: str | Path, record: dict) -> None:
    """Writes `read_record`'s dict back: attempts first, so a run.json is never ahead of them."""
    run_dir = Path(run_dir)
    write_json(run_dir / ATTEMPTS, {"run_hash": record["run_hash"], "attempts": record["attempts"]})
    spec = record.get("spec")
    write_json(run_dir / RECORD, {"run_hash": record["run_hash"], **({"spec": spec_record(spec)} if spec else {})})


def summary(run_dir: str | Path) -> Optional[dict]:
    return read_json(Path(run_dir) / "summary.json")


def is_completed(run_dir: str | Path) -> bool:
    s = summary(run_dir)
    return bool(s) and s.get("status") == ENGINE_COMPLETED


def latest_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The newest intact `run_dir/checkpoints/step_N`, or None: the engine's rule
    (rlhf.checkpoint.latest_checkpoint, sizes checked against each checkpoint's manifest), so a
    damaged checkpoint is never what a study resumes from or starts the next round with."""
    return engine_latest_checkpoint(Path(run_dir) / "checkpoints", full=False)


def state(spec) -> RunStatus:
    """completed | failed | interrupted | pending | stale, for the run dir of `spec` (a
    `plan.RunSpec`: its run_dir and run_hash).

    `stale`: the dir holds a run of another hash (the config, code, data or start changed).
    `failed`: the last attempt exited nonzero and no later attempt started.
    """
    run_dir = Path(spec.run_dir)
    record = read_record(run_dir)
    if record is None:
        return RunStatus.STALE if run_dir.exists() and any(run_dir.iterdir()) else RunStatus.PENDING
    if record.get("run_hash") != spec.run_hash:
        return RunStatus.STALE
    if is_completed(run_dir):
        return RunStatus.COMPLETED
    attempts = record.get("attempts", [])
    if attempts and attempts[-1].get("exit_code") not in (None, 0):
        return RunStatus.FAILED
    return RunStatus.INTERRUPTED if latest_checkpoint(run_dir) is not None else RunStatus.PENDING


def last_attempt(run_dir: str | Path) -> dict:
    record = read_record(run_dir) or {}
    attempts = record.get("attempts") or [{}]
    return attempts[-1]


SUPERSEDED = "superseded"


def supersede(run_dir: str | Path) -> Optional[Path]:
    """Moves an old run (another hash) aside to `<study>/superseded/`, out of the new run's way;
    `prune` removes it once the study has run its current plan."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return None
    old = (read_record(run_dir) or {}).get("run_hash", "unknown")[:12]
    study_dir = run_dir.parent.parent.parent
    target = study_dir / SUPERSEDED / f"{run_dir.parent.name}-{run_dir.name}-{old}-{int(time.time())}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(run_dir), str(target))
    return target


def prune(study_dir: str | Path, keep: Iterable[str | Path]) -> int:
    """Removes the runs of `study_dir` that are not in `keep` (the current plan's run dirs): the
    ones `supersede` moved aside and run dirs of variants or seeds the plan no longer has. A
    study's results then hold exactly its plan's runs (what DVC versions and pushes); a removed
    run is reproducible from the study file's history. Returns how many runs were removed.
    The caller holds the study's lock."""
    study_dir = Path(study_dir).resolve()
    keep = {Path(p).resolve() for p in keep}
    if not keep or any(study_dir / "runs" not in p.parents for p in keep):
        return 0  # not this study's plan: remove nothing
    removed = 0
    superseded = study_dir / SUPERSEDED
    for old in sorted(superseded.iterdir()) if superseded.is_dir() else ():
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        removed += 1
    if superseded.is_dir():
        superseded.rmdir()
    runs = study_dir / "runs"
    for variant in sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else ():
        for run_dir in sorted(p for p in variant.iterdir() if p.is_dir()):
            if run_dir not in keep:
                shutil.rmtree(run_dir)
                removed += 1
        if not any(variant.iterdir()):
            variant.rmdir()
    return removed


def clear_engine_outputs(run_dir: str | Path) -> None:
    """Removes a run's partial outputs (no checkpoint to resume from) before starting over: the
    engine's own rule (what `rlhf.train --overwrite` removes)."""
    remove_outputs(run_dir)


def iter_metrics(run_dir: str | Path) -> Iterator[dict]:
    """A run's per-step records, each with its machine measurements (rlhf.metrics.read_metrics);
    a torn last line (a run killed mid-write) is skipped."""
    yield from read_metrics(run_dir)


def scalar(value) -> Optional[float]:
    """A float for a finite or non-finite number; None for anything else (e.g. histograms)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


GOLD_METRIC = "eval/accuracy"
"""Held-out accuracy against ground truth: the gold a reward model's score is checked against."""


def best_checkpoint(run_dir: str | Path, metric: str = GOLD_METRIC) -> Optional[Tuple[int, float]]:
    """(step, value) of the run's intact checkpoint (`checkpoints/step_N`, sizes checked against its
    manifest) whose held-out `metric` at step N is highest, the earliest on a tie; None when no
    checkpoint's step has a finite eval row of it (a NaN is no score). The engine evaluates after a
    step's update and before saving it, so the eval row at step N scores exactly the weights of step_N."""
    checkpoints = {step for step, path in list_checkpoints(Path(run_dir) / "checkpoints")
                   if verify_checkpoint(path, full=False) is None}
    scored = [(int(row["step"]), scalar(row.get(metric))) for row in iter_metrics(run_dir)
              if int(row["step"]) in checkpoints]
    scored = [(step, value) for step, value in scored if value is not None and math.isfinite(value)]
    return max(scored, key=lambda sv: (sv[1], -sv[0])) if scored else None


def tail_metrics(run_dir: str | Path) -> Dict:
    """The last complete record of a run dir, reading only the files' ends (rlhf.metrics.last_record)."""
    return last_record(run_dir)

"""Atomic writes, and what a full disk looks like, for the engine's run dirs (config.gin,
provenance.json, summary.json) and the experiment manager's files (run.json, plan.json,
aggregate.json, reports, plots).

A file is written to a temporary beside it, synced, then renamed over it: a reader (or the next
run after a crash, a kill or a full disk) sees the old file or the new one, never half of one,
and a failed write leaves no temporary behind. Standard library only: the pipeline stages that
must not load the study machinery (or torch) use it too.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Optional


def write_atomic(path: str | Path, write) -> None:
    """`write(tmp_path)` fills a temporary file beside `path`, which then replaces `path` in one
    step: readers see the old file or the new one, never half of one, and a failed write (a
    full disk) leaves the old file and no temporary behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a full disk can surface only here (delayed allocation)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """Atomic text write (`write_atomic`)."""
    write_atomic(path, lambda tmp: tmp.write_text(text))


def finite(data):
    """`data` with every non-finite float (NaN, +-inf) as None, through dicts, lists and tuples:
    JSON has no NaN or Infinity, and strict parsers reject the bare tokens Python writes."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def write_json(path: str | Path, data: dict) -> None:
    """Atomic JSON write (`write_atomic`), strict: a non-finite number is written as null (`finite`)."""
    write_text(path, json.dumps(finite(data), indent=2, sort_keys=False, default=str, allow_nan=False) + "\n")


def unwritten_path(err: BaseException) -> Optional[str]:
    """The file a full disk stopped a write of: the error's own filename (open, mkdir, rename name
    it), else, for a write, flush or fsync that failed (the OS names no file then), the file being
    written when it was raised: the target of `rlhf.atomic.write_atomic` (not its temporary), or
    an open file in the failing frames. None when neither says."""
    named = getattr(err, "filename", None) or getattr(err, "filename2", None)
    if named:
        return os.fsdecode(named) if isinstance(named, (str, bytes, os.PathLike)) else str(named)
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):  # innermost first
        if frame.f_code.co_name == "write_atomic" and isinstance(frame.f_locals.get("path"), (str, os.PathLike)):
            return os.fspath(frame.f_locals["path"])
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            name = getattr(value, "name", None) if isinstance(value, io.IOBase) else None
            if isinstance(name, (str, os.PathLike)):
                return os.fspath(name)
    return None

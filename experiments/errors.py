"""How the manager fails: the one error a bad input raises, and the exit codes of every command.

The bottom of the package (README, "Layout"): every layer raises `StudyError` for an input it
cannot use (a study declaration, a binding, a results dir), with one line that names the binding
or file and what is allowed; the command line (experiments/cli.py) prints that line and exits
with `EXIT_CONFIG`, before any compute. The codes a run's engine exits with are the engine's
(rlhf/errors.py): 2 means bad input everywhere, so a study and a run say it the same way.
"""

from __future__ import annotations

import io
import os
from typing import Optional

from rlhf.atomic import is_disk_full
from rlhf.errors import EXIT_CONFIG, EXIT_DIVERGED, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK

__all__ = ["StudyError", "EXIT_OK", "EXIT_ERROR", "EXIT_CONFIG", "EXIT_DIVERGED", "EXIT_RUNS_FAILED",
           "EXIT_INTERRUPTED", "INTERRUPTED", "DETERMINISTIC_FAILURES", "unwritten_path", "name_unwritten_path",
           "disk_full_line"]


class StudyError(ValueError):
    """A study declaration is invalid; the message names the binding and what is allowed."""


EXIT_RUNS_FAILED = 1
"""A command's code beside the engine's: some runs failed (or nothing could be decided)."""
INTERRUPTED = "interrupted: run the same command again to resume"
"""The line of a command stopped by Ctrl-C (or SIGTERM), with EXIT_INTERRUPTED."""
DETERMINISTIC_FAILURES = (EXIT_CONFIG, EXIT_DIVERGED)
"""A run's exit codes that a retry would only repeat: a bad configuration and a diverged loss."""


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


def name_unwritten_path(err: BaseException) -> BaseException:
    """`err` with the file a full disk stopped (`unwritten_path`) as its filename, so the name
    survives where the traceback does not (pickled out of a Ray task). Returns `err`."""
    if isinstance(err, OSError) and is_disk_full(err) and not err.filename:
        path = unwritten_path(err)
        if path:
            err.filename = path
    return err


def disk_full_line(err: BaseException, where: Optional[str] = None) -> Optional[str]:
    """The one line a command prints for a full disk (None for any other error): the file that
    could not be written (`unwritten_path`), else under `where` (the results dir); what to do."""
    if not is_disk_full(err):
        return None
    path = unwritten_path(err)
    target = f" writing {path}" if path else f" writing under {where}" if where else ""
    what = getattr(err, "strerror", None) or "No space left on device"
    return (f"error: {what}{target}: free some space, then run the same command again (what was written is "
            f"kept: finished runs are skipped, interrupted ones resume)")

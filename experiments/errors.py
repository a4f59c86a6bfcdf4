"""How the manager fails: the one error a bad input raises, and the exit codes of every command.

The bottom of the package (README, "Layout"): every layer raises `StudyError` for an input it
cannot use (a study declaration, a binding, a results dir), with one line that names the binding
or file and what is allowed; the command line (experiments/cli.py) prints that line and exits
with `EXIT_CONFIG`, before any compute. The codes a run's engine exits with are the engine's
(rlhf/errors.py): 2 means bad input everywhere, so a study and a run say it the same way.
"""

from __future__ import annotations

from typing import Optional

from rlhf.atomic import unwritten_path
from rlhf.errors import (
    EXIT_CONFIG,
    EXIT_DISK_FULL,
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    is_disk_full,
)

__all__ = ["StudyError", "EXIT_OK", "EXIT_ERROR", "EXIT_CONFIG", "EXIT_DIVERGED", "EXIT_DISK_FULL", "EXIT_RUNS_FAILED",
           "EXIT_OUT_OF_MEMORY",
           "EXIT_INTERRUPTED", "INTERRUPTED", "DETERMINISTIC_FAILURES", "unwritten_path", "name_unwritten_path",
           "disk_full_line", "RUN_REMEDY", "STAGE_REMEDY"]


class StudyError(ValueError):
    """A study declaration is invalid; the message names the binding and what is allowed."""


EXIT_RUNS_FAILED = 1
"""A command's code beside the engine's: some runs failed (or nothing could be decided)."""
INTERRUPTED = "interrupted: run the same command again to resume"
"""The line of a command stopped by Ctrl-C (or SIGTERM), with EXIT_INTERRUPTED."""
DETERMINISTIC_FAILURES = (EXIT_CONFIG, EXIT_DIVERGED, EXIT_OUT_OF_MEMORY)
"""A run's exit codes that a retry would only repeat: a bad configuration, a diverged loss and a phase
that ran out of GPU memory (the same configuration asks for the same memory)."""


def name_unwritten_path(err: BaseException) -> BaseException:
    """`err` with the file a full disk stopped (`unwritten_path`) as its filename, so the name
    survives where the traceback does not (pickled out of a Ray task). Returns `err`."""
    if isinstance(err, OSError) and is_disk_full(err) and not err.filename:
        path = unwritten_path(err)
        if path:
            err.filename = path
    return err


RUN_REMEDY = "what was written is kept: finished runs are skipped, interrupted ones resume"
"""What running a study's command again does after a full disk (the default of `disk_full_line`)."""
STAGE_REMEDY = "its files are written whole or not at all, so nothing half-written is left"
"""The same for a pipeline stage, which writes its outputs anew."""


def disk_full_line(err: BaseException, where: Optional[str] = None, remedy: str = RUN_REMEDY) -> Optional[str]:
    """The one line a command prints for a full disk (None for any other error): the file that
    could not be written (`unwritten_path`), else under `where` (the results dir); what to do."""
    if not is_disk_full(err):
        return None
    path = unwritten_path(err)
    target = f" writing {path}" if path else f" writing under {where}" if where else ""
    what = getattr(err, "strerror", None) or "No space left on device"
    return f"error: {what}{target}: free some space, then run the same command again ({remedy})"

"""How the manager fails: the one error a bad input raises, and the exit codes of every command.

The bottom of the package (README, "Layout"): every layer raises `StudyError` for an input it
cannot use (a study declaration, a binding, a results dir), with one line that names the binding
or file and what is allowed; the command line (experiments/cli.py) prints that line and exits
with `EXIT_CONFIG`, before any compute. The codes a run's engine exits with are the engine's
(rlhf/train.py): 2 means bad input everywhere, so a study and a run say it the same way.
"""

from __future__ import annotations

from rlhf.train import EXIT_CONFIG, EXIT_DIVERGED, EXIT_ERROR, EXIT_OK

__all__ = ["StudyError", "EXIT_OK", "EXIT_ERROR", "EXIT_CONFIG", "EXIT_DIVERGED", "EXIT_RUNS_FAILED",
           "EXIT_INTERRUPTED", "DETERMINISTIC_FAILURES"]


class StudyError(ValueError):
    """A study declaration is invalid; the message names the binding and what is allowed."""


EXIT_RUNS_FAILED, EXIT_INTERRUPTED = 1, 130
"""A command's codes beside the engine's: some runs failed (or nothing could be decided); interrupted."""
DETERMINISTIC_FAILURES = (EXIT_CONFIG, EXIT_DIVERGED)
"""A run's exit codes that a retry would only repeat: a bad configuration and a diverged loss."""

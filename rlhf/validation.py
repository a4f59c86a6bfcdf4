"""The validator vocabulary every config shares.

Each check raises a `ConfigError` (or the `error` it is given: a study's `StudyError`) of one line that
names the binding, its value and what is allowed, so a bad binding fails before any compute in the same
words whichever config it belongs to.
"""

from __future__ import annotations

import math
from typing import Any

from rlhf.errors import ConfigError


def invalid(binding: str, value: Any, allowed: str, error: type = ConfigError) -> Exception:
    """The error `binding = value is invalid: allowed`, of class `error` (a study's is a StudyError)."""
    return error(f"{binding} = {value!r} is invalid: {allowed}")


def check(ok: bool, binding: str, value: Any, allowed: str, error: type = ConfigError) -> None:
    """Raise `invalid(binding, value, allowed)` unless `ok`."""
    if not ok:
        raise invalid(binding, value, allowed, error)


def positive_int(scope: str, name: str, value: Any, minimum: int = 1, error: type = ConfigError) -> None:
    """`scope.name` is an integer (not a bool) of at least `minimum`."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    check(ok, f"{scope}.{name}", value, f"must be an integer >= {minimum}", error)


def number(scope: str, name: str, value: Any, lo: float, hi: float,
           lo_open: bool = False, hi_open: bool = False) -> None:
    """`scope.name` is a finite number (not a bool) in the interval from `lo` to `hi`, each end closed unless open."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    check(ok, f"{scope}.{name}", value, f"must be a number in {left}{lo}, {hi}{right}")


def choice(scope: str, name: str, value: Any, choices: tuple) -> None:
    """`scope.name` is one of `choices`."""
    check(value in choices, f"{scope}.{name}", value, f"must be one of {', '.join(map(repr, choices))}")


def why_not_a_file(path) -> str | None:
    """None when `path` is a file, else why not ('does not exist', 'is a directory, not a file'):
    the start of a message that then says what is expected."""
    from pathlib import Path
    path = Path(path)
    if path.is_file():
        return None
    return "is a directory, not a file" if path.is_dir() else "does not exist"

"""Paths as the manager records them: relative to its working directory when they lie under it.

A study's plan, run records and aggregate, the engine bindings the planner writes
(`ppo.init_from`) and so every run's config and content hash, must not depend on where the
repository is checked out: the same study in another clone is the same runs with the same
hashes, and DVC versions the same bytes. The manager runs from the repository root (as `dvc
repro` does) and starts each engine in its own working directory, so a relative path means the
same file to both. A path outside the working directory (a temporary dir, another disk) stays
absolute.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, cast, overload


@overload
def portable(path: str | Path, base: Optional[str | Path] = None) -> str: ...
@overload
def portable(path: None, base: Optional[str | Path] = None) -> None: ...
def portable(path: Optional[str | Path], base: Optional[str | Path] = None) -> Optional[str]:
    """`path` relative to `base` (default: the working directory) when it lies under it, else as given
    (None and "" as they are)."""
    if path is None or str(path) == "":
        return cast(Optional[str], path)  # None, or "" (a Path never reads as "")
    try:
        target, root = Path(path).resolve(), Path(base or os.getcwd()).resolve()
    except (OSError, ValueError):
        return str(path)
    return os.path.relpath(target, root) if target.is_relative_to(root) else str(path)


def spec_record(spec: dict) -> dict:
    """A run spec (`plan.RunSpec.to_json`) as files record it (plan.json, run.json): the run dir
    relative to its study's results dir, the recipe relative to the working directory. What the
    files hold is then the same in every checkout; `collect.load_plan` resolves them again."""
    run_dir = Path(spec["run_dir"])
    return {**spec, "run_dir": portable(run_dir, run_dir.parent.parent.parent), "recipe": portable(spec["recipe"])}


def output_file(path: str | Path, flag: str = "--out") -> Path:
    """The file a stage writes, `path`, checked before any compute: refused in one line (StudyError
    naming `flag`) when it is a directory or its parent cannot be one; its parent is made. A file
    already there is replaced atomically (rlhf.atomic), as a rerun of the stage should."""
    from experiments.errors import StudyError
    path = Path(path)
    if path.is_dir():
        raise StudyError(f"{flag} {str(path)!r} is a directory; give a file to write (e.g. {path / 'out.json'}), "
                         f"which is replaced if it exists")
    _make_dir(path.parent, flag, path)
    return path


def output_dir(path: str | Path, flag: str = "--out") -> Path:
    """The directory a stage writes its files into, `path`, checked and made before any compute:
    refused in one line when it (or a parent) is a file. Files already in it are replaced atomically."""
    path = Path(path)
    _make_dir(path, flag, path)
    return path


def _make_dir(directory: Path, flag: str, given: Path) -> None:
    from experiments.errors import StudyError
    blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise StudyError(f"{flag} {str(given)!r}: {blocker} is a file, not a directory; give a path under a "
                         f"directory, or move the file")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        from rlhf.errors import is_disk_full
        if is_disk_full(err):
            raise  # the command's full-disk line, exit 4
        raise StudyError(f"{flag} {str(given)!r}: cannot make {directory} ({err.strerror or type(err).__name__}); "
                         f"choose a directory you can write") from None

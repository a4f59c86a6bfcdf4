"""Results in a storage location: `--results` given as a URI that pyarrow.fs reaches (`s3://bucket/results`,
`gs://...`, `hdfs://...`, `file:///nfs/results`), for clusters whose nodes share no filesystem.

The manager and every run work in a local copy of the location, at the same path on every node
(`staging_dir`), so everything that reads a results dir reads it unchanged. The location is the
truth: the manager pulls it into its copy before it plans; each run pulls its own run dir before
an attempt (it may resume on another node) and pushes it after every attempt and whenever a new
checkpoint has appeared (`RunSync`), so a node or a manager that dies loses at most the work since
a run's last checkpoint; the manager pushes the rest (plan, report, W&B files) when it ends, killed
by a signal included. A local path or an NFS mount needs none of this: it is the results dir itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

from experiments.errors import StudyError

MARKER = ".storage-uri"
"""In a local copy: the URI it mirrors (what `launch` records and hands to the runs)."""
LOCAL_ONLY = (MARKER, ".lock")
"""Files of a local copy never synced: its marker, and the study lock, which guards this copy only."""
UNSHARED = ("wandb",)
"""Top-level dirs of the location that a push adds to but never deletes from: runs on other nodes
add their W&B run files there, which this copy never saw."""
PARTIAL = ".partial-"
"""The name prefix of a file being copied (`_copy`): never listed, never synced."""
CHECKPOINTS_POLL_S = 5.0
"""How often a run looks for a new checkpoint to push while its engine runs."""


def is_uri(results: str | Path) -> bool:
    return "://" in str(results)


def staging_dir(uri: str) -> Path:
    """The local copy of `uri`: the same path on every node (the system's temp dir, named by the URI)."""
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "rlhf-results" / digest


def location_of(results_dir: str | Path) -> Optional[str]:
    """The URI whose local copy `results_dir` is, or None for a plain results dir."""
    marker = Path(results_dir) / MARKER
    return marker.read_text().strip() if marker.is_file() else None


def _filesystem(uri: str):
    """(pyarrow FileSystem, path inside it) for `uri`; a StudyError naming --results when pyarrow cannot reach it."""
    from pyarrow import fs
    try:
        filesystem, path = fs.FileSystem.from_uri(uri)
        filesystem.get_file_info(path)  # credentials, bucket and endpoint are checked here, before any run
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
        raise StudyError(f"--results {uri!r}: {str(err).strip().splitlines()[0]}; give a local path, an NFS "
                         f"mount, or a URI pyarrow.fs reaches (s3://, gs://, hdfs://, file://)") from None
    return filesystem, path.rstrip("/")


def _files(filesystem, root: str) -> Dict[str, Tuple[int, Optional[int]]]:
    """{path relative to root: (size, mtime in ns)} of every file under `root` ({} when it does not exist),
    less LOCAL_ONLY files and checkpoints still being written (`.tmp_*` dirs, renamed into place when whole)."""
    from pyarrow import fs
    if filesystem.get_file_info(root).type != fs.FileType.Directory:
        return {}
    out = {}
    for info in filesystem.get_file_info(fs.FileSelector(root, recursive=True)):
        rel = info.path[len(root):].lstrip("/")
        name = Path(rel).name
        if info.type == fs.FileType.File and name not in LOCAL_ONLY and not name.startswith(PARTIAL) \
                and not any(part.startswith(".tmp_") for part in Path(rel).parts):
            out[rel] = (info.size, info.mtime_ns)
    return out


def _sync(src_fs, src: str, dst_fs, dst: str, delete: bool) -> None:
    """Makes `dst` hold `src`'s files: copies each file missing at `dst`, of another size there, or newer
    at `src`; with `delete`, removes the files of `dst` that `src` lacks. An upload is newer than its
    source, and a download takes its source's time, so an unchanged file is never copied back."""
    from pyarrow import fs
    theirs, mine = _files(src_fs, src), _files(dst_fs, dst)
    to_local = isinstance(dst_fs, fs.LocalFileSystem)
    for rel, (size, mtime) in theirs.items():
        have = mine.get(rel)
        if have is None or have[0] != size or (mtime or 0) > (have[1] or 0):
            _copy(src_fs, f"{src}/{rel}", dst_fs, f"{dst}/{rel}")
            if to_local and mtime:
                os.utime(f"{dst}/{rel}", ns=(mtime, mtime))
    if delete:
        for rel in set(mine) - set(theirs):
            dst_fs.delete_file(f"{dst}/{rel}")


def _local():
    from pyarrow import fs
    return fs.LocalFileSystem()


def pull(uri: str, local: Path, sub: str = "") -> None:
    """The location's `sub` dir (all of it by default) into the local copy, replacing what the copy holds there."""
    filesystem, root = _filesystem(uri)
    local.mkdir(parents=True, exist_ok=True)
    _sync(filesystem, f"{root}/{sub}".rstrip("/"), _local(), str(local / sub).rstrip("/"), delete=True)


def push(local: Path, uri: str, sub: str = "") -> None:
    """The local copy's `sub` dir (all of it by default) to the location; files there the copy lacks are
    removed, except in UNSHARED dirs, which only gain files."""
    filesystem, root = _filesystem(uri)
    if sub:
        _sync(_local(), str(local / sub), filesystem, f"{root}/{sub}", delete=Path(sub).parts[0] not in UNSHARED)
        return
    for entry in local.iterdir():
        if entry.name not in LOCAL_ONLY:
            push(local, uri, entry.name) if entry.is_dir() else _sync_file(entry, filesystem, f"{root}/{entry.name}")


def _copy(src_fs, src: str, dst_fs, dst: str) -> None:
    """One file, copied under a temporary name and then moved into place: a copy cut short (a killed
    manager or run) never leaves a truncated file where a reader, or the next pull, would take it as whole."""
    from pyarrow import fs
    folder, name = dst.rsplit("/", 1)
    dst_fs.create_dir(folder, recursive=True)
    partial = f"{folder}/{PARTIAL}{os.getpid()}-{name}"
    fs.copy_files(src, partial, source_filesystem=src_fs, destination_filesystem=dst_fs)
    dst_fs.move(partial, dst)


def _sync_file(path: Path, filesystem, target: str) -> None:
    _copy(_local(), str(path), filesystem, target)


@contextlib.contextmanager
def results_location(results: str, write: bool) -> Iterator[str]:
    """The results dir a command works in: `results` itself when it is a path; for a URI its local copy,
    pulled first and (`write`) pushed back when the command ends, however it ends."""
    if not is_uri(results):
        yield results
        return
    local = staging_dir(results)
    pull(results, local)
    (local / MARKER).write_text(results)
    try:
        yield str(local)
    finally:
        if write:
            push(local, results)


class RunSync:
    """A run's W&B streamer (experiments/execute.py) that also pushes the run dir, while its engine runs,
    whenever a new checkpoint has appeared: a node that dies then costs the run only the steps since."""

    def __init__(self, inner, spec: dict, manager: dict):
        self.inner, self.spec, self.manager = inner, spec, manager
        self.checkpoints = self._checkpoints()
        self.last_look = time.monotonic()

    def _checkpoints(self) -> set:
        root = Path(self.spec["run_dir"]) / "checkpoints"
        return {p.name for p in root.iterdir() if not p.name.startswith(".")} if root.is_dir() else set()

    def poll(self) -> int:
        if time.monotonic() - self.last_look > CHECKPOINTS_POLL_S:
            self.last_look = time.monotonic()
            now = self._checkpoints()
            if now - self.checkpoints:
                push_run_dir(self.spec, self.manager, wandb=False)
                self.checkpoints = now
        return self.inner.poll()

    def close(self, exit_code: int) -> None:
        self.inner.close(exit_code)


def _run_dir(spec: dict, manager: dict) -> Tuple[Path, str]:
    local = Path(manager["staging_dir"])
    return local, Path(spec["run_dir"]).relative_to(local).as_posix()


def pull_run_dir(spec: dict, manager: dict) -> None:
    """Before an attempt, with the study's results in a storage location: the location's copy of the run dir
    replaces the local one, so the run resumes from what it last pushed, on whichever node that was."""
    if manager.get("results_uri"):
        local, sub = _run_dir(spec, manager)
        pull(manager["results_uri"], local, sub)
        (local / MARKER).write_text(manager["results_uri"])


def push_run_dir(spec: dict, manager: dict, wandb: bool = True) -> None:
    """After an attempt (its record written), with the study's results in a storage location: the run dir,
    and (`wandb`) the W&B run files this node wrote, to the location."""
    if manager.get("results_uri"):
        local, sub = _run_dir(spec, manager)
        push(local, manager["results_uri"], sub)
        if wandb and (local / "wandb").is_dir():
            push(local, manager["results_uri"], "wandb")


def with_sync(streamer, spec: dict, manager: dict):
    """`streamer` with the run's checkpoint pushes (`RunSync`) when the study's results live in a storage
    location, else `streamer`."""
    return RunSync(streamer, spec, manager) if manager.get("results_uri") else streamer

"""Reads W&B offline run files (`run-<id>.wandb`) back into Python: run fields, config, history
rows and summary. wandb ships no reader for them; the format is a 7-byte header, then LevelDB
log records (32 KiB blocks, 7-byte record headers: crc32c, length, type full/first/middle/last),
each payload a `wandb_internal_pb2.Record` protobuf. A file or record it cannot read raises
`UnreadableRecord`: nothing is dropped silently."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Iterator, List

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
IDENT = b":W&B"


class UnreadableRecord(ValueError):
    """A run file holds a record this reader cannot read: a test must not pass on what it skipped."""


def _payloads(data: bytes, path: str) -> Iterator[bytes]:
    if data[:4] != IDENT:
        raise UnreadableRecord(f"{path}: not a W&B run file (header {data[:HEADER]!r})")
    pos, pending = HEADER, None
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - (pos % BLOCK)
        if left_in_block < HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left_in_block
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        if kind not in (FULL, FIRST, MIDDLE, LAST) or len(chunk) < length:
            raise UnreadableRecord(f"{path}: record at byte {pos}: type {kind}, {length} bytes "
                                   f"({len(chunk)} left in the file)")
        if (kind in (FULL, FIRST)) != (pending is None):
            raise UnreadableRecord(f"{path}: record at byte {pos}: type {kind} out of sequence")
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        else:
            yield pending + chunk
            pending = None
    if pending is not None or pos < len(data) and any(data[pos:]):
        raise UnreadableRecord(f"{path}: the file ends inside a record (byte {pos} of {len(data)})")


def _value(item) -> object:
    return json.loads(item.value_json)


def _key(item) -> str:
    return item.key if item.key else "/".join(item.nested_key)


def read_run(path: str | Path) -> Dict:
    """{'id', 'project', 'group', 'job_type', 'name', 'tags', 'config': {}, 'history': [rows], 'summary': {},
    'artifacts': [{'name', 'type', 'aliases', 'files': {name: local path}}]}."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: Dict = {"config": {}, "history": [], "summary": {}, "artifacts": [], "path": str(path)}
    for payload in _payloads(Path(path).read_bytes(), str(path)):
        rec = pb.Record()
        try:
            rec.ParseFromString(payload)
        except Exception as err:  # protobuf's DecodeError
            raise UnreadableRecord(f"{path}: a record that is not a wandb Record: {err}") from err
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
            out.update(id=run.run_id, project=run.project, group=run.run_group, job_type=run.job_type,
                       name=run.display_name, tags=list(run.tags))
            for item in run.config.update:
                out["config"][_key(item)] = _value(item)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][_key(item)] = _value(item)
        elif kind == "history":
            out["history"].append({_key(item): _value(item) for item in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][_key(item)] = _value(item)
        elif kind == "artifact":
            art = rec.artifact
            out["artifacts"].append({"name": art.name, "type": art.type, "aliases": list(art.aliases),
                                     "files": {e.path: e.local_path for e in art.manifest.contents}})
    return out


def find_runs(wandb_dir: str | Path) -> List[Path]:
    """Every offline run file under a W&B directory."""
    return sorted(Path(wandb_dir).rglob("run-*.wandb"))

"""The tests' W&B offline reader reads what it is given or fails, naming the file and the byte."""

from __future__ import annotations

import struct

import pytest

from tests.experiments.wandb_offline import BLOCK, FIRST, FULL, LAST, UnreadableRecord, read_run


def record(payload: bytes, kind: int = FULL) -> bytes:
    return struct.pack("<IHB", 0, len(payload), kind) + payload


def history(step: int) -> bytes:
    from wandb.proto import wandb_internal_pb2 as pb
    rec = pb.Record()
    item = rec.history.item.add()
    item.key, item.value_json = "step", str(step)
    return rec.SerializeToString()


HEAD = b":W&B" + struct.pack("<HB", 0xBEE1, 0)


def test_full_and_split_records_read_back(tmp_path):
    split = history(2)
    data = HEAD + record(history(1)) + record(split[:3], FIRST) + record(split[3:], LAST)
    data += b"\0" * (BLOCK - len(data))  # the block's zero padding
    path = tmp_path / "run-x.wandb"
    path.write_bytes(data)
    assert read_run(path)["history"] == [{"step": 1}, {"step": 2}]


@pytest.mark.parametrize("damage, match", [
    (lambda d: d[:-2], "ends inside a record|left in the file"),           # a torn last record
    (lambda d: d + record(history(3), kind=9), "type 9"),                  # an unknown record type
    (lambda d: d + record(history(3)[:3], FIRST), "ends inside a record"),  # a first part without its last
    (lambda d: d + record(history(3), LAST), "out of sequence"),            # a last part without its first
    (lambda d: d + record(b"\xff\xff\xff"), "not a wandb Record"),          # bytes protobuf cannot parse
    (lambda d: b"XXXX" + d[4:], "not a W&B run file"),
])
def test_a_record_it_cannot_read_fails_loudly(tmp_path, damage, match):
    path = tmp_path / "run-x.wandb"
    path.write_bytes(damage(HEAD + record(history(1))))
    with pytest.raises(UnreadableRecord, match=match):
        read_run(path)


def test_a_value_that_is_not_json_fails(tmp_path):
    from wandb.proto import wandb_internal_pb2 as pb
    rec = pb.Record()
    item = rec.summary.update.add()
    item.key, item.value_json = "reward_mean", "{not json"
    path = tmp_path / "run-x.wandb"
    path.write_bytes(HEAD + record(rec.SerializeToString()))
    with pytest.raises(ValueError):
        read_run(path)

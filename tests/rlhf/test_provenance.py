"""The checkpoint hash shared by the engine's provenance and the manager's run hashes."""

import rlhf.provenance as provenance
from rlhf.provenance import hash_directory


def test_checkpoint_hash_follows_content_and_fingerprints_large_files(tmp_path, monkeypatch):
    a = tmp_path / "a"
    (a / "actor").mkdir(parents=True)
    (a / "actor" / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (a / "state.json").write_text('{"step": 4}')
    first = hash_directory(a)
    assert hash_directory(a) == first and hash_directory(tmp_path / "missing") is None
    (a / "state.json").write_text('{"step": 5}')
    assert hash_directory(a) != first
    # Above LARGE_FILE only size, head and tail count: a change in the middle goes unseen,
    # a change of size or at either end does not.
    monkeypatch.setattr(provenance, "LARGE_FILE", 1024)
    big = a / "actor" / "model.safetensors"
    big.write_bytes(b"\0" * (3 << 20))
    before = hash_directory(a)
    data = bytearray(big.read_bytes())
    data[3 << 19] = 1
    big.write_bytes(bytes(data))
    assert hash_directory(a) == before
    data[-1] = 1
    big.write_bytes(bytes(data))
    assert hash_directory(a) != before

"""The checkpoint hash shared by the engine's provenance and the manager's run hashes."""

import json

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


def test_hardware_fingerprint_tells_cpus_apart_and_reads_older_provenance():
    from rlhf.provenance import hardware_fingerprint
    epyc = {"hardware": {"cpu": "x86_64", "cpu_info": {
        "vendor": "AuthenticAMD", "model_name": "AMD EPYC", "family": "25", "model": "17",
        "kernel_flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}}}
    xeon = {"hardware": {"cpu": "x86_64", "gpus": ["NVIDIA H200"], "cpu_info": {
        "vendor": "GenuineIntel", "model_name": "Intel(R) Xeon(R) Platinum 8480+", "family": "6", "model": "143",
        "kernel_flags": ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]}}}
    assert hardware_fingerprint(epyc) == "AuthenticAMD AMD EPYC family 25 model 17 [avx2 fma avx512f avx512_bf16]"
    assert hardware_fingerprint(xeon).endswith("[avx2 fma avx512f avx512_bf16 amx_tile amx_bf16] + NVIDIA H200")
    assert hardware_fingerprint(epyc) == hardware_fingerprint(json.loads(json.dumps(epyc)))
    assert hardware_fingerprint({"hardware": {"cpu": "x86_64"}}) == "x86_64"  # before cpu_info was recorded
    assert hardware_fingerprint({}) == "unknown CPU"


def test_cpu_info_reads_vendor_model_and_kernel_flags(tmp_path):
    from rlhf.provenance import cpu_info
    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f amx_tile\n\n"
            "processor\t: 1\nvendor_id\t: GenuineIntel\n")
    (tmp_path / "cpuinfo").write_text(text)
    info = cpu_info(str(tmp_path / "cpuinfo"))
    assert (info["vendor"], info["model_name"], info["family"], info["model"]) == \
        ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+", "6", "143")
    assert info["kernel_flags"] == ["sse4_2", "avx", "avx2", "fma", "avx512f", "amx_tile"]
    assert cpu_info(str(tmp_path / "missing"))["kernel_flags"] == []

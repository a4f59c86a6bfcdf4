"""Checkpoints are verified before they are trusted: a manifest of sizes and sha256 is written
with each one; a damaged latest checkpoint is skipped (and moved aside) and the run resumes from
the newest intact one, to the same numbers as a run never interrupted."""

import json
import shutil

from rlhf import checkpoint
from rlhf.metrics import read_metrics
from tests.conftest import run_train

VOLATILE = ("timing_s/", "perf/")
ARGS = ["recipes/tiny.gin", "-b", "ppo.total_steps = 6", "-b", "ppo.eval_every = 3", "-b", "ppo.save_every = 3",
        "-b", "task.eval_size = 32", "--quiet"]


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def fake_checkpoint(root, step, payload=b"x" * 1000):
    ckpt = root / f"step_{step}"
    (ckpt / "actor").mkdir(parents=True)
    (ckpt / "actor" / "model.safetensors").write_bytes(payload)
    (ckpt / "state.json").write_text(json.dumps({"step": step}))
    checkpoint.write_manifest(ckpt)
    return ckpt


def test_verify_catches_truncation_bitflips_and_missing_files(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 3)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == {"actor/model.safetensors", "state.json"}
    assert checkpoint.verify_checkpoint(ckpt) is None
    weights = ckpt / "actor" / "model.safetensors"
    weights.write_bytes(b"x" * 500)
    assert checkpoint.verify_checkpoint(ckpt, full=False) == \
        "actor/model.safetensors has 500 bytes, the manifest says 1000"
    weights.write_bytes(b"x" * 999 + b"y")
    assert checkpoint.verify_checkpoint(ckpt, full=False) is None  # sizes alone cannot see this
    assert "does not match its sha256" in checkpoint.verify_checkpoint(ckpt)
    weights.unlink()
    assert checkpoint.verify_checkpoint(ckpt) == "actor/model.safetensors is missing"


def test_verify_only_a_subdirectory_checks_its_files_alone(tmp_path):
    """What an export reads (`only='actor'`): a damaged optimizer state is no reason to refuse the policy."""
    import pytest

    from rlhf.errors import ConfigError
    ckpt = fake_checkpoint(tmp_path, 3)
    (ckpt / "actor_optim.safetensors").write_bytes(b"y" * 100)
    checkpoint.write_manifest(ckpt)
    (ckpt / "actor_optim.safetensors").write_bytes(b"y" * 10)
    assert checkpoint.verify_checkpoint(ckpt) == "actor_optim.safetensors has 10 bytes, the manifest says 100"
    assert checkpoint.verify_checkpoint(ckpt, only="actor") is None
    checkpoint.check_start_checkpoint(ckpt, "checkpoint", only="actor")
    (ckpt / "actor" / "model.safetensors").write_bytes(b"x" * 999 + b"y")
    assert checkpoint.verify_checkpoint(ckpt, only="actor") == \
        "actor/model.safetensors does not match its sha256 in the manifest"
    with pytest.raises(ConfigError) as err:
        checkpoint.check_start_checkpoint(ckpt, "checkpoint", only="actor", fix="export another step_N")
    assert str(err.value) == (f"checkpoint = '{ckpt}' is damaged: actor/model.safetensors does not match its sha256 "
                              f"in the manifest; export another step_N")
    with pytest.raises(ConfigError, match="start from an intact checkpoint"):  # ppo.init_from: every file
        checkpoint.check_start_checkpoint(ckpt)


def test_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path):
    fake_checkpoint(tmp_path, 3)
    newer = fake_checkpoint(tmp_path, 6)
    (newer / "actor" / "model.safetensors").write_bytes(b"x" * 10)
    logged, skipped = [], []
    assert checkpoint.latest_checkpoint(tmp_path, log=logged.append, skipped=skipped) == tmp_path / "step_3"
    assert skipped == [(newer, "actor/model.safetensors has 10 bytes, the manifest says 1000")]
    assert logged == [f"checkpoint {newer} is damaged (actor/model.safetensors has 10 bytes, the manifest says "
                      f"1000): skipped"]
    moved = checkpoint.quarantine(newer)
    assert moved.name == "corrupt-step_6" and not newer.exists()
    assert [p.name for _, p in checkpoint.list_checkpoints(tmp_path)] == ["step_3"]


def test_a_checkpoint_without_its_manifest_is_damaged(tmp_path):
    """The engine writes manifest.json with every checkpoint: a step dir without one (a copy that
    left it out) is not trusted, whatever its weights look like."""
    import torch
    from safetensors.torch import save_file
    ckpt = tmp_path / "step_2"
    (ckpt / "actor").mkdir(parents=True)
    save_file({"w": torch.zeros(64)}, str(ckpt / "actor" / "model.safetensors"))
    (ckpt / "state.json").write_text('{"step": 2}')
    assert checkpoint.verify_checkpoint(ckpt) == "no manifest.json"
    assert checkpoint.latest_checkpoint(tmp_path, log=lambda m: None) is None


def test_resume_skips_a_truncated_latest_checkpoint_and_matches_an_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    run_train([*ARGS, "--out", whole])
    step6 = whole / "checkpoints" / "step_6"
    assert checkpoint.verify_checkpoint(step6) is None
    expected = comparable(read_metrics(whole / "metrics.jsonl"))

    # The same run, its latest checkpoint cut in half after it was written.
    out = tmp_path / "damaged"
    shutil.copytree(whole, out)
    weights = out / "checkpoints" / "step_6" / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (out / "summary.json").unlink()
    proc = run_train([*ARGS, "--out", out, "--resume"])
    assert "skipped damaged checkpoint" in proc.stderr and "step_6" in proc.stderr
    assert f"resuming from {out / 'checkpoints' / 'step_3'}" in proc.stderr
    assert comparable(read_metrics(out / "metrics.jsonl")) == expected
    assert json.loads((out / "summary.json").read_text())["final"] == \
        json.loads((whole / "summary.json").read_text())["final"]
    # The damaged files were moved aside, the rewritten step_6 is intact: a second resume trusts it.
    assert (out / "checkpoints" / "corrupt-step_6").is_dir()
    assert checkpoint.verify_checkpoint(out / "checkpoints" / "step_6") is None
    proc = run_train([*ARGS, "--out", out, "--resume"])
    assert "skipped damaged checkpoint" not in proc.stderr
    assert comparable(read_metrics(out / "metrics.jsonl")) == expected


def test_resume_with_every_checkpoint_damaged_starts_over_and_keeps_none_of_them(tmp_path, capsys):
    from rlhf.train import resume_checkpoint
    for step in (3, 6):
        (fake_checkpoint(tmp_path, step) / "state.json").write_text("{}")  # shorter than in the manifest
    assert resume_checkpoint(tmp_path) is None
    err = capsys.readouterr().err
    assert err.count("skipped damaged checkpoint") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt-step_3", "corrupt-step_6"]
    assert checkpoint.latest_checkpoint(tmp_path) is None

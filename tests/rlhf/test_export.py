"""`python -m rlhf.export`: a run checkpoint's policy as a plain HF model dir. The checkpoint is
verified as `ppo.init_from` verifies one before anything loads; bad input (a damaged file, a base of
other shapes, a missing --base, no tokenizer) is one line naming it, exit 2; `--dtype` is the
written weights' dtype for full fine-tuning and LoRA checkpoints alike.

The checkpoints are written by the engine's own checkpoint writer (`save_checkpoint`) from a tiny
actor trained a step, full fine-tuning and LoRA."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlhf import checkpoint
from rlhf.config import PPOConfig, TinyModelConfig
from rlhf.export import main
from rlhf.placement.context import DeviceContext
from rlhf.roles.actor import Actor
from rlhf.tiny import build_char_tokenizer, build_tiny_model
from tests.conftest import REPO
from tests.rlhf.test_grad_accumulation import make_batch

CPU = DeviceContext(torch.device("cpu"))
FIX = "export an intact checkpoint (another step_N of the run)"


def tiny(tok, **kw):
    return build_tiny_model(TinyModelConfig(**{"hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                               "intermediate_size": 64, **kw}), tok, seed=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(root, {'full': step dir, 'lora': step dir}); root/model is the LoRA base, root/wide and
    root/shallow are models of other shapes."""
    root = tmp_path_factory.mktemp("export")
    tok = build_char_tokenizer(root / "tokenizer")
    tiny(tok).save_pretrained(str(root / "model"))
    tiny(tok, hidden_size=48).save_pretrained(str(root / "wide"))
    tiny(tok, num_layers=1).save_pretrained(str(root / "shallow"))
    steps = {}
    for kind, rank in (("full", 0), ("lora", 4)):
        ppo = PPOConfig(rollout_micro_batch_size=16, num_rollout_batches=1, mini_batch_size=8, micro_batch_size=4,
                        actor_learning_rate=1e-2, critic_learning_rate=1e-2, lora_rank=rank)
        actor = Actor(CPU, ppo, start_dir=str(root / "model"), tokenizer_dir=str(root / "tokenizer"),
                      total_updates=2, model_dir=str(root / "model"))
        actor.update(make_batch(tok), shuffle_seed=0, kl_coef=0.1)
        steps[kind] = checkpoint.save_checkpoint(root / kind / "checkpoints", 1, actor=actor, critic=None,
                                                 tokenizer=tok, trainer_state={}, keep=0)
    assert (steps["lora"] / "actor" / "adapter_model.safetensors").is_file()
    assert (steps["full"] / "actor" / "model.safetensors").is_file()
    return root, steps


@pytest.fixture
def copy(ckpts, tmp_path):
    """A fresh copy of a fixture checkpoint, to damage."""
    def make(kind):
        return shutil.copytree(ckpts[1][kind], tmp_path / kind / "step_1")
    return make


def export(capfd, *argv):
    """(exit code, stderr) of `python -m rlhf.export ARGV`, in this process."""
    capfd.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capfd.readouterr().err


def one_line_error(rc, err) -> str:
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ")
    return err.strip()


def no_output(tmp_path, out):
    assert not out.exists()
    assert not list(tmp_path.rglob(".tmp-*")), "a temporary export was left behind"


# ------------------------------------------------------------------ 1. a damaged adapter
def damage(path, how):
    data = path.read_bytes()
    if how == "half":
        path.write_bytes(data[:len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "header":
        path.write_bytes(b"\xff" * 64 + data[64:])
    return len(data)


@pytest.mark.parametrize("how", ["half", "empty", "header"])
def test_a_damaged_adapter_is_one_line_naming_it(copy, tmp_path, capfd, how):
    ckpt = copy("lora")
    adapter = ckpt / "actor" / "adapter_model.safetensors"
    size = damage(adapter, how)
    rc, err = export(capfd, ckpt, "--out", tmp_path / "out")
    msg = one_line_error(rc, err)
    reason = ("does not match its sha256 in the manifest" if how == "header" else
              f"has {adapter.stat().st_size} bytes, the manifest says {size}")
    assert msg == f"error: checkpoint = '{ckpt}' is damaged: actor/adapter_model.safetensors {reason}; {FIX}"
    no_output(tmp_path, tmp_path / "out")
    # Without a manifest (an older checkpoint, or its actor/ copied alone): its header is read.
    (ckpt / "manifest.json").unlink()
    for given in (ckpt, ckpt / "actor"):
        rc, err = export(capfd, given, "--out", tmp_path / "out")
        assert one_line_error(rc, err).startswith(f"error: checkpoint = '{given}': {adapter} is truncated or "
                                                  f"damaged (")
        assert err.strip().endswith(FIX)
    no_output(tmp_path, tmp_path / "out")


def test_a_truncated_adapter_is_one_line_from_the_command_line(copy, tmp_path):
    ckpt = copy("lora")
    damage(ckpt / "actor" / "adapter_model.safetensors", "half")
    (ckpt / "manifest.json").unlink()  # what used to reach safetensors' loader: a SafetensorError traceback
    proc = subprocess.run([sys.executable, "-m", "rlhf.export", str(ckpt), "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    one_line_error(proc.returncode, proc.stderr)
    assert "adapter_model.safetensors is truncated or damaged" in proc.stderr
    no_output(tmp_path, tmp_path / "out")


# ------------------------------------------------------------------ 2. the manifest first
def test_truncated_full_weights_are_refused_by_the_manifest(copy, tmp_path, capfd):
    ckpt = copy("full")
    weights = ckpt / "actor" / "model.safetensors"
    size = damage(weights, "half")
    rc, err = export(capfd, ckpt, "--out", tmp_path / "out")
    assert one_line_error(rc, err) == (f"error: checkpoint = '{ckpt}' is damaged: actor/model.safetensors has "
                                       f"{size // 2} bytes, the manifest says {size}; {FIX}")
    no_output(tmp_path, tmp_path / "out")


def test_flipped_adapter_bytes_that_still_load_are_refused_by_the_manifest(copy, tmp_path, capfd):
    ckpt = copy("lora")
    adapter = ckpt / "actor" / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-200:-136] = bytes(b ^ 0x5A for b in data[-200:-136])  # 64 bytes of tensor data: the header still reads
    adapter.write_bytes(bytes(data))
    assert checkpoint.damaged_weights(ckpt / "actor") is None, "the damage should be invisible to a header read"
    for given in (ckpt, ckpt / "actor"):  # the step's manifest, also when its actor/ is given
        rc, err = export(capfd, given, "--out", tmp_path / "out")
        assert one_line_error(rc, err) == (f"error: checkpoint = '{ckpt}' is damaged: actor/adapter_model.safetensors "
                                           f"does not match its sha256 in the manifest; {FIX}")
    no_output(tmp_path, tmp_path / "out")


def test_only_the_policy_files_are_verified(copy, tmp_path, capfd):
    """The export reads actor/ alone: a damaged optimizer state does not keep an intact policy from it."""
    ckpt = copy("lora")
    damage(ckpt / "actor_optim.safetensors", "half")
    assert checkpoint.verify_checkpoint(ckpt) is not None
    rc, err = export(capfd, ckpt, "--out", tmp_path / "out")
    assert rc == 0, err
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ------------------------------------------------------------------ 3., 4. the LoRA base
@pytest.mark.parametrize("other, what", [
    ("wide", "model.layers.0.mlp.down_proj is 48x64 (outputs x inputs) there, the adapter was trained on 32x64"),
    ("shallow", "the adapter adapts model.layers.1.mlp.down_proj, which that model does not have"),
])
def test_a_base_of_other_shapes_is_one_line_naming_base(ckpts, tmp_path, capfd, other, what):
    root, steps = ckpts
    rc, err = export(capfd, steps["lora"], "--out", tmp_path / "out", "--base", root / other)
    actor = steps["lora"] / "actor"
    assert one_line_error(rc, err) == (
        f"error: --base '{root / other}' does not match the adapter in {actor}: {what}; give the model the adapter "
        f"was trained on (its actor/adapter_config.json records '{(root / 'model').resolve()}')")
    no_output(tmp_path, tmp_path / "out")


def test_a_missing_base_names_the_base_given(ckpts, tmp_path, capfd):
    root, steps = ckpts
    missing = tmp_path / "no-such-model"
    rc, err = export(capfd, steps["lora"], "--out", tmp_path / "out", "--base", missing)
    assert one_line_error(rc, err) == (
        f"error: --base '{missing}' is not a local model directory (no config.json there): give the directory of "
        f"the model the adapter was trained on (its adapter_config.json records '{(root / 'model').resolve()}')")
    # Without --base, the recorded base is what is missing.
    ckpt = shutil.copytree(steps["lora"], tmp_path / "moved" / "step_1")
    config = json.loads((ckpt / "actor" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(missing)
    (ckpt / "actor" / "adapter_config.json").write_text(json.dumps(config))
    checkpoint.write_manifest(ckpt)
    rc, err = export(capfd, ckpt, "--out", tmp_path / "out")
    assert one_line_error(rc, err) == (f"error: the adapter in {ckpt / 'actor'} was trained on '{missing}', which is "
                                       f"not a local model directory here; give its base with --base MODEL_DIR")
    no_output(tmp_path, tmp_path / "out")


# ------------------------------------------------------------------ 5. no tokenizer
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_checkpoint_without_a_tokenizer_is_one_line(copy, tmp_path, capfd, kind):
    ckpt = copy(kind)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / "actor" / name).unlink()
    checkpoint.write_manifest(ckpt)  # written so: intact, but without a tokenizer
    rc, err = export(capfd, ckpt, "--out", tmp_path / "out")
    assert one_line_error(rc, err) == (
        f"error: {ckpt / 'actor'} has no tokenizer files (none of tokenizer.json, tokenizer_config.json, "
        f"tokenizer.model, vocab.json, ...): the exported model needs the tokenizer the run trained with; save it "
        f"into {ckpt / 'actor'} (tokenizer.save_pretrained) and export again")
    no_output(tmp_path, tmp_path / "out")


# ------------------------------------------------------------------ 6. --dtype
def written(out):
    """({name: tensor} of the written weights, config.json's dtype)."""
    tensors = {}
    for path in out.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    return tensors, json.loads((out / "config.json").read_text()).get("dtype")


def test_dtype_converts_full_and_lora_exports_alike(ckpts, tmp_path, capfd):
    from transformers import AutoModelForCausalLM
    _, steps = ckpts
    outs = {}
    for kind in ("full", "lora"):
        for dtype in ("float32", "bfloat16"):
            outs[kind, dtype] = tmp_path / f"{kind}-{dtype}"
            rc, err = export(capfd, steps[kind], "--out", outs[kind, dtype], "--dtype", dtype)
            assert rc == 0, err
    # float32 of a float32 full fine-tuning checkpoint: its own files, byte for byte.
    actor = steps["full"] / "actor"
    assert {p.name for p in outs["full", "float32"].iterdir()} == {p.name for p in actor.iterdir()}
    for p in actor.iterdir():
        assert (outs["full", "float32"] / p.name).read_bytes() == p.read_bytes(), p.name
    for kind in ("full", "lora"):
        want, want_dtype = written(outs[kind, "float32"])
        got, got_dtype = written(outs[kind, "bfloat16"])
        assert (want_dtype, got_dtype) == ("float32", "bfloat16")
        assert set(got) == set(want) and all(t.dtype == torch.bfloat16 for t in got.values())
        for name, t in want.items():  # rounded once, from the float32 weights (the float32 merge for LoRA)
            assert torch.equal(got[name], t.to(torch.bfloat16)), (kind, name)
        with safe_open(str(outs[kind, "bfloat16"] / "model.safetensors"), framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        model = AutoModelForCausalLM.from_pretrained(str(outs[kind, "bfloat16"]))
        assert next(model.parameters()).dtype == torch.bfloat16
        assert (outs[kind, "bfloat16"] / "tokenizer.json").is_file()
    # The merge is of the trained adapter: the LoRA export differs from its base.
    base, _ = written(ckpts[0] / "model")
    merged, _ = written(outs["lora", "float32"])
    assert any(not torch.equal(merged[n], base[n]) for n in base)

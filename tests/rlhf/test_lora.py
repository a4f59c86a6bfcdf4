"""LoRA (peft) for the policy and the critic, and gradient checkpointing: what trains, what the
reference is, what a checkpoint holds, merged weights, resume, init_from and export."""

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlhf.config import PPOConfig, TinyModelConfig
from rlhf.metrics import read_metrics
from rlhf.models import lora_scaling, merged_weights
from rlhf.placement.context import DeviceContext
from rlhf.roles.actor import Actor
from rlhf.roles.critic import Critic
from rlhf.roles.reference import Reference
from rlhf.tiny import build_char_tokenizer, build_tiny_model
from tests.conftest import REPO, VOLATILE, kill_when, meanwhile, run_train, run_trains
from tests.rlhf.test_grad_accumulation import make_batch

CPU = DeviceContext(torch.device("cpu"))
LORA = ["-b", "ppo.lora_rank = 8", "-b", "ppo.actor_learning_rate = 3e-3", "-b", "ppo.critic_learning_rate = 9e-3"]
SHORT = ["-b", "ppo.total_steps = 6", "-b", "ppo.eval_every = 3", "-b", "ppo.save_every = 3",
         "-b", "task.eval_size = 32", "--quiet"]
def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def tensor_hash(tensors) -> str:
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-model")
    tok = build_char_tokenizer(root / "tokenizer")
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), tok,
                             seed=0)
    model.save_pretrained(str(root / "model"), safe_serialization=True)
    return root / "model", root / "tokenizer", tok


def lora_cfg(**kw):
    return PPOConfig(rollout_micro_batch_size=16, num_rollout_batches=1, mini_batch_size=8, micro_batch_size=4,
                     actor_learning_rate=1e-2, critic_learning_rate=1e-2, lora_rank=4, **kw)


def test_only_adapters_train_and_the_reference_is_the_base_with_the_adapter_off(model_dirs):
    model_dir, tok_dir, tok = model_dirs
    actor = Actor(CPU, lora_cfg(), start_dir=str(model_dir), tokenizer_dir=str(tok_dir), total_updates=4,
                  model_dir=str(model_dir))
    reference = Reference(CPU, lora_cfg(), model_dir=str(model_dir))
    batch = make_batch(tok)
    frozen = lambda: tensor_hash((n, p) for n, p in actor.model.named_parameters() if not p.requires_grad)  # noqa: E731
    trained = lambda: tensor_hash((n, p) for n, p in actor.model.named_parameters() if p.requires_grad)  # noqa: E731
    assert actor.trained_names and all("lora_" in n for n in actor.trained_names)
    assert len(actor.optimizer.param_groups[0]["params"]) == len(actor.trained_names)
    base_before, adapters_before = frozen(), trained()
    # A fresh adapter is zero: the policy starts exactly at its reference.
    assert torch.equal(actor.compute_logprobs(batch)[0], reference.compute_logprobs(batch))
    for step in range(2):
        actor.update(batch, shuffle_seed=step, kl_coef=0.1)
    assert frozen() == base_before, "the frozen base changed"
    assert trained() != adapters_before, "the adapters did not train"
    assert torch.equal(actor.compute_reference_logprobs(batch), reference.compute_logprobs(batch))
    assert not torch.equal(actor.compute_logprobs(batch)[0], reference.compute_logprobs(batch))

    critic = Critic(CPU, lora_cfg(), model_dir=str(model_dir), random_init=False, total_updates=4)
    assert set(critic.trained_names) >= {"value_head.weight", "value_head.bias"}
    assert all("lora_" in n or n.startswith("value_head.") for n in critic.trained_names)
    base_before = tensor_hash((n, p) for n, p in critic.model.named_parameters() if not p.requires_grad)
    critic.update(batch, shuffle_seed=0)
    assert tensor_hash((n, p) for n, p in critic.model.named_parameters() if not p.requires_grad) == base_before
    full = Critic(CPU, lora_cfg(critic_lora_rank=0), model_dir=str(model_dir), random_init=False, total_updates=4)
    assert not full.lora and len(full.trained_names) == len(list(full.model.parameters()))


def test_merged_weights_forward_equals_the_adapter_forward(model_dirs):
    from transformers import AutoModelForCausalLM
    model_dir, tok_dir, tok = model_dirs
    actor = Actor(CPU, lora_cfg(), start_dir=str(model_dir), tokenizer_dir=str(tok_dir), total_updates=4,
                  model_dir=str(model_dir))
    batch = make_batch(tok)
    for step in range(3):
        actor.update(batch, shuffle_seed=step, kl_coef=0.1)
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir))
    merged = dict(merged_weights(actor.model.state_dict(), lora_scaling(actor.model)))
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    actor.model.eval()
    with torch.no_grad():
        want = actor.model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    assert (want - got).abs().max() <= 1e-5 * max(1.0, want.abs().max())
    # peft's own merge gives the same weights
    reference = actor.model.merge_and_unload().state_dict()
    for name, tensor in merged.items():
        assert torch.allclose(tensor, reference[name], atol=1e-6), name


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-run")
    run_train(["recipes/tiny.gin", *LORA, *SHORT, "--out", out])
    return out


def test_checkpoint_holds_peft_adapters_that_peft_loads(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForCausalLM
    ckpt = lora_run / "checkpoints" / "step_6"
    actor_files = {p.name for p in (ckpt / "actor").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= actor_files
    assert "model.safetensors" not in actor_files, "a LoRA checkpoint holds no copy of the base"
    assert {p.name for p in (ckpt / "critic").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                            "value_head.safetensors"}
    base_dir = json.loads((ckpt / "actor" / "adapter_config.json").read_text())["base_model_name_or_path"]
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(ckpt / "actor"))
    saved = load_file(str(ckpt / "actor" / "adapter_model.safetensors"))
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k), "the adapters never trained"
    loaded = {k: v for k, v in policy.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)
    critic = PeftModel.from_pretrained(AutoModel.from_pretrained(base_dir), str(ckpt / "critic"))
    assert (sum("lora_" in k for k in critic.state_dict())
            == len(load_file(str(ckpt / "critic" / "adapter_model.safetensors"))))

    # The merged export is an ordinary checkpoint whose forward is the adapter forward.
    proc = subprocess.run([sys.executable, "-m", "rlhf.export", str(ckpt), "--out", str(tmp_path / "merged")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    ids = torch.randint(4, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = policy.eval()(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (want - got).abs().max() <= 1e-5 * max(1.0, want.abs().max())  # float32 rounding of the sums
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    before = (tmp_path / "merged" / "model.safetensors").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "rlhf.export", str(ckpt), "--out", str(tmp_path / "merged")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == before, "a finished export was overwritten"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    proc = subprocess.run([sys.executable, "-m", "rlhf.export", str(tmp_path), "--out", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "not a checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_init_from_a_lora_checkpoint_continues_its_adapters(lora_run, tmp_path):
    ckpt = lora_run / "checkpoints" / "step_6"
    # LoRA from a LoRA checkpoint continues its adapters; full fine-tuning from it starts from the merged
    # policy (the two runs side by side).
    run_trains(["recipes/tiny.gin", *LORA, "-b", "ppo.total_steps = 1", "-b", "task.eval_size = 32", "--quiet",
                "-b", f"ppo.init_from = '{ckpt}'", "--out", tmp_path / "next"],
               ["recipes/tiny.gin", "-b", "ppo.total_steps = 1", "-b", "task.eval_size = 32", "--quiet",
                "-b", f"ppo.init_from = '{ckpt}'", "--out", tmp_path / "full"])
    first = read_metrics(tmp_path / "next" / "metrics.jsonl")[0]
    assert first["eval/greedy_accuracy"] == read_metrics(lora_run / "metrics.jsonl")[-1]["eval/greedy_accuracy"]
    first = read_metrics(tmp_path / "full" / "metrics.jsonl")[0]
    assert first["eval/greedy_accuracy"] == read_metrics(lora_run / "metrics.jsonl")[-1]["eval/greedy_accuracy"]
    proc = run_train(["recipes/tiny.gin", "-b", "ppo.lora_rank = 4", "-b", "ppo.total_steps = 1", "--quiet",
                      "-b", f"ppo.init_from = '{ckpt}'", "--out", tmp_path / "bad"], check=False)
    assert proc.returncode == 2 and "ppo.lora_rank = 4 is invalid" in proc.stderr, proc.stderr[-1000:]


def test_killed_lora_run_resumes_to_identical_metrics(tmp_path):
    args = ["recipes/tiny.gin", *LORA, "-b", "ppo.total_steps = 8", "-b", "ppo.eval_every = 4",
            "-b", "ppo.save_every = 4", "-b", "task.eval_size = 32", "--quiet"]
    out = tmp_path / "killed"
    with meanwhile([*args, "--out", tmp_path / "whole"]):  # the uninterrupted run, beside the killed one
        kill_when(args, out, "step_4")
        assert not (out / "checkpoints" / "step_8").exists(), "the run finished before it could be killed"
        run_train([*args, "--out", out, "--resume"])
    assert (comparable(read_metrics(out / "metrics.jsonl"))
            == comparable(read_metrics(tmp_path / "whole" / "metrics.jsonl")))
    for name in ("actor/adapter_model.safetensors", "critic/adapter_model.safetensors", "actor_optim.safetensors"):
        a, b = (load_file(str(d / "checkpoints" / "step_8" / name)) for d in (out, tmp_path / "whole"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_metrics(tmp_path, lora):
    args = ["recipes/tiny.gin", *(LORA if lora else []), "-b", "ppo.total_steps = 3", "-b", "ppo.eval_every = 3",
            "-b", "task.eval_size = 32", "--quiet"]
    run_trains([*args, "--out", tmp_path / "plain"],
               [*args, "-b", "ppo.gradient_checkpointing = True", "--out", tmp_path / "ckpt"])
    a, b = (comparable(read_metrics(d / "metrics.jsonl")) for d in (tmp_path / "plain", tmp_path / "ckpt"))
    assert a == b


def test_gradient_checkpointing_recomputes_in_the_backward(model_dirs):
    """Checkpointing is really on: each decoder layer's forward runs twice per micro-batch."""
    model_dir, tok_dir, tok = model_dirs
    calls = []
    actor = Actor(CPU, lora_cfg(gradient_checkpointing=True), start_dir=str(model_dir), tokenizer_dir=str(tok_dir),
                  total_updates=4, model_dir=str(model_dir))
    mlp = actor.model.get_base_model().model.layers[0].mlp  # inside the checkpointed layer
    forward = mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)  # (hooks do not run in a recomputation)
    cfg = lora_cfg(gradient_checkpointing=True)
    assert cfg.mini_batch_size // cfg.micro_batch_size == 2
    actor.update(make_batch(tok, n=8), shuffle_seed=0, kl_coef=0.1)
    assert len(calls) == 2 * 2, "one forward and one recomputation per micro-batch"

"""The vLLM backend with a real engine on a GPU (skipped without CUDA and vLLM; bench/gpu_tests.sh
runs it on the lent H200), with the engine in this process and in its own: its batches follow the shared
response conversion, its seeds repeat, `sync_weights` reaches the engine, both processes sample the same
tokens, and a LoRA run on CUDA trains through it."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from rlhf.config import TinyModelConfig
from rlhf.metrics import read_metrics
from rlhf.rollout import SamplingParams
from rlhf.rollout.base import response_mask_from_ids
from rlhf.tiny import build_char_tokenizer, build_tiny_model
from tests.conftest import run_train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = ["1+2=", "3+4=", "15-7=", "9+9=", "20-3=", "6+1=", "2-8=", "11+11="]
SHAPE = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vLLM")
    root = tmp_path_factory.mktemp("vllm")
    tok = build_char_tokenizer(root / "tokenizer")  # its own folder: beside config.json vLLM misreads it
    states = {}
    for seed in (0, 1):
        build_tiny_model(SHAPE, tok, seed).save_pretrained(str(root / f"model{seed}"))
        states[seed] = build_tiny_model(SHAPE, tok, seed).state_dict()
    return root, tok, states


def build_engine(root, tok, own_process: bool, model_runner: str = "auto"):
    """An engine of the tiny model with a small share of the GPU (its KV cache needs megabytes): an engine
    in this process keeps its memory until the process ends, and the module builds five of them before
    the LoRA runs, which need room of their own."""
    from rlhf.rollout.vllm import VLLMRollout
    return VLLMRollout(tokenizer=tok, device=torch.device("cuda"), model_dir=str(root / "model0"), seed=0,
                       max_model_len=64, gpu_memory_utilization=0.05, enforce_eager=True, own_process=own_process,
                       model_runner=model_runner)


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "own_process"])
def engine(models, request):
    root, tok, states = models
    return tok, build_engine(root, tok, own_process=request.param), states


def sampling(temperature: float) -> SamplingParams:
    return SamplingParams(max_new_tokens=24, temperature=temperature, top_p=1.0, top_k=0, max_prompt_length=8,
                          truncation="left")


def test_a_vllm_batch_is_the_shared_conversion_of_its_tokens(engine):
    tok, rollout, _ = engine
    batch = rollout.generate(PROMPTS, sampling(1.0), seed=5)
    ids, mask = batch["response_ids"], batch["response_mask"]
    assert ids.shape == mask.shape == (len(PROMPTS), 24)
    expected_mask, finished = response_mask_from_ids(ids, tok.eos_token_id)
    assert torch.equal(mask, expected_mask) and torch.equal(batch["finished"], finished)
    assert (ids[mask == 0] == tok.pad_token_id).all()


def test_the_same_seed_repeats_and_another_differs(engine):
    _, rollout, _ = engine
    a, b = (rollout.generate(PROMPTS, sampling(1.0), seed=7) for _ in range(2))
    c = rollout.generate(PROMPTS, sampling(1.0), seed=8)
    assert torch.equal(a["response_ids"], b["response_ids"])
    assert not torch.equal(a["response_ids"], c["response_ids"])


def test_sync_weights_reaches_the_engine_and_back(engine):
    _, rollout, models = engine
    first = rollout.generate(PROMPTS, sampling(0.0), seed=0)["response_ids"]
    rollout.sync_weights(models[1])
    other = rollout.generate(PROMPTS, sampling(0.0), seed=0)["response_ids"]
    rollout.sync_weights(models[0])
    again = rollout.generate(PROMPTS, sampling(0.0), seed=0)["response_ids"]
    assert not torch.equal(first, other) and torch.equal(first, again)


def test_both_engine_processes_give_the_same_tokens(models):
    """The engine in its own process, seeded there and fed weights through the staging buffer, samples
    what the in-process engine samples: same seed, same weights, same tokens."""
    root, tok, states = models
    tokens = []
    for own_process in (False, True):
        rollout = build_engine(root, tok, own_process)
        rollout.sync_weights(states[1])
        tokens.append(rollout.generate(PROMPTS, sampling(1.0), seed=11)["response_ids"])
        del rollout
        gc.collect()  # an engine's own process ends with its client
    assert torch.equal(tokens[0], tokens[1])


@pytest.mark.parametrize("runner", ["auto", "v1", "v2"])
def test_each_model_runner_repeats_its_tokens_and_takes_synced_weights(models, runner):
    """`ppo.vllm_model_runner` as a recipe names it (the tiny model is a Llama, for which vLLM itself picks
    'v2'): the engine runs the runner the memory plan counts (`uses_runner_v2`), and either runner, in either
    process, repeats a seed's tokens and samples from synced weights. The first runner draws one noise
    tensor over the batch, so in its own process it repeats only when its first step sees the whole
    batch (`VLLMRollout._generate`)."""
    from rlhf.rollout.vllm import uses_runner_v2
    root, tok, states = models
    for own_process in (False, True):
        rollout = build_engine(root, tok, own_process, model_runner=runner)
        ran_v2 = rollout.llm.llm_engine.input_processor.use_v2_model_runner  # as the engine was built
        assert ran_v2 is uses_runner_v2(runner, ["LlamaForCausalLM"]), (runner, own_process)
        a, b = (rollout.generate(PROMPTS, sampling(1.0), seed=7)["response_ids"] for _ in range(2))
        greedy = rollout.generate(PROMPTS, sampling(0.0), seed=0)["response_ids"]
        rollout.sync_weights(states[1])
        other = rollout.generate(PROMPTS, sampling(0.0), seed=0)["response_ids"]
        assert torch.equal(a, b) and not torch.equal(greedy, other), (runner, own_process)
        del rollout
        gc.collect()


def test_vllms_own_choice_of_runner_is_the_one_the_plan_knows():
    """RUNNER_V2_ARCHITECTURES, which the memory plan uses without vLLM, is the installed vLLM's list."""
    pytest.importorskip("vllm", reason="needs vLLM")
    from vllm.config.vllm import DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES

    from rlhf.rollout.vllm import RUNNER_V2_ARCHITECTURES
    assert RUNNER_V2_ARCHITECTURES == DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES


@pytest.mark.parametrize("own_process", [False, True], ids=["in_process", "own_process"])
def test_a_lora_run_on_cuda_with_vllm_rollouts(tmp_path, own_process):
    """The tiny recipe with LoRA adapters on the GPU, vLLM sampling from the merged weights (in its own
    process: through the staging buffer): it runs, its numbers are finite, the KL starts at the
    reference's (the base, adapter off), and the checkpoint holds an adapter."""
    pytest.importorskip("vllm", reason="needs vLLM")
    run_train(["recipes/tiny.gin", "-b", "ppo.device = 'cuda'", "-b", "ppo.rollout_backend = 'vllm'",
               "-b", f"ppo.vllm_own_process = {own_process}",
               "-b", "ppo.lora_rank = 8", "-b", "ppo.actor_learning_rate = 1e-3", "-b", "ppo.total_steps = 3",
               "-b", "ppo.vllm_gpu_memory_utilization = 0.15", "-b", "task.eval_size = 32", "--quiet",
               "--out", tmp_path])
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    assert len(steps) == 3 and abs(steps[0]["kl_divergence"]) < 1e-3
    assert all(r["actor/grad_norm"] > 0 for r in steps)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    assert (tmp_path / "checkpoints" / "step_3" / "actor" / "adapter_config.json").is_file()

"""The vLLM backend's CPU-testable parts: vLLM outputs -> the rollout Batch, request building,
seeds, the log-prob gap, and the errors given before any engine starts. The engine itself runs on
a GPU (bench/gpu_rollout.py)."""

from __future__ import annotations

import os
import types

import pytest
import torch

from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.errors import ConfigError
from rlhf.rollout import SamplingParams, backend_class, derive_seed, rollout_logprob_gap
from rlhf.rollout.vllm import (
    VLLMRollout,
    batch_from_token_lists,
    engine_environment,
    environment_conflict,
    sampled_logprobs,
    uses_runner_v2,
)

EOS, PAD = 2, 0


def test_batch_cuts_after_eos_pads_and_flags_finished():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    batch = batch_from_token_lists(prompt_ids, prompt_mask, [[11, EOS, 12], [13, 14, 15, 16]], max_new_tokens=4,
                                   eos_token_id=EOS, pad_token_id=PAD,
                                   logprobs=[[-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0, -4.0]])
    assert batch["response_ids"].tolist() == [[11, EOS, PAD, PAD], [13, 14, 15, 16]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["finished"].tolist() == [True, False]
    assert torch.allclose(batch["rollout_logprobs"], torch.tensor([[-0.1, -0.2, 0, 0], [-1.0, -2.0, -3.0, -4.0]]))
    assert batch["prompt_ids"] is prompt_ids and batch["prompt_mask"] is prompt_mask


def test_batch_handles_empty_and_overlong_responses_without_logprobs():
    batch = batch_from_token_lists(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                                   [[], [3, 4, 5, 6, 7]], max_new_tokens=3, eos_token_id=EOS, pad_token_id=PAD)
    assert batch["response_ids"].tolist() == [[PAD] * 3, [3, 4, 5]]
    assert batch["response_mask"].tolist() == [[0, 0, 0], [1, 1, 1]]
    assert batch["finished"].tolist() == [False, False]
    assert "rollout_logprobs" not in batch


def test_sampled_logprobs_reads_the_sampled_token_at_each_position():
    lp = types.SimpleNamespace
    positions = [{4: lp(logprob=-0.5), 9: lp(logprob=-3.0)}, {7: lp(logprob=-1.5)}]
    assert sampled_logprobs([4, 7], positions) == [-0.5, -1.5]


def test_logprob_gap_is_the_masked_mean_absolute_difference():
    batch = Batch({"response_mask": torch.tensor([[1, 1, 0]]),
                   "rollout_logprobs": torch.tensor([[-1.0, -2.0, 0.0]]),
                   "old_logprobs": torch.tensor([[-1.5, -1.0, -9.0]])})
    assert rollout_logprob_gap(batch) == pytest.approx(0.75)
    del batch.tensors["rollout_logprobs"]
    assert rollout_logprob_gap(batch) is None


def test_rollout_logprobs_needs_the_vllm_backend(monkeypatch):
    with pytest.raises(ConfigError, match="ppo.rollout_logprobs"):
        PPOConfig(rollout_logprobs=True)
    cfg = PPOConfig(rollout_backend="vllm", rollout_logprobs=True, vllm_sleep=False)
    built = {}
    monkeypatch.setattr(VLLMRollout, "__init__", lambda self, **kwargs: built.update(kwargs))
    assert backend_class("vllm") is VLLMRollout
    VLLMRollout.from_config(cfg, model=None, tokenizer=None, device=torch.device("cuda"), model_dir="m")
    assert {k: built[k] for k in ("return_logprobs", "gpu_memory_utilization", "sleep", "per_request_seeds",
                                  "max_model_len", "seed", "model_dir")} == dict(
        return_logprobs=True, gpu_memory_utilization=0.3, sleep=False, per_request_seeds=False,
        max_model_len=cfg.max_prompt_length + cfg.max_response_length, seed=cfg.seed, model_dir="m")
    with pytest.raises(ConfigError, match="vllm_gpu_memory_utilization"):
        PPOConfig(vllm_gpu_memory_utilization=1.5)


def test_vllm_backend_on_cpu_fails_before_importing_vllm():
    with pytest.raises(ConfigError, match="rollout_backend = 'vllm'"):
        VLLMRollout(tokenizer=None, device=torch.device("cpu"), model_dir="x", seed=0, max_model_len=16)


class FakeLLM:
    """Records what VLLMRollout asks for and answers like vllm.LLM: `generate`, or `enqueue` then
    `wait_for_completion`; the calls that reach the engine, in order, in `events`."""

    def __init__(self):
        self.calls, self.resets, self.rpcs, self.events, self.queued = [], 0, [], [], []

    def sleep(self, level=1, mode="abort"):
        self.events.append(("sleep", level, mode))

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tags))

    def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        self.events.append(("rpc", method))
        return [None]

    def reset_prefix_cache(self):
        self.resets += 1

    @staticmethod
    def outputs(requests):
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[r["prompt_token_ids"][-1] + 1, EOS],
                                                                     logprobs=None)]) for r in requests]

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append((requests, params))
        self.events.append(("generate", len(requests)))
        return self.outputs(requests)

    def enqueue(self, requests, params, use_tqdm=True):
        self.calls.append((requests, params))
        self.events.append(("enqueue", len(requests)))
        self.queued += requests

    def wait_for_completion(self, use_tqdm=True):
        self.events.append(("wait", len(self.queued)))
        requests, self.queued = self.queued, []
        return self.outputs(requests)


class FakeTokenizer:
    eos_token_id, pad_token_id = EOS, PAD

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [10 + int(c) for c in text]}


def fake_rollout(per_request_seeds: bool, own_process: bool = False) -> VLLMRollout:
    rollout = VLLMRollout.__new__(VLLMRollout)
    rollout.__dict__.update(
        _vllm=types.SimpleNamespace(SamplingParams=lambda **kw: kw), tokenizer=FakeTokenizer(),
        device=torch.device("cpu"), return_logprobs=False, sleep_between_rollouts=False,
        per_request_seeds=per_request_seeds, own_process=own_process, asleep=False, timings={}, llm=FakeLLM())
    return rollout


def test_generate_sends_unpadded_token_ids_with_per_request_seeds():
    rollout = fake_rollout(per_request_seeds=True)
    sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=4, temperature=0.7, top_p=0.9, top_k=5,
                                                  max_prompt_length=8))
    batch = rollout.generate(["12", "345"], sampling, seed=99)
    requests, params = rollout.llm.calls[0]
    assert requests == [{"prompt_token_ids": [11, 12]}, {"prompt_token_ids": [13, 14, 15]}]
    assert [p["seed"] for p in params] == [derive_seed(99, 0), derive_seed(99, 1)]
    assert params[0]["temperature"] == 0.7 and params[0]["top_p"] == 0.9 and params[0]["top_k"] == 5
    assert params[0]["ignore_eos"] and params[0]["stop_token_ids"] == [EOS] and params[0]["max_tokens"] == 4
    assert batch["prompt_ids"].tolist() == [[PAD, 11, 12], [13, 14, 15]]
    assert batch["response_ids"].tolist() == [[13, EOS, PAD, PAD], [16, EOS, PAD, PAD]]
    assert batch["finished"].all() and rollout.llm.resets == 1


def test_generate_greedy_and_per_call_seed_send_one_unseeded_params():
    rollout = fake_rollout(per_request_seeds=False)
    rollout.generate(["1"], SamplingParams.from_ppo(PPOConfig(max_response_length=2)), seed=5)
    _, params = rollout.llm.calls[0]
    assert isinstance(params, dict) and params["seed"] is None
    rollout = fake_rollout(per_request_seeds=True)
    rollout.generate(["1"], SamplingParams.from_ppo(PPOConfig(max_response_length=2, top_k=3), temperature=0.0), seed=5)
    _, params = rollout.llm.calls[0]
    assert params["temperature"] == 0.0 and params["top_k"] == 0 and params["seed"] is None


# ---------------------------------------------------------------- the engine in its own process
def test_own_process_needs_the_vllm_backend_and_reaches_the_backend(monkeypatch):
    with pytest.raises(ConfigError, match="ppo.vllm_own_process"):
        PPOConfig(vllm_own_process=True)
    with pytest.raises(ConfigError, match="ppo.vllm_own_process"):
        PPOConfig(rollout_backend="vllm", vllm_own_process="yes")
    built = {}
    monkeypatch.setattr(VLLMRollout, "__init__", lambda self, **kwargs: built.update(kwargs))
    VLLMRollout.from_config(PPOConfig(rollout_backend="vllm", vllm_own_process=True), model=None, tokenizer=None,
                            device=torch.device("cuda"), model_dir="m")
    assert built["own_process"] is True


def test_the_model_runner_is_checked_and_reaches_the_backend(monkeypatch):
    with pytest.raises(ConfigError, match=r"ppo.vllm_model_runner.*'auto', 'v1', 'v2'"):
        PPOConfig(rollout_backend="vllm", vllm_model_runner="v3")
    assert PPOConfig(vllm_model_runner="v2").rollout_backend == "hf"  # a recipe's runner, unused by HF rollouts
    built = {}
    monkeypatch.setattr(VLLMRollout, "__init__", lambda self, **kwargs: built.update(kwargs))
    VLLMRollout.from_config(PPOConfig(rollout_backend="vllm", vllm_model_runner="v2"), model=None, tokenizer=None,
                            device=torch.device("cuda"), model_dir="m")
    assert built["model_runner"] == "v2"


@pytest.mark.parametrize("own, environ, refused", [
    (False, {}, False), (False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, False),
    (False, {"VLLM_ENABLE_V1_MULTIPROCESSING": " 0 "}, False),
    (False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, True), (False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "true"}, True),
    (True, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, False), (True, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, False)])
def test_an_environment_that_contradicts_the_engine_placement_is_named(own, environ, refused):
    conflict = environment_conflict(own, "auto", environ)
    assert (conflict is not None) == refused
    if refused:
        assert conflict.startswith("ppo.vllm_own_process = False is invalid with VLLM_ENABLE_V1_MULTIPROCESSING=")


@pytest.mark.parametrize("runner, value, refused", [
    ("auto", None, False), ("auto", "1", False), ("auto", "0", False),
    ("v2", None, False), ("v2", "1", False), ("v2", " True ", False), ("v2", "0", True), ("v2", "false", True),
    ("v1", "0", False), ("v1", "", False), ("v1", "1", True)])
def test_an_environment_that_names_the_other_model_runner_is_named(runner, value, refused):
    environ = {} if value is None else {"VLLM_USE_V2_MODEL_RUNNER": value}
    conflict = environment_conflict(True, runner, environ)
    assert (conflict is not None) == refused
    if refused:
        assert conflict.startswith(f"ppo.vllm_model_runner = {runner!r} is invalid with VLLM_USE_V2_MODEL_RUNNER=")
        assert "set ppo.vllm_model_runner = 'auto'" in conflict


@pytest.mark.parametrize("runner, architectures, environ, v2", [
    ("v2", ["Qwen2ForCausalLM"], {}, True), ("v1", ["LlamaForCausalLM"], {}, False),
    ("v1", ["Qwen2ForCausalLM"], {"VLLM_USE_V2_MODEL_RUNNER": "1"}, False),  # a named runner is what vLLM gets
    ("auto", ["Qwen2ForCausalLM"], {}, False), ("auto", ["LlamaForCausalLM"], {}, True),
    ("auto", ["MistralForCausalLM"], {}, True), ("auto", ["Qwen3ForCausalLM"], {}, True),
    ("auto", ["Phi3ForCausalLM"], {}, False), ("auto", [], {}, False),
    ("auto", ["LlamaForCausalLM"], {"VLLM_USE_V2_MODEL_RUNNER": "0"}, False),
    ("auto", ["Qwen2ForCausalLM"], {"VLLM_USE_V2_MODEL_RUNNER": "1"}, True),
    ("auto", ["LlamaForCausalLM"], {"VLLM_USE_V2_MODEL_RUNNER": " "}, True)])
def test_the_runner_vllm_drives_a_model_with_is_known_before_it_starts(runner, architectures, environ, v2):
    """What the memory plan counts: the named runner; with 'auto', the environment's switch where it is set,
    else vLLM's own choice by the config's architecture."""
    assert uses_runner_v2(runner, architectures, environ) is v2


@pytest.mark.parametrize("own, runner, inside", [
    (False, "auto", {}), (True, "auto", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
    (False, "v2", {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    (True, "v1", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"})])
def test_the_engine_is_built_under_the_switches_the_recipe_asks_for_and_they_are_put_back(
        monkeypatch, own, runner, inside):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "user's")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with engine_environment(own, runner):
        for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):
            assert os.environ.get(name) == inside.get(name, {"VLLM_USE_V2_MODEL_RUNNER": "user's"}.get(name))
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "user's" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def tiny_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(7, 5, generator=gen).to(torch.bfloat16),  # an odd byte count
            "layer.bias": torch.randn(3, generator=gen),
            "layer.weight": torch.randn(5, 3, generator=gen).t(),  # not contiguous
            "scale": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 4),
            "big.weight": torch.randn(40, 8, generator=gen)}


@pytest.mark.parametrize("capacity", [64, 200, 4096])
def test_send_weights_round_trips_every_tensor_bucket_by_bucket(capacity):
    """What the trainer copies into the staging buffer is what the worker reads back: same names,
    dtypes, shapes and bytes, each at an aligned offset, whatever the buffer's size (a tensor larger
    than the buffer grows it; the buckets then follow its size)."""
    from rlhf.rollout.vllm_worker import ALIGN, send_weights, unpack
    state = tiny_state(0)
    received, grown, syncs = {}, [], []

    def grow(nbytes):
        grown.append(nbytes)
        box["buffer"] = torch.zeros(nbytes, dtype=torch.uint8)
        return box["buffer"]

    def load(entries):
        assert syncs and syncs[-1] == len(received)  # the copies were waited for before the read
        for name, dtype, shape, offset in entries:
            assert offset % ALIGN == 0
        for name, tensor in unpack(box["buffer"], entries):
            received[name] = tensor.clone()

    box = {"buffer": torch.zeros(capacity, dtype=torch.uint8)}
    buffer, buckets = send_weights(state.items(), box["buffer"], grow=grow, load=load,
                                   sync=lambda: syncs.append(len(received)))
    assert buffer is box["buffer"]
    assert list(received) == list(state)
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name
    expected, size = [], capacity  # each tensor larger than the buffer of its time grows it to its size
    for t in state.values():
        if t.numel() * t.element_size() > size:
            size = t.numel() * t.element_size()
            expected.append(size)
    assert grown == expected and buffer.numel() == size
    assert buckets == len(syncs) and (buckets == 1) == (capacity == 4096)


def test_the_worker_loads_a_bucket_by_hf_names_and_seeds_its_generators():
    """`EngineWorker`, as vLLM's worker inherits it: `rlhf_load` hands the bucket's views to the model's
    `load_weights` (the names and values sent), `rlhf_seed` makes the process's torch and numpy draws
    repeat."""
    import numpy as np

    from rlhf.rollout.vllm_worker import EngineWorker, send_weights

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.loaded = {}

        def load_weights(self, weights):
            for name, tensor in weights:
                self.loaded[name] = tensor.clone()

    worker = EngineWorker()
    worker.model_runner = types.SimpleNamespace(model=Model())
    worker.rlhf_buffer = torch.zeros(1024, dtype=torch.uint8)
    state = {k: v for k, v in tiny_state(1).items() if k != "big.weight"}
    send_weights(state.items(), worker.rlhf_buffer, grow=pytest.fail, load=lambda e: worker.rlhf_load(e))
    loaded = worker.model_runner.model.loaded
    assert list(loaded) == list(state) and all(torch.equal(loaded[k], state[k]) for k in state)

    draws = []
    for _ in range(2):
        worker.rlhf_seed(2**40 + 3)
        draws.append((torch.rand(3).tolist(), np.random.randint(0, 2**31, size=3).tolist()))
    assert draws[0] == draws[1]


def test_an_engine_of_its_own_process_is_seeded_there_once_per_rollout():
    """Per-call seeds reach the engine's process by `rlhf_seed` before the requests (one unseeded
    params for all); per-request seeds travel in the requests as in-process."""
    rollout = fake_rollout(per_request_seeds=False, own_process=True)
    sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=2))
    rollout.generate_calls([(["1"], 41), (["2"], 42)], sampling)
    assert rollout.llm.rpcs == [("rlhf_seed", (41,))]
    requests, params = rollout.llm.calls[0]
    assert len(requests) == 2 and isinstance(params, dict) and params["seed"] is None
    rollout = fake_rollout(per_request_seeds=True, own_process=True)
    rollout.generate(["1", "2"], sampling, seed=7)
    assert rollout.llm.rpcs == [] and [p["seed"] for p in rollout.llm.calls[0][1]] == [derive_seed(7, 0),
                                                                                     derive_seed(7, 1)]


@pytest.mark.parametrize("per_request_seeds", [False, True])
def test_an_engine_of_its_own_process_starts_from_the_whole_batch(per_request_seeds):
    """Its scheduler is held while every request of the rollout is queued and released after (it would
    otherwise step on the first arrivals, and the batches would follow timing); the outputs come back in
    request order; a failing enqueue still releases it. In this process the engine runs one generate."""
    sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=2))
    rollout = fake_rollout(per_request_seeds=per_request_seeds, own_process=True)
    batches = rollout.generate_calls([(["12", "3"], 41), (["45"], 42)], sampling)
    seeding = [] if per_request_seeds else [("rpc", "rlhf_seed")]
    assert rollout.llm.events == [*seeding, ("sleep", 0, "keep"), ("enqueue", 3), ("wake_up", ["scheduling"]),
                                  ("wait", 3)]
    assert [b["response_ids"][:, 0].tolist() for b in batches] == [[13, 14], [16]]
    rollout.llm.events.clear()
    rollout.llm.enqueue = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        rollout.generate(["1"], sampling, seed=3)
    assert rollout.llm.events[-2:] == [("sleep", 0, "keep"), ("wake_up", ["scheduling"])]
    rollout = fake_rollout(per_request_seeds=per_request_seeds)
    rollout.generate(["1", "2"], sampling, seed=7)
    assert rollout.llm.events == [("generate", 2)]

"""The vLLM backend's CPU-testable parts: vLLM outputs -> the rollout Batch, request building,
seeds, the log-prob gap, and the errors given before any engine starts. The engine itself runs on
a GPU (bench/gpu_rollout.py)."""

from __future__ import annotations

import types

import pytest
import torch

from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.errors import ConfigError
from rlhf.rollout import SamplingParams, backend_class, derive_seed, rollout_logprob_gap
from rlhf.rollout.vllm import VLLMRollout, batch_from_token_lists, sampled_logprobs

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
    """Records what VLLMRollout asks for and answers like vllm.LLM.generate."""

    def __init__(self):
        self.calls, self.resets = [], 0

    def reset_prefix_cache(self):
        self.resets += 1

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append((requests, params))
        outs = []
        for r in requests:
            tokens = [r["prompt_token_ids"][-1] + 1, EOS]
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens, logprobs=None)]))
        return outs


class FakeTokenizer:
    eos_token_id, pad_token_id = EOS, PAD

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [10 + int(c) for c in text]}


def fake_rollout(per_request_seeds: bool) -> VLLMRollout:
    rollout = VLLMRollout.__new__(VLLMRollout)
    rollout.__dict__.update(
        _vllm=types.SimpleNamespace(SamplingParams=lambda **kw: kw), tokenizer=FakeTokenizer(),
        device=torch.device("cpu"), return_logprobs=False, sleep_between_rollouts=False,
        per_request_seeds=per_request_seeds, asleep=False, timings={}, llm=FakeLLM())
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

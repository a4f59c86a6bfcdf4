"""Rollout backends behind one interface.

`RolloutBackend.generate(prompts, sampling, seed)` returns a `Batch` with left-padded
`prompt_ids`/`prompt_mask` [B, P], right-padded `response_ids`/`response_mask` [B, R]
(R = max_new_tokens; the mask covers tokens up to and including EOS) and `finished` [B]
(False when the response hit R without EOS); a backend may add `rollout_logprobs` [B, R] (its
sampling log-probs, 0 past the mask). `sync_weights(model)` loads the trainer's new weights (an
HF-named module); the HF backend shares the actor's module, so it has nothing to copy.
`release_memory()` lets a backend free what it holds between rollouts (vLLM: sleep mode).
"""

from __future__ import annotations

import dataclasses
from typing import List, Protocol, Sequence

import numpy as np
import torch

from rlhf.batch import Batch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_length: int = 1024

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def derive_seed(*parts: int) -> int:
    """A well-mixed 31-bit seed from integers (run seed, step, call index, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def encode_prompts(tokenizer, prompts: Sequence[str], max_prompt_length: int):
    """Left-padded prompt ids and mask; prompts longer than the limit keep their last tokens."""
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"][-max_prompt_length:] for p in prompts]
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            out[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
    return out, mask


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int):
    """Mask of tokens up to and including the first EOS, and whether an EOS was produced."""
    is_eos = response_ids == eos_token_id
    finished = is_eos.any(-1)
    # Tokens after the first EOS: the count of EOS strictly before position t is > 0.
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    mask = (eos_before == 0).long()
    return mask, finished


class RolloutBackend(Protocol):
    def generate(self, prompts: Sequence[str], sampling: SamplingParams, seed: int) -> Batch: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    def release_memory(self) -> None: ...


class HFRollout:
    """transformers `generate` on the actor's own module (left padding, KV cache).

    With `autocast_dtype` (bf16 on a GPU) generation runs under autocast like the trainer's
    forwards; without it an fp32 module would also generate in fp32, several times slower."""

    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device, autocast_dtype=None):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.autocast_dtype = autocast_dtype

    def sync_weights(self, model: torch.nn.Module) -> None:  # shares the trainer's module
        return None

    def release_memory(self) -> None:  # holds nothing of its own
        return None

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], sampling: SamplingParams, seed: int) -> Batch:
        tok = self.tokenizer
        prompt_ids, prompt_mask = encode_prompts(tok, prompts, sampling.max_prompt_length)
        kwargs = dict(do_sample=False) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        was_training = self.model.training
        self.model.eval()
        gen_device = self.device
        # force_eager: layers compiled for training (ppo.torch_compile) would recompile at every KV-cache step.
        autocast = torch.autocast(device_type=gen_device.type, dtype=self.autocast_dtype,
                                  enabled=self.autocast_dtype is not None)
        with torch.random.fork_rng(devices=[gen_device] if gen_device.type == "cuda" else []), \
                torch.compiler.set_stance("force_eager"), autocast:
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=prompt_ids.to(gen_device), attention_mask=prompt_mask.to(gen_device),
                max_new_tokens=sampling.max_new_tokens, min_new_tokens=0,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                use_cache=True, **kwargs)
        self.model.train(was_training)
        response = out[:, prompt_ids.shape[1]:].cpu()
        if response.shape[1] < sampling.max_new_tokens:  # every sequence stopped early
            pad = torch.full((response.shape[0], sampling.max_new_tokens - response.shape[1]),
                             tok.pad_token_id, dtype=response.dtype)
            response = torch.cat([response, pad], 1)
        mask, finished = response_mask_from_ids(response, tok.eos_token_id)
        response = torch.where(mask.bool(), response, torch.full_like(response, tok.pad_token_id))
        return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                      "response_ids": response, "response_mask": mask, "finished": finished})


def decode_responses(tokenizer, batch: Batch) -> List[str]:
    """Response text without the EOS and padding."""
    out = []
    for ids, mask in zip(batch["response_ids"], batch["response_mask"]):
        toks = ids[mask.bool()].tolist()
        if toks and toks[-1] == tokenizer.eos_token_id:
            toks = toks[:-1]
        out.append(tokenizer.decode(toks, skip_special_tokens=True))
    return out


def rollout_logprob_gap(batch: Batch) -> float | None:
    """Mean |rollout log-prob - trainer old log-prob| over response tokens, or None when the
    backend returned no sampling log-probs (`ppo.rollout_logprobs`)."""
    if "rollout_logprobs" not in batch or "old_logprobs" not in batch:
        return None
    mask = batch["response_mask"].float()
    gap = (batch["rollout_logprobs"].float() - batch["old_logprobs"].float()).abs() * mask
    return float(gap.sum() / mask.sum().clamp(min=1))


def rollout_options(ppo, device: torch.device) -> dict:
    """The backend-specific keyword arguments of `build_rollout`, from the run's PPOConfig."""
    if ppo.rollout_backend == "vllm":
        return dict(return_logprobs=ppo.rollout_logprobs, gpu_memory_utilization=ppo.vllm_gpu_memory_utilization,
                    sleep=ppo.vllm_sleep, per_request_seeds=ppo.vllm_per_request_seeds)
    use_bf16 = ppo.dtype == "bfloat16" and torch.device(device).type == "cuda"
    return dict(autocast_dtype=torch.bfloat16 if use_bf16 else None)


def build_rollout(backend: str, model, tokenizer, device, **kwargs) -> RolloutBackend:
    if backend == "hf":
        return HFRollout(model, tokenizer, device, autocast_dtype=kwargs.get("autocast_dtype"))
    if backend == "vllm":
        from rlhf.rollout_vllm import VLLMRollout  # optional dependency, GPU only
        return VLLMRollout(tokenizer=tokenizer, device=device, **kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}")

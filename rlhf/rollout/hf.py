"""The default rollout backend: transformers `generate` on the actor's own module."""

from __future__ import annotations

from typing import List, Sequence

import torch

from rlhf.batch import Batch
from rlhf.rollout.base import SamplingParams, encode_prompts, response_batch


class HFRollout:
    """transformers `generate` on the actor's own module (left padding, KV cache).

    With `autocast_dtype` (bf16 on a GPU) generation runs under autocast like the trainer's
    forwards; without it an fp32 module would also generate in fp32, several times slower."""

    shares_module = True

    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device, autocast_dtype=None):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.autocast_dtype = autocast_dtype

    @classmethod
    def from_config(cls, ppo, *, model, tokenizer, device, model_dir: str, log=print) -> "HFRollout":
        use_bf16 = ppo.dtype == "bfloat16" and torch.device(device).type == "cuda"
        return cls(model, tokenizer, torch.device(device), autocast_dtype=torch.bfloat16 if use_bf16 else None)

    def sync_weights(self, model) -> None:  # shares the trainer's module
        return None

    def release_memory(self) -> None:  # holds nothing of its own
        return None

    def set_sleep(self, enabled: bool) -> None:
        return None

    def asleep_bytes(self) -> int:
        return 0

    def generate_calls(self, requests: Sequence[tuple], sampling: SamplingParams) -> List[Batch]:
        """One `generate` per (prompts, seed), in turn."""
        return [self.generate(prompts, sampling, seed) for prompts, seed in requests]

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], sampling: SamplingParams, seed: int) -> Batch:
        tok = self.tokenizer
        prompt_ids, prompt_mask = encode_prompts(tok, prompts, sampling.max_prompt_length, sampling.truncation)
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
            out = self.model.generate(  # pyright: ignore[reportCallIssue]  # a transformers model's generate
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
        return response_batch(prompt_ids, prompt_mask, response, tok.eos_token_id, tok.pad_token_id)

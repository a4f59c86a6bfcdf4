"""Rollout backends as a package: the interface (`base`), the HF `generate` backend (`hf`,
the default and the CPU path) and vLLM (`vllm`, GPU only, an optional dependency imported only
when that backend is built). A backend is found by name in `BACKENDS`."""

from __future__ import annotations

import importlib

from rlhf.rollout.base import (
    RolloutBackend,
    SamplingParams,
    SeedStream,
    decode_responses,
    derive_seed,
    encode_prompts,
    response_mask_from_ids,
    rollout_logprob_gap,
)

BACKENDS = {"hf": "rlhf.rollout.hf:HFRollout", "vllm": "rlhf.rollout.vllm:VLLMRollout"}
"""`ppo.rollout_backend` name -> "module:class" of a `RolloutBackend`."""


def backend_class(name: str) -> type:
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; registered: {', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["BACKENDS", "RolloutBackend", "SamplingParams", "SeedStream", "backend_class", "decode_responses",
           "derive_seed", "encode_prompts", "response_mask_from_ids", "rollout_logprob_gap"]

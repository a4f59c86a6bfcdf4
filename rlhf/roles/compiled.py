"""GPU speed-ups that leave the computed function unchanged: compiled decoder layers and a
fused log-prob/entropy over the vocabulary (`ppo.torch_compile`).

Why: a narrow model (hidden 896) spends much of a step in small elementwise kernels (RMSNorm,
rotary, SiLU-gate, residuals) and in passes over [B, R, V] logits (V ~ 152k); torch.compile
fuses both. Layers are compiled one by one (as torchtitan does): every layer reuses one compiled
graph, the embedding/mask code stays eager, and FSDP2-wrapped layers compile the same way.
The CPU path never compiles, so CPU results are bit-for-bit those of the eager code.
"""

from __future__ import annotations

import functools

import torch

from rlhf import algos


def decoder_layers(model: torch.nn.Module) -> list:
    """The transformer blocks of an HF causal LM or value model (the `ModuleList` of `*DecoderLayer`s)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and \
                type(module[0]).__name__.endswith(("DecoderLayer", "Block")):
            return list(module)
    return []


def compile_layers(model: torch.nn.Module) -> int:
    """Compiles each decoder layer in place; returns how many. Generation must run under
    `torch.compiler.set_stance('force_eager')` (the KV-cache path would recompile every step)."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def _logprobs_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
    logits = logits.float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return out, ent


@functools.lru_cache(maxsize=None)
def _compiled_logprobs_entropy():
    return torch.compile(_logprobs_entropy, dynamic=True)


def logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                         with_entropy: bool = True, fused: bool = False):
    """log p(tokens) [B, T] and the entropy [B, T] (or None) of `logits` [B, T, V] / temperature.

    `fused` runs one compiled kernel pair over the vocabulary instead of materialising fp32
    logits and log-softmax twice; the eager path is exactly `algos.logprobs_from_logits` and
    `algos.entropy_from_logits`."""
    if fused:
        return _compiled_logprobs_entropy()(logits, tokens, float(temperature or 1.0), with_entropy)
    logits = logits.float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logprobs = algos.logprobs_from_logits(logits, tokens)
    return logprobs, (algos.entropy_from_logits(logits) if with_entropy else None)

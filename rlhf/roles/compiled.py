"""GPU speed-ups that leave the computed function unchanged: compiled decoder layers and a
fused log-prob/entropy over the vocabulary (`ppo.torch_compile`), and LoRA adapters added by one
matmul into their base layer's output (`fuse_lora`, every LoRA run on a GPU).

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


RECOMPILE_LIMIT = 32
"""Compiled graphs a decoder layer's forward may have (Dynamo's `recompile_limit`)."""


def compile_layers(model: torch.nn.Module) -> int:
    """Compiles each decoder layer in place; returns how many. Generation must run under
    `torch.compiler.set_stance('force_eager')` (the KV-cache path would recompile every step)."""
    layers = decoder_layers(model)
    # One layer class serves every role (the actor with and without its adapter, the critic's backbone),
    # with and without gradients, first at the first micro-batch's token count and then with that count
    # dynamic: more graphs than Dynamo's default limit of 8 per function, past which it runs eagerly.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
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


def fuse_lora(model: torch.nn.Module) -> int:
    """Each peft LoRA linear of `model` adds its adapter with one matmul into the base layer's output,
    `addmm(base(x), A(x), B^T, alpha=scaling)`, instead of peft's `base(x) + B(A(x)) * scaling`; returns how
    many. The maths is the same (one rounding of the sum instead of three under bf16 autocast). peft's
    way costs, at every adapted layer, a copy of the input in the adapters' fp32 and, over the output
    ([tokens, out_features]), B's own result, the scaled copy and the sum: at 7B with 'all-linear'
    adapters about a quarter of a forward pass (bench/results/gpu_h200.md). A layer with its adapter
    switched off (the reference pass), merged, with a DoRA-style variant or a LoRA bias runs peft's own
    forward. Used on a GPU only: CPU runs keep peft's arithmetic bit for bit."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.forward = functools.partial(_fused_lora_forward, module)  # pyright: ignore[reportAttributeAccessIssue]
            count += 1
    return count


def _fused_lora_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapters = [name for name in layer.active_adapters if name in layer.lora_A]
    if (layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None or not adapters
            or any(name in layer.lora_variant or layer.lora_bias.get(name, False) for name in adapters)):
        return type(layer).forward(layer, x, *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    shape = result.shape
    for name in adapters:
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        xa = torch.nn.functional.linear(layer.lora_dropout[name](x), a)
        result = torch.addmm(result.reshape(-1, shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t(),
                             alpha=layer.scaling[name]).view(shape)
    return result

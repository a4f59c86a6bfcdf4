"""GPU speed-ups that leave the computed function unchanged: compiled decoder layers and a
fused log-prob/entropy over the vocabulary (`ppo.torch_compile`), and LoRA adapters added by one
matmul by their merged weight (`fuse_lora`, every LoRA run on a GPU).

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


LORA_FORWARDS = ("merged", "addmm")
"""How `fuse_lora` adds an adapter: "merged" (the default) multiplies by the merged weight W + s B A
(`_MergedLoRA`), "addmm" adds x A^T B^T into the base layer's output with one matmul."""


def fuse_lora(model: torch.nn.Module, mode: str = "merged") -> int:
    """Each peft LoRA linear of `model` runs one of the `LORA_FORWARDS` instead of peft's
    `base(x) + B(A(x)) * scaling`; returns how many. The maths is peft's function; only the roundings
    differ. peft's way costs, at every adapted layer, a copy of the input in the adapters' fp32 and,
    over the output ([tokens, out_features]), B's own result, the scaled copy and the sum: at 7B with
    'all-linear' adapters about a quarter of a forward pass (bench/results/gpu_h200.md).

    - "merged": y = x (W + s B A)^T + bias, one matmul at the base layer's cost. The merged weight
      ([out, in], built by one rank-r addmm) is a temporary of one layer at a time, rebuilt in the
      backward rather than kept; the adapters' gradients come from x A^T and dy B ([tokens, r]).
      Nothing of size [tokens, out] or [tokens, in] is added to the base layer's own work.
    - "addmm": `addmm(base(x), A(x), B^T, alpha=scaling)`: the base matmul, then a pass over the
      output to add the adapter, and in the backward a second [tokens, in] gradient summed into x's.

    Each such layer becomes an instance of one subclass of peft's layer (`fused_lora_class`), whose
    forward is that mode's: one function for every layer, so that decoder layers compiled one by one
    (`compile_layers`) share their graphs. A forward bound per layer (a closure, a partial) would be an
    object Dynamo guards on by identity: one graph per decoder layer and state, past
    `RECOMPILE_LIMIT` at 28 layers, after which every layer runs eagerly.

    A layer with its adapter switched off (the reference pass), merged, with a DoRA-style variant,
    a LoRA bias, or (merged mode) dropout or a base layer that trains runs peft's own forward, as does
    a subclass of peft's layer that is not one of these (its own forward is kept). Used on a GPU only:
    CPU runs keep peft's arithmetic bit for bit."""
    if mode not in LORA_FORWARDS:
        raise ValueError(f"LoRA forward {mode!r}: one of {LORA_FORWARDS}")
    from peft.tuners.lora.layer import Linear as LoraLinear
    fused = fused_lora_class(mode)
    count = 0
    for module in model.modules():
        if type(module) is LoraLinear or (isinstance(module, LoraLinear) and hasattr(type(module), "lora_forward")):
            module.__class__ = fused  # peft's own class, or a fused one (of either mode)
            count += 1
    return count


def fused_lora_class(mode: str) -> type:
    """peft's LoRA `Linear` with the forward of `mode` (one of `LORA_FORWARDS`); one class per mode,
    defined in this module (the name pickle finds it under) on first use."""
    name = f"{mode.capitalize()}LoraLinear"
    cls = globals().get(name)
    if cls is None:
        from peft.tuners.lora.layer import Linear as LoraLinear
        forward = _merged_lora_forward if mode == "merged" else _addmm_lora_forward
        cls = type(name, (LoraLinear,), {"forward": forward, "lora_forward": mode, "__module__": __name__,
                                          "__doc__": f"peft's LoRA Linear, adapters added the {mode!r} way."})
        globals()[name] = cls
    return cls


def _peft_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's own LoRA forward for a layer whose class `fuse_lora` replaced."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    return LoraLinear.forward(layer, x, *args, **kwargs)


def _fused_adapters(layer, kwargs) -> list | None:
    """The active adapters a fused forward may compute, or None where peft's own forward must run."""
    adapters = [name for name in layer.active_adapters if name in layer.lora_A]
    if (layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None or not adapters
            or any(name in layer.lora_variant or layer.lora_bias.get(name, False) for name in adapters)):
        return None
    return adapters


def _addmm_lora_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapters = _fused_adapters(layer, kwargs)
    if adapters is None:
        return _peft_forward(layer, x, *args, **kwargs)
    result = layer.base_layer(x, *args, **kwargs)
    shape = result.shape
    for name in adapters:
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        xa = torch.nn.functional.linear(layer.lora_dropout[name](x), a)
        result = torch.addmm(result.reshape(-1, shape[-1]), xa.reshape(-1, xa.shape[-1]), b.t(),
                             alpha=layer.scaling[name]).view(shape)
    return result


def _merged_lora_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapters = _fused_adapters(layer, kwargs)
    base = layer.base_layer
    if (adapters is None or len(adapters) != 1 or args or kwargs or type(base) is not torch.nn.Linear
            or not isinstance(layer.lora_dropout[adapters[0]], torch.nn.Identity)
            or any(p.requires_grad for p in base.parameters())):  # `_MergedLoRA` trains the adapter only
        return _peft_forward(layer, x, *args, **kwargs)
    name = adapters[0]
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    weight, a, b = base.weight, layer.lora_A[name].weight, layer.lora_B[name].weight
    bias = base.bias if base.bias is None else base.bias.to(dtype)
    scaling = float(layer.scaling[name])
    if not (torch.is_grad_enabled() and (x.requires_grad or a.requires_grad or b.requires_grad)):
        return torch.nn.functional.linear(x.to(dtype), _merged_weight(weight, a, b, scaling, dtype), bias)
    return _MergedLoRA.apply(x.to(dtype), weight, bias, a, b, scaling)


def _merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """W + scaling B A in `dtype` ([out, in]; the rank-r product accumulates in fp32)."""
    return torch.addmm(weight.to(dtype), b.to(dtype), a.to(dtype), alpha=scaling)


class _MergedLoRA(torch.autograd.Function):
    """y = x (W + s B A)^T + bias for a frozen W and bias; gradients for x, A and B:
    dx = dy (W + s B A), dA = s (dy B)^T x, dB = s dy^T (x A^T). Saves x and x A^T (what peft's own
    adapter saves) and rebuilds the merged weight in the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling):
        flat = x.reshape(-1, x.shape[-1])
        dtype = x.dtype
        xa = flat @ a.to(dtype).t() if b.requires_grad else None
        out = torch.nn.functional.linear(flat, _merged_weight(weight, a, b, scaling, dtype), bias)
        ctx.save_for_backward(flat if a.requires_grad else None, xa, weight, a, b)
        ctx.scaling, ctx.shape = scaling, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # pyright: ignore[reportIncompatibleMethodOverride]
        flat, xa, weight, a, b = ctx.saved_tensors
        scaling = ctx.scaling
        dy = grad.reshape(-1, grad.shape[-1])
        dtype = dy.dtype
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ _merged_weight(weight, a, b, scaling, dtype)).view(ctx.shape)
        if ctx.needs_input_grad[3]:
            da = torch.mm((dy @ b.to(dtype)).t(), flat).mul_(scaling).to(a.dtype)
        if ctx.needs_input_grad[4]:
            db = torch.mm(dy.t(), xa).mul_(scaling).to(b.dtype)
        return dx, None, None, da, db, None

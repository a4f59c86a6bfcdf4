"""Attention over packed rows without a mask (`ppo.max_tokens_per_micro_batch`).

A packed row holds several sequences one after the other (rlhf/packing.py). Under transformers'
own sdpa a packed row gets a dense [T, T] block-diagonal mask: at a 16k-token budget that is a
256 MB mask, attention computed over the whole row (about T / sequence length times the work of
the sequences alone) and no flash kernel. Here each sequence attends only to itself:

- on a GPU in bf16/fp16: torch's variable-length flash attention (`torch.nn.attention.varlen`)
  over the row, told where each sequence starts (`cu_seq_lens`), forward and backward;
- elsewhere (the CPU, fp32): scaled dot-product attention on each sequence's span, causal.

The roles that run forwards (actor, critic, reference) switch their models to the implementation
`PACKED_SDPA` when they take them (`use_packed_attention`).
A forward without `packed_lengths` is transformers' sdpa exactly (padded rows with their mask,
generation with a KV cache), so nothing but packed rows changes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from rlhf.batch import to_device

PACKED_SDPA = "packed_sdpa"
"""The attention implementation of the engine's models: transformers' sdpa, and packed rows by span."""


def packed_kwargs(lengths: Sequence[int], device) -> dict:
    """What a packed row's forward passes to every attention layer: its sequences' lengths (host ints),
    and the cumulative offsets and longest length that the variable-length kernel reads."""
    lengths = tuple(int(n) for n in lengths)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = to_device(torch.tensor(offsets, dtype=torch.int32), device)
    return {"packed_lengths": lengths, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max(lengths), "max_length_k": max(lengths)}


def prepared_mask(model: torch.nn.Module, device) -> dict:
    """The `attention_mask` of a packed row's forward through `model`: for a model on `PACKED_SDPA`,
    which separates the sequences by their spans and reads no mask, a [1, 1, 1, 1] placeholder;
    for any other, none ({}), and transformers finds the sequences from the position ids.

    transformers returns a 4-D mask as it comes ("already prepared"). Given no mask, its preparation
    looks for packed sequences in the position ids and branches on what it finds
    (`find_packed_sequence_indices`): on a GPU the host then waits for every kernel queued before
    each forward."""
    from transformers import PreTrainedModel
    for module in model.modules():  # the first transformers model: the model itself, or the one a wrapper holds
        if isinstance(module, PreTrainedModel):
            if module.config._attn_implementation == PACKED_SDPA:
                return {"attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)}
            break
    return {}


@functools.lru_cache(maxsize=None)
def _varlen() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """(torch's varlen_attn, the keyword arguments its signature takes), or None where torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's on a GPU region (q/k come out of the rotary embedding
    in the residual stream's dtype, v in the projection's), else the query's."""
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return query.dtype


def varlen_attention(query, key, value, cu: torch.Tensor, max_length: int, scaling: float | None):
    """[1, H, T, D] query, [1, Hkv, T, D] key/value -> [1, T, H, D], each sequence causal over itself
    (flash variable-length kernel; GPU, bf16/fp16)."""
    found = _varlen()
    assert found is not None, "varlen_attention needs torch's varlen_attn (can_use_varlen checks it)"
    varlen_attn, params = found
    dtype = _compute_dtype(query)
    q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))  # [T, heads, D]
    extra = {}
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    if scaling is not None and "scale" in params:
        extra["scale"] = scaling
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu, cu, max_length, max_length, **extra)
    return out[None]


def span_attention(query, key, value, lengths: Sequence[int], scaling: float | None):
    """The same as `varlen_attention` by scaled dot-product attention on each sequence's span."""
    dtype = _compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    gqa = key.shape[1] != query.shape[1]
    outs, start = [], 0
    for n in lengths:
        end = start + n
        outs.append(F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end],
                                                   value[:, :, start:end], is_causal=True, scale=scaling,
                                                   enable_gqa=gqa))
        start = end
    return torch.cat(outs, dim=2).transpose(1, 2)


def can_use_varlen(query: torch.Tensor) -> bool:
    return (query.is_cuda and _varlen() is not None and _compute_dtype(query) in (torch.bfloat16, torch.float16)
            and query.shape[-1] <= 256)


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """transformers' attention interface: a packed row (`packed_lengths` given) by sequence, any other
    forward as transformers' sdpa computes it."""
    lengths = kwargs.pop("packed_lengths", None)
    cu = kwargs.pop("cu_seq_lens_q", None)
    max_length = kwargs.pop("max_length_q", None)
    for key_name in ("cu_seq_lens_k", "max_length_k"):
        kwargs.pop(key_name, None)
    if lengths is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # The shape check runs eagerly only: compiled (ppo.torch_compile), reading every length would make
    # the layer's graph guard on them and recompile for each micro-batch.
    if not torch.compiler.is_compiling() and (query.shape[0] != 1 or sum(lengths) != query.shape[2]):
        raise ValueError(f"a packed row is one row of sum(packed_lengths) tokens: got {tuple(query.shape)} "
                         f"for {len(lengths)} sequences of {sum(lengths)} tokens")
    if can_use_varlen(query):
        return varlen_attention(query, key, value, cu.to(query.device), int(max_length), scaling), None
    return span_attention(query, key, value, lengths, scaling), None


def packed_sdpa_mask(*args, attention_mask=None, **kwargs):
    """The mask for `PACKED_SDPA`: sdpa's for padded rows; none for a row without a padding mask (one
    causal sequence, or a packed row, whose sequences the attention separates by `packed_lengths`)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


@functools.lru_cache(maxsize=None)
def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
    return PACKED_SDPA


def use_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switches every transformers model inside `model` that runs sdpa to `PACKED_SDPA` (in place;
    nothing of it is saved in config.json). Models on another implementation are left as they are."""
    from transformers import PreTrainedModel
    name = register()
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation == "sdpa":
            module.config._attn_implementation = name
    return model

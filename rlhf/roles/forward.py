"""The forward passes the roles share: a phase's inputs moved to the device once, the policy's
log-probs and entropy of the response tokens (`response_logprobs`, with the LM head applied in
chunks) and the value model's values at the response positions (`response_values`). Each takes a
padded micro-batch or a packed one (rlhf/packing.py) and returns the padded [B, R] layout."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlhf.batch import Batch
from rlhf.models import position_ids_from_mask
from rlhf.packing import packed_row
from rlhf.roles.compiled import logprobs_and_entropy

FORWARD_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""What a forward pass over prompt + response reads from a batch."""


def on_device(batch: Batch, device, max_tokens: int, keys=FORWARD_KEYS) -> Batch:
    """The fields `keys` of `batch` (None: every tensor) on `device`, moved once for a whole phase.
    Moving each micro-batch's inputs as it comes would stall the GPU: a copy from pageable host
    memory waits for every kernel queued before it, so the device would drain before each
    micro-batch and again while the host launches the next. Slices of these tensors are views,
    so micro-batches then cost no copy and no synchronisation. A token budget (`max_tokens`)
    packs micro-batches on the host (rlhf/packing.py) and keeps the batch there. On a CPU this
    changes no value: the tensors are the same ones."""
    if max_tokens:
        return batch
    return batch.to(device, keys=list(batch.tensors) if keys is None else keys)


def sequence_inputs(batch: Batch, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """prompt + response ids and mask on `device`, and the prompt width P."""
    tensors = batch.tensors
    ids = torch.cat([tensors["prompt_ids"], tensors["response_ids"]], 1).to(device)
    mask = torch.cat([tensors["prompt_mask"], tensors["response_mask"]], 1).to(device)
    return ids, mask, tensors["prompt_ids"].shape[1]


LM_HEAD_CHUNK = 2048
"""Positions whose logits exist at once: the LM head and its log-softmax run over this many positions
at a time (`response_logprobs`), so a micro-batch never holds its full [positions, V] logits. At a
152k vocabulary a chunk's fp32 logits are 1.2 GiB; the memory plan counts one chunk
(rlhf/memory/formulas.py `lm_head_bytes`)."""


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, tokens: torch.Tensor, temperature: float,
                    with_entropy: bool, fused: bool, keep: int) -> torch.Tensor:
    """[b, k, H] hidden states -> [b, k, 2]: log p(tokens) and the entropy (0 without it) of the LM
    head's logits / temperature at the first `keep` positions (0 after them): the head applied as
    `nn.Linear` applies it, then `compiled.logprobs_and_entropy`."""
    logits = F.linear(hidden, weight, bias)[:, :keep]
    logprobs, entropy = logprobs_and_entropy(logits, tokens[:, :keep], temperature, with_entropy, fused)
    out = torch.stack([logprobs, entropy if entropy is not None else torch.zeros_like(logprobs)], -1)
    return F.pad(out, (0, 0, 0, hidden.shape[1] - keep)) if keep < hidden.shape[1] else out


def chunked_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, tokens: torch.Tensor,
                          temperature: float, with_entropy: bool, fused: bool, keep: int | None = None,
                          chunk: int = LM_HEAD_CHUNK) -> torch.Tensor:
    """[B, K, H] hidden states and [B, K] tokens -> [B, K, 2] (log-prob, entropy; 0 past the first `keep`
    positions of each row), about LM_HEAD_CHUNK positions at a time: whole rows of a padded micro-batch
    (B > 1), or spans of a packed row. With gradients each chunk is checkpointed: its logits are
    recomputed in the backward instead of kept, so the backward, too, holds one chunk's. One chunk is
    exactly the unchunked maths."""
    B, K, _ = hidden.shape
    keep = K if keep is None else keep
    if B * K <= chunk:
        return _chunk_logprobs(hidden, weight, bias, tokens, temperature, with_entropy, fused, keep)
    if B == 1 and keep < K:
        raise ValueError("a single row is chunked along its positions: score all of them (keep = None)")
    dim, step = (0, max(1, chunk // K)) if B > 1 else (1, chunk)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    outs = []
    for h, t in zip(hidden.split(step, dim), tokens.split(step, dim)):
        k = keep if dim == 0 else h.shape[1]
        if grad:
            outs.append(checkpoint(_chunk_logprobs, h, weight, bias, t, temperature, with_entropy, fused, k,
                                   use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(h, weight, bias, t, temperature, with_entropy, fused, k))
    return torch.cat(outs, dim)


@contextlib.contextmanager
def head_returns_logprobs(model, tokens: torch.Tensor, temperature: float, with_entropy: bool, fused: bool,
                          keep: int | None = None):
    """While open, the model's LM head returns (log-prob, entropy) [B, K, 2] of `tokens` [B, K] instead of
    [B, K, V] logits (`chunked_head_logprobs`; `keep`: only each row's first `keep` positions are
    scored). The head is swapped inside the model's own forward, so whatever wraps the model (peft's
    adapters, FSDP2's gathering of the root's weights) runs as usual."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear LM head to compute log-probs with")

    def forward(hidden):
        return chunked_head_logprobs(hidden, head.weight, head.bias, tokens, temperature, with_entropy, fused, keep)

    head.forward = forward  # pyright: ignore[reportAttributeAccessIssue]  (the head's input is named `input`)
    try:
        yield
    finally:
        del head.forward


def response_logprobs(model, batch: Batch, device, temperature: float = 1.0, autocast_dtype=None,
                      with_entropy: bool = True, fused: bool = False):
    """Log-probs of the response tokens [B, R] and, if asked, the entropy [B, R] (else None), under the
    sampling temperature (the distribution the rollout sampled from). Only the positions that predict
    response tokens go through the LM head (`logits_to_keep`: the last R + 1 of a padded row, the
    response positions of a packed one), and only LM_HEAD_CHUNK of them at a time. `fused` (GPU,
    ppo.torch_compile) computes each chunk's log-softmax and entropy in compiled kernels. A micro-batch
    that runs packed (rlhf/packing.py) is one row of its real tokens, scattered back to [B, R]."""
    row = packed_row(batch, device)
    if row is not None:
        inputs, keep, tokens, head_keep = row.forward_kwargs(model), row.index, row.tokens, None
    else:
        ids, mask, P = sequence_inputs(batch, device)
        R = batch.tensors["response_ids"].shape[1]
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
        # The last R + 1 positions go through the head; position P - 1 + t predicts response token t, and
        # the last one predicts nothing (scored as 0 and dropped).
        keep, head_keep, tokens = R + 1, R, F.pad(batch.tensors["response_ids"].to(device), (0, 1))
    with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None), \
            head_returns_logprobs(model, tokens, temperature, with_entropy, fused, head_keep):
        out = model(**inputs, use_cache=False, logits_to_keep=keep).logits
    if row is None:
        out = out[:, :-1]
    logprobs, entropy = out[..., 0], (out[..., 1] if with_entropy else None)
    if row is not None:  # back to the padded [B, R]
        logprobs, entropy = row.unpack(logprobs), entropy if entropy is None else row.unpack(entropy)
    return logprobs, entropy


def response_values(model, batch: Batch, device, autocast_dtype=None) -> torch.Tensor:
    """The value model's V(prompt + response[:t]) at every response position t, [B, R] in fp32. A
    micro-batch that runs packed (rlhf/packing.py) is one row without padding, scattered back to [B, R]."""
    row = packed_row(batch, device)
    if row is not None:
        with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            values = model(**row.forward_kwargs(model))
        return row.unpack(values[0, row.index].float())
    ids, mask, P = sequence_inputs(batch, device)
    R = batch.tensors["response_ids"].shape[1]
    with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        values = model(ids, mask)
    return values[:, P - 1:P - 1 + R].float()

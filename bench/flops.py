"""The arithmetic the benchmarks set measured times against: a decoder's FLOPs per pass and the GPUs'
limits (not a test).

FLOPs are counted as executed by the engine's packed path: every linear layer's matmul (2 x its
weights per token), causal attention (QK^T and AV over the tokens before each one, within its own
sequence: 2 x heads x head_dim x sequence length per token and layer, the mean context being half the
sequence), and the LM head only where logits are taken (`logit_tokens`: the response positions, for
the chunked head). A backward pass costs twice its forward when every weight trains (the activations'
and the weights' gradients) and once when the weights are frozen (LoRA: the adapters' own gradients
are a rank-r sliver, left out); gradient checkpointing adds one more forward. `model_flops` is the
usual MFU convention instead (6 x parameters x tokens + 12 x layers x width x sequence x tokens).
"""

from __future__ import annotations

from typing import Any, Dict

GPUS: Dict[str, Dict[str, Any]] = {
    # NVIDIA's datasheet figures, SXM parts: dense bf16 tensor-core rate, HBM bandwidth, memory.
    "h100": {"name": "H100 SXM 80GB", "bf16_tflops": 989.0, "hbm_tb_s": 3.35, "memory_gib": 79.6},
    "h200": {"name": "H200 141GB", "bf16_tflops": 989.0, "hbm_tb_s": 4.8, "memory_gib": 139.8},
}
"""The limits a phase's time is set against. bench/gpu_train.py measured 790 TFLOP/s of bf16 matmul
on the H200 (`MEASURED_TFLOPS_H200`): the datasheet rate is not reached by any kernel."""

MEASURED_TFLOPS_H200 = 790.0


def gpu_for_memory(total_gib: float | None) -> str | None:
    """The GPU of GPUS whose memory is nearest `total_gib` (what a run recorded), None without one."""
    if not total_gib:
        return None
    return min(GPUS, key=lambda g: abs(GPUS[g]["memory_gib"] - total_gib))


def attention_flops(shape, tokens: float, seq_len: float) -> float:
    """Causal attention's QK^T and AV over `tokens` tokens in sequences of `seq_len`."""
    return 2.0 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len * tokens


def forward_flops(shape, tokens: float, seq_len: float, logit_tokens: float) -> float:
    """One forward pass of a causal LM of `shape` (rlhf/memory/shapes.py `ModelShape`) over `tokens`
    tokens in sequences of `seq_len`, its LM head at `logit_tokens` of them (0: a value model's
    backbone, whose scalar head is left out)."""
    head = 2.0 * shape.vocab_size * shape.hidden_size * logit_tokens
    return 2.0 * shape.matmul_params(lm_head=False) * tokens + attention_flops(shape, tokens, seq_len) + head


def training_flops(shape, tokens: float, seq_len: float, logit_tokens: float, *, frozen_base: bool,
                   checkpointing: bool) -> float:
    """One forward and backward pass (`forward_flops`): backward twice the forward when every weight
    trains, once when the base is frozen (LoRA), and a recomputed forward with checkpointing."""
    forward = forward_flops(shape, tokens, seq_len, logit_tokens)
    return forward * (1.0 + (1.0 if frozen_base else 2.0) + (1.0 if checkpointing else 0.0))


def model_flops(n_params: int, num_layers: int, hidden_size: int, tokens: float, seq_len: float) -> float:
    """The MFU convention's FLOPs of a training step (not discounted for causality or frozen weights)."""
    return 6.0 * n_params * tokens + 12.0 * num_layers * hidden_size * seq_len * tokens


def kv_bytes_per_token(shape, dtype_bytes: int = 2) -> int:
    """The KV cache one token holds over every layer (keys and values)."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes

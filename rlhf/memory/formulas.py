"""The byte formulas of the memory plan: what one micro-batch of each phase adds on one GPU (activations
kept for the backward, the LM head's logits, FSDP2's gathered layers, autocast's weight copies, HF
generate's KV cache), the vLLM engine's share, and each trained role's resident state (`trained_role`).
Pure arithmetic on a `ModelShape` and the `ppo` bindings: no GPU, no weights.

Bytes per element: `act` is the activations' (2 under bf16 autocast on a GPU, else 4); weights are
fp32 (4) when trained in full, bf16 (2) for a frozen base on a GPU. Each formula is one micro-batch
on one GPU; `tokens` counts padded positions (rows x (prompt + response)) or a packed token budget.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from rlhf.memory.shapes import ModelShape, lora_targets

GIB = 2 ** 30

def layer_activation_bytes(shape: ModelShape, act: int, lora_rank: int = 0, lora: Sequence[str] = (),
                           frozen: bool = False, compiled: bool = False) -> int:
    """Bytes one block keeps for its backward, per token: two RMSNorms' fp32 input and normalised
    output (16 h); under autocast each projection saves its own cast input (q/k/v: 3 h, gate/up:
    2 h); the q/k/v outputs, their rotary copies, the attention output and o_proj's input; the MLP's
    gate, up, SiLU and product (4 f). LoRA adds its own cast copy of o_proj's and down_proj's input
    and each adapter's rank-r intermediate. Flash/memory-efficient attention keeps no T x T scores
    (the math kernel would). Checked against a measured peak (module docstring).

    `frozen`: a LoRA run on a GPU, whose bf16 base does not train and whose adapters are computed by
    `fuse_lora` (rlhf/roles/compiled.py). Autograd then saves only what a gradient needs: each
    norm's fp32 input (8 h for two; the frozen weight's product keeps nothing), the two inputs the
    projections share once each (the adapters' A needs them: 2 h), the q/k/v copies the attention kernel
    keeps (q + 2 kv), its output, which is o_proj's input (q), the MLP's four (4 f) and each adapter's
    rank-r intermediate. Measured at the Qwen2.5-7B shape, 8192-token micro-batches without
    checkpointing (bench/results/lora7b_recipe_eager_h200.json): the actor's update held 53.6 GiB beside the
    resident roles, this formula's plan 56.0 (compiled layers: 51.3).

    `compiled` (`ppo.torch_compile` on a GPU), a trained base: torch.compile's partitioner saves what
    the backward cannot cheaply recompute and recomputes the elementwise rest (the norms' outputs,
    rotary, SiLU): each norm's fp32 input (8 h for two), the two shared projection inputs (2 h), the
    attention kernel's q/k/v and output (2 q + 2 kv), the MLP's gate, up and product (3 f), and each
    adapter's rank-r intermediate. Measured at the Qwen2.5-0.5B shape, 16384-token micro-batches
    (bench/results/instruct05b_recipe_mb16k_h200.json): the actor's update held 19.4 GiB beside the
    resident roles, the plan 21.2 (the eager formula's: 36.0)."""
    h, f = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if frozen:
        return 8 * h + act * (2 * h + (q + 2 * kv) + q + 4 * f + lora_rank * len(lora))
    if compiled:
        return 8 * h + act * (2 * h + 2 * q + 2 * kv + 3 * f + lora_rank * len(lora))
    per_token = 16 * h + act * (3 * h + (q + 2 * kv) + (q + kv) + 2 * q + 2 * h + 4 * f)
    if lora_rank:
        lin = shape.linears()
        per_token += act * (sum(lin[t][0] for t in ("o_proj", "down_proj") if t in lora) + lora_rank * len(lora))
    return per_token


def saved_activation_bytes(shape: ModelShape, tokens: int, act: int, checkpointing: bool, lora_rank: int = 0,
                           lora: Sequence[str] = (), residual: int = 4, frozen: bool = False,
                           compiled: bool = False) -> int:
    """Activations kept from the forward to the backward of one micro-batch. Without gradient
    checkpointing every block's (`layer_activation_bytes`) plus the final norm's; with it each
    block keeps only its input hidden state (`residual` bytes a value: the weights' dtype, 2 for a
    bf16 LoRA base) and one block at a time is recomputed in full during the backward."""
    layer = layer_activation_bytes(shape, act, lora_rank, lora, frozen, compiled) * tokens
    if checkpointing:
        return shape.num_layers * residual * shape.hidden_size * tokens + layer
    return shape.num_layers * layer + 8 * shape.hidden_size * tokens


def backward_working_bytes(shape: ModelShape, tokens: int, act: int, compiled: bool = False) -> int:
    """The backward's own temporaries: the gradients of one block's activations (about what that block
    saved) and the residual stream's gradient in and out (fp32)."""
    return layer_activation_bytes(shape, act, compiled=compiled) * tokens + 2 * 4 * shape.hidden_size * tokens


def forward_working_bytes(shape: ModelShape, tokens: int, act: int) -> int:
    """A forward-only pass (no grad) keeps nothing for a backward; one block's tensors are alive at a
    time, the most in its MLP: three [T, f] tensors (the gate's SiLU, up, their product) beside the
    block's input and its normed copy (2 h), and 16 h for the norms' fp32 temporaries and the residual
    sum. Measured at the Qwen2.5-7B shape, 32768-token passes (bench/results/lora7b_recipe_addmm_h200.json):
    the values pass held 4.5 GiB beside the resident roles, this formula 5.7 (eager and compiled alike)."""
    h, f = shape.hidden_size, shape.intermediate_size
    return tokens * (act * (3 * f + 2 * h) + 16 * h)


def forward_peak_bytes(shape: ModelShape, tokens: int, act: int, head: int) -> int:
    """A forward-only pass's peak: its blocks' working set or, after the last block, the head's (`head`:
    `lm_head_bytes` or `value_head_bytes`) beside the final hidden states, whichever is larger."""
    return max(forward_working_bytes(shape, tokens, act), head + act * shape.hidden_size * tokens)


def merged_weight_bytes(shape: ModelShape, lora: Sequence[str], act: int) -> int:
    """`fuse_lora`'s merged weight W + s B A (rlhf/roles/compiled.py; [out, in] in the compute dtype), a
    temporary of one projection at a time in a LoRA role's forward, rebuilt in its backward: the largest
    adapted projection's, twice (the one at work beside the next being built). 0.25 GiB at the
    Qwen2.5-7B shape; with it the forward-only passes of 32768 tokens plan 1.00x what torch reserved
    (bench/results/lora7b_recipe_mb8k_h200.json), 0.998x without."""
    lin = shape.linears()
    return 2 * act * max((i * o for name, (i, o) in lin.items() if name in lora), default=0)


def lm_head_bytes(shape: ModelShape, positions: int, act: int, train: bool, entropy: bool = True,
                  fused: bool = False) -> int:
    """The LM head runs on response positions only (R + 1 a sequence, `logits_to_keep`), LM_HEAD_CHUNK
    of them at a time (rlhf/roles/forward.py `response_logprobs`): one chunk's logits [chunk, V] in the
    compute dtype, their fp32 copy and the log-softmax / entropy temporaries (fp32). Forward-only with
    entropy a + 16 bytes an element, without entropy (the reference) a + 8; for a backward the chunk
    is recomputed and its logits' gradient (fp32 and the compute dtype) is live beside it (2a + 24).
    `fused` (`ppo.torch_compile` on a GPU: one compiled kernel pair over the vocabulary): the logits and
    one fp32 buffer (a + 4); with a backward 2a + 16, measured: the compiled 7B LoRA update held 2.0 GiB
    less than the eager one at 8192 tokens (bench/results/lora7b_recipe_addmm_h200.json, *_eager_h200.json).
    Each position keeps its log-prob and entropy (and their gradients) whole."""
    from rlhf.roles.forward import LM_HEAD_CHUNK
    chunk = min(positions, LM_HEAD_CHUNK)
    if fused:
        per = 2 * act + 16 if train else act + 4
    else:
        per = 2 * act + 24 if train else act + (16 if entropy else 8)
    return chunk * shape.vocab_size * per + positions * 4 * 8


def value_head_bytes(rows: int, tokens_per_row: int, train: bool) -> int:
    """The critic's values [rows, T] in fp32, their clipped copy and the loss's temporaries."""
    return rows * tokens_per_row * 4 * (4 if train else 1)


def autocast_copy_bytes(shape: ModelShape, lm_head: bool) -> int:
    """bf16 autocast caches a bf16 copy of every fp32 weight that requires grad, from its first use in
    the forward until the autocast region ends (after the backward): 2 bytes a matmul weight, whole
    (FSDP2's gathered layers are copied too, so this does not shrink with world_size)."""
    return 2 * shape.matmul_params(lm_head)


def fsdp_gather_bytes(shape: ModelShape, param_bytes: int, world_size: int, train: bool, lm_head: bool) -> int:
    """FSDP2 (world_size > 1) gathers a block's full weights to use them: the root unit (embeddings,
    final norm, LM head) stays gathered through forward and backward, and two blocks are gathered at
    once (the current and the prefetched one); a backward adds their unsharded fp32 gradients."""
    if world_size <= 1:
        return 0
    root = shape.parameter_count(lm_head) - shape.num_layers * shape.layer_params
    full = (root + 2 * shape.layer_params) * param_bytes
    return full + ((root + 2 * shape.layer_params) * 4 if train else 0)


def hf_generate_bytes(shape: ModelShape, rows: int, prompt: int, response: int, act: int) -> int:
    """HF generate (rollout_backend 'hf'): the KV cache of one call (rows x (P + R) x layers x K and V),
    the prefill's working set over the prompts and each step's last-position logits (fp32, sampled
    from a processed copy)."""
    kv = shape.num_kv_heads * shape.head_dim
    cache = rows * (prompt + response) * shape.num_layers * 2 * kv * act
    return cache + forward_working_bytes(shape, rows * prompt, act) + rows * shape.vocab_size * 4 * 3


def engine_bytes(ppo, device_total: int) -> int:
    """The vLLM engine takes `ppo.vllm_gpu_memory_utilization` of the whole GPU (weights, activations,
    KV cache) on each GPU of the actor; 0 with HF rollouts."""
    if ppo.rollout_backend != "vllm":
        return 0
    return int(ppo.vllm_gpu_memory_utilization * device_total)


CUBLAS_WORKSPACE_BYTES = 33 * 2**20
"""torch's cuBLAS workspace (32 MiB on Hopper, `CUBLAS_WORKSPACE_CONFIG` = ':4096:8' or unset) and cuBLASLt's
(1 MiB) for one thread and CUDA stream that run matmuls, taken from torch's caching allocator (so counted as
allocated) and kept for the process's life. Measured on an H100 with torch 2.11 (bench/results/
cublas_workspace_h100.json): 33 MiB for each new thread or stream, the same with the variable set; older GPUs
take less."""


def cublas_workspace_bytes(device_roles: Sequence[str], gpu: bool) -> int:
    """The cuBLAS workspaces of the trainer's roles on one GPU: the calling thread and autograd's backward
    thread, each on the default stream, and with a critic the same two on its update's stream
    (rlhf/roles/critic.py): 4 x 33 MiB in the 0.5B recipe's trainer (bench/results/memory_snapshot/
    instruct05b_own_process_h100.json: four 32 MiB blocks between iterations). A forward-only role's GPU: the
    calling thread's alone."""
    if not gpu:
        return 0
    trains = any(r in ("actor", "critic") for r in device_roles)
    pairs = (2 if trains else 1) + (2 if "critic" in device_roles else 0)
    return pairs * CUBLAS_WORKSPACE_BYTES


ENGINE_PROCESS_BYTES = 512 * 2**20
"""What a vLLM engine in a process of its own (`ppo.vllm_own_process`) holds beyond its share, awake or
asleep: that process's CUDA context and cuBLAS workspace."""


RUNNER_V2_BYTES = 528 * 2**20
"""What vLLM's second model runner (`ppo.vllm_model_runner = 'v2'`, or vLLM's own choice) holds beyond the
engine's share, awake or asleep: its per-request state on the GPU, allocated outside the memory vLLM sizes its
KV cache in. Measured (bench/results/instruct05b_recipe_mb12k_v2_h100.json against
instruct05b_recipe_mb12k_h100.json, the 0.5B recipe on an H100 with each runner): 0.50-0.51 GiB more at every
phase; an estimate for other shapes."""


def engine_side_bytes(ppo, policy: ModelShape) -> int:
    """What the engine holds on the GPU beyond its `engine_bytes` share, awake or asleep: with
    `ppo.vllm_own_process`, ENGINE_PROCESS_BYTES plus the weights' staging buffer, which grows to the
    largest tensor sent (the embedding); with vLLM's second model runner (`ppo.vllm_model_runner = 'v2'`, or
    'auto' where vLLM picks it for the policy's architecture), RUNNER_V2_BYTES."""
    if ppo.rollout_backend != "vllm":
        return 0
    from rlhf.rollout.vllm import uses_runner_v2
    side = RUNNER_V2_BYTES if uses_runner_v2(ppo.vllm_model_runner, policy.architecture_names) else 0
    if ppo.vllm_own_process:
        from rlhf.rollout.vllm_worker import STAGING_BYTES
        bytes_per_weight = 2 if ppo.dtype == "bfloat16" else 4
        side += ENGINE_PROCESS_BYTES + max(STAGING_BYTES, policy.vocab_size * policy.hidden_size * bytes_per_weight)
    return side


def shard(n: int, world_size: int) -> int:
    """`n` bytes split over `world_size` FSDP2 ranks: one rank's shard, rounded up."""
    return -(-n // world_size)


@dataclasses.dataclass
class RoleMemory:
    """One role's bytes on each GPU that holds it (its FSDP2 shard): resident state, and what one
    micro-batch of its update (`train`) or of its forward-only pass (`forward`) adds."""

    name: str
    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    replica: int = 0
    """The HF backend's full rollout copy of a sharded policy (fp32)."""
    train: int = 0
    forward: int = 0
    note: str = ""

    @property
    def resident(self) -> int:
        return self.weights + self.grads + self.optimizer + self.replica

    def parts(self) -> str:
        items = [("weights", self.weights), ("grads", self.grads), ("optimizer", self.optimizer),
                 ("rollout replica", self.replica)]
        return " + ".join(f"{k} {v / GIB:.1f}" for k, v in items if v)


def micro_batches(ppo, prompt: int, response: int) -> dict:
    """Rows, tokens and LM-head positions of one update and one forward micro-batch on one rank.
    Padded: micro_batch_size (forward_batch_size) sequences of prompt + response tokens. Packed
    (`max_tokens_per_micro_batch`, `forward_max_tokens_per_micro_batch` for the forward-only passes):
    one row of the budget (at least one whole sequence), but never more than the sequences it is cut
    from hold: an update's micro-batches are cut from a mini-batch (its share on this rank), a forward
    pass's from the rank's share of the rollout. Its response positions are taken in proportion to
    max_response_length : max_prompt_length, which prompts shorter than their maximum exceed (the
    verdict names that risk)."""
    seq = prompt + response
    if ppo.max_tokens_per_micro_batch:
        def packed(budget: int, rows: int) -> tuple:
            tokens = max(min(budget, rows * seq), seq)
            return 1, tokens, min(tokens, math.ceil(tokens * (response + 1) / seq))
        return {"train": packed(ppo.max_tokens_per_micro_batch, ppo.mini_batch_size // ppo.world_size),
                "forward": packed(ppo.forward_max_tokens, shard(ppo.rollout_batch_size, ppo.world_size))}
    train = min(ppo.micro_batch_size, ppo.mini_batch_size // ppo.world_size)
    forward = min(ppo.forward_batch_size, shard(ppo.rollout_batch_size, ppo.world_size))
    return {"train": (train, train * seq, train * (response + 1)),
            "forward": (forward, forward * seq, forward * (response + 1))}


def compiled(ppo, gpu: bool) -> bool:
    """Compiled layers and the fused log-prob/entropy (`ppo.torch_compile`), which only a GPU run uses
    (rlhf/roles/role.py `TrainedRole.fused`)."""
    return bool(ppo.torch_compile) and gpu


def trained_role(name: str, shape: ModelShape, ppo, rank: int, lm_head: bool, gpu: bool, act: int,
                  batches: dict, head_params: int = 0) -> RoleMemory:
    """The actor (lm_head) or the critic (backbone + value head): weights, gradients and AdamW's two
    moments (fp32 for every trained parameter: 16 bytes a parameter in full fine-tuning), and its
    micro-batches. With LoRA the base is frozen (bf16 on a GPU) and only the adapters (and a head) train."""
    n = ppo.world_size
    params = shape.parameter_count(lm_head) + head_params
    targets = lora_targets(ppo.lora_target_modules) if rank else ()
    if rank:
        base_bytes = 2 if gpu else 4
        trainable = shape.lora_params(rank, targets) + head_params
        weights = (params - head_params) * base_bytes + trainable * 4
    else:
        base_bytes, trainable, weights = 4, params, params * 4
    role = RoleMemory(name, weights=shard(weights, n), grads=shard(4 * trainable, n),
                      optimizer=shard(8 * trainable, n),
                      note=f"LoRA rank {rank} on {len(targets)} projections" if rank else "full fine-tuning")
    copies = autocast_copy_bytes(shape, lm_head) if (gpu and act == 2 and not rank) else 0
    rows, tokens, positions = batches["train"]
    ckpt = ppo.gradient_checkpointing
    fused = compiled(ppo, gpu)
    head = (lm_head_bytes(shape, positions, act, train=True, fused=fused) if lm_head
            else value_head_bytes(rows, tokens // rows, train=True))
    frozen = bool(rank) and gpu  # a frozen bf16 base with fused adapters: autograd keeps less
    saved = saved_activation_bytes(shape, tokens, act, ckpt, rank, targets, residual=base_bytes, frozen=frozen,
                                   compiled=fused)
    working = backward_working_bytes(shape, tokens, act, compiled=fused)
    if ckpt:
        # The LM head's chunks run (and are recomputed) before the first block's recompute: the two
        # working sets follow one another above the checkpointed block inputs.
        layer = layer_activation_bytes(shape, act, rank, targets, frozen, fused) * tokens
        activations = (saved - layer) + max(layer + working, head)
    else:
        activations = saved + working + head
    merged = merged_weight_bytes(shape, targets, act) if frozen else 0
    role.train = (activations + copies + merged
                  + fsdp_gather_bytes(shape, base_bytes, n, train=not rank, lm_head=lm_head))
    rows, tokens, positions = batches["forward"]
    head_fwd = (lm_head_bytes(shape, positions, act, train=False, fused=fused) if lm_head
                else value_head_bytes(rows, tokens // rows, train=False))
    role.forward = (forward_peak_bytes(shape, tokens, act, head_fwd) + copies + merged
                    + fsdp_gather_bytes(shape, base_bytes, n, train=False, lm_head=lm_head))
    return role

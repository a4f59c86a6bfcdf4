"""Device memory: what each role takes, predicted before launch from the model's shape and measured
once the roles are built, and moving idle roles' state to pinned host memory when they do not fit.

Predicted (no GPU, no weights): `predict` sums, for every role on a GPU (actor, critic, reference,
reward model, the vLLM engine), its weights, gradients and AdamW states, and what each phase of a
PPO step adds for one micro-batch (activations kept for the backward, the LM head's logits, FSDP2's
gathered layers), phase by phase, from `ModelShape` (a config.json) and the `PPOConfig`. `check`
refuses a run that cannot fit with one line naming the bindings that would make it fit (`suggest`).
The trainer checks before it builds any model; `python -m rlhf.memory` prints the plan of a recipe.

Measured (`ppo.offload_idle_models = 'auto'`, the default): colocated roles are built with
offloading on, so building never overflows; then the sum of what each holds resident (weights and
buffers; for a trained role also its gradients and AdamW's two moments) plus the predicted
activations must fit beside the awake rollout engine, or idle roles are offloaded and vLLM sleeps
(`ppo.vllm_sleep = 'auto'`). The decision and its figures are logged and recorded in provenance
(`placement.memory`, beside the prediction in `placement.memory_predicted`).

Checked against the shipped recipes run through `python -m rlhf.train` on one H200 (bench/recipe_run.py;
bench/results/lora7b_recipe_h200.json: the 7B shape under models/lora.gin, LoRA, checkpointing, packed;
bench/results/instruct05b_recipe_h200.json: the 0.5B shape under models/instruct.gin, full fine-tuning,
packed): in every phase the prediction of what torch holds (resident roles, the awake engine, the
phase's micro-batch) is 0-9% above the measured peak (`perf/memory_gb/<phase>`), never below
(tests/rlhf/test_memory_plan.py keeps both runs).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor

from rlhf.config import RunConfig
from rlhf.errors import ConfigError
from rlhf.models import ShapeError, check_policy_dir, shape_fields, text_config

if TYPE_CHECKING:
    from rlhf.roles import ActorRole, PlacedRole

ACTIVATION_HEADROOM = 0.2
"""Share of the device's memory kept free for activations when no prediction is at hand."""
GIB = 2 ** 30
RESERVE_BYTES = 1 * GIB
"""Kept free on every GPU for what torch does not count: the CUDA context, cuBLAS and NCCL workspaces."""
FRAGMENTATION = 0.05
"""Share of a phase's torch memory added for the caching allocator's fragmentation."""
SAFETY_MARGIN = 0.05
"""Share of the GPU a run must leave spare to count as fitting. Measured on an H200, a 0.5B-shape run
with 2048 new tokens predicted at 137.0 of 139 GiB (1.5% spare) ran out of memory in its actor update:
whole steps can take more than the per-phase estimate, so a fit closer than this is refused."""
SLIM_MARGIN = 0.10
"""A run that fits with less than this share of the GPU to spare is flagged as a slim fit."""
LORA_SUGGESTION = 64
"""The LoRA rank the suggestions try (verl's and OpenRLHF's examples commonly use 32-64)."""


# ====================================================================== measured (runtime)
def device_memory(device: torch.device) -> dict:
    if torch.device(device).type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"device_free_gb": free / GIB, "device_total_gb": total / GIB,
            "allocated_gb": torch.cuda.memory_allocated(device) / GIB}


def _tensors(module: torch.nn.Module) -> List[torch.Tensor]:
    return list(module.parameters()) + list(module.buffers())


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t  # a sharded parameter: this rank's part
    return local.numel() * local.element_size()


def state_bytes(role: "PlacedRole") -> int:
    """Bytes the role holds on its device when resident and at work (this rank's shard)."""
    modules, optimizers = role.device_state()
    total = sum(_local_bytes(t) for m in modules for t in _tensors(m))
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                # gradient + AdamW's exp_avg and exp_avg_sq, in the parameter's dtype
                total += 3 * _local_bytes(p)
    return total


def plan_memory(offload_mode, sleep_mode, role_bytes: Dict[str, int], available: int, total: int,
                can_offload: bool, headroom: Optional[int] = None) -> dict:
    """Whether idle roles leave the device between phases (`ppo.offload_idle_models`) and whether
    the vLLM engine sleeps between rollouts (`ppo.vllm_sleep`), and why. 'auto' turns either on
    only when the roles' resident state plus `headroom` (the predicted activations and reserve;
    default a flat ACTIVATION_HEADROOM of the device) does not fit in `available` (what the device
    has beside the awake engine, counting what the roles hold already)."""
    need = sum(role_bytes.values())
    predicted = headroom is not None
    headroom = int(ACTIVATION_HEADROOM * total) if headroom is None else int(headroom)
    fits = need + headroom <= available
    offload = (offload_mode if isinstance(offload_mode, bool) else not fits) and can_offload
    sleep = sleep_mode if isinstance(sleep_mode, bool) else not fits
    reason = (f"the roles need {need / GIB:.2f} GiB resident + {headroom / GIB:.1f} GiB "
              f"{'predicted activations and reserve' if predicted else 'headroom'} of {available / GIB:.1f} GiB "
              f"available: " + ("they fit" if fits else "they do not fit"))
    return {"offload": offload, "rollout_sleep": sleep, "fits": fits, "reason": reason,
            "modes": {"offload_idle_models": offload_mode, "vllm_sleep": sleep_mode},
            "role_gb": {k: round(v / GIB, 3) for k, v in role_bytes.items()}, "resident_gb": round(need / GIB, 3),
            "available_gb": round(available / GIB, 3), "headroom_gb": round(headroom / GIB, 3)}


def runtime_plan(ppo, role_bytes: Dict[str, int], info: dict, *, offload_mode, can_offload: bool,
                 predicted: Optional["MemoryPlan"] = None) -> dict:
    """`plan_memory` from the measured roles and a device report (`device_memory`, taken in the
    process of the actor and its rollout engine). The engine's memory may sit outside torch's own
    count, so what the roles may use is capped at the device less the engine's share."""
    total = int(info["device_total_gb"] * GIB)
    available = int((info["device_free_gb"] + info["allocated_gb"]) * GIB)
    engine = engine_bytes(ppo, total)
    if engine:
        available = min(available, total - engine)
    headroom = predicted.headroom() if predicted is not None else None
    return plan_memory(offload_mode, ppo.vllm_sleep, role_bytes, available=available, total=total,
                       can_offload=can_offload, headroom=headroom)


def describe(plan: dict) -> str:
    return (f"memory plan: offload idle models {'on' if plan['offload'] else 'off'}, vLLM sleep "
            f"{'on' if plan['rollout_sleep'] else 'off'} ({plan['reason']})")


def apply_runtime_plan(ppo, actor: "ActorRole", role_bytes: Dict[str, int], info: dict, *, offload_mode,
                       can_offload: bool, predicted: Optional["MemoryPlan"] = None,
                       set_offload: Optional[Callable[[bool], None]] = None, log=print) -> dict:
    """The measured plan (`runtime_plan`) put into effect alike by every placement on a GPU: idle
    roles offloaded or kept resident (`set_offload`, where the placement can offload), the actor's
    rollout engine told whether to sleep between rollouts, and the decision logged. Returns the
    plan, which the placement records as `placement.memory`."""
    plan = runtime_plan(ppo, role_bytes, info, offload_mode=offload_mode, can_offload=can_offload,
                        predicted=predicted)
    if set_offload is not None:
        set_offload(plan["offload"])
    actor.set_rollout_sleep(plan["rollout_sleep"])
    log(describe(plan))
    return plan


# ====================================================================== model shapes
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_vl", "qwen2_5_vl")
"""Architectures whose q/k/v projections carry a bias without saying so in config.json."""


def _first(config: dict, *keys, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs of a decoder-only transformer (Llama, Qwen2/3, Mistral, Phi-3:
    RMSNorm, rotary attention with grouped-query heads, a gated MLP), read from its config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    name: str = ""

    @classmethod
    def from_config(cls, config, name: str = "") -> "ModelShape":
        """From a transformers config (object or dict; a multimodal config's `text_config` is the
        language model). Raises a ShapeError (a ValueError) for a config that is not a shape
        (`shape_fields`) and for what it cannot model (mixture-of-experts)."""
        c = config.to_dict() if hasattr(config, "to_dict") else dict(config) if isinstance(config, Mapping) else config
        f = shape_fields(c)  # a ShapeError naming the field and what is allowed
        c, _ = text_config(c)
        experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts", default=0)
        if isinstance(experts, int) and experts > 1:
            raise ShapeError("is a mixture-of-experts model, which the memory plan does not model")
        h, heads = f["hidden_size"], f["num_attention_heads"]
        model_type = str(c.get("model_type") or "")
        attention_bias = c.get("attention_bias")
        return cls(hidden_size=h, num_layers=f["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=f["num_key_value_heads"] or heads, head_dim=f["head_dim"] or h // heads,
                   intermediate_size=f["intermediate_size"] or 4 * h,
                   vocab_size=f["vocab_size"], tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=bool(attention_bias) if attention_bias is not None else model_type in QKV_BIAS_MODEL_TYPES,
                   o_bias=bool(attention_bias), mlp_bias=bool(c.get("mlp_bias", False)),
                   qk_norm=model_type.startswith("qwen3"), name=name or model_type)

    @classmethod
    def from_dir(cls, path: str | Path, binding: str = "model.name_or_path") -> "ModelShape":
        """From `path/config.json`; a one-line ConfigError naming `binding` and the file when there is
        none or it is not a model shape (`shape_fields`)."""
        file = Path(path) / "config.json"
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError):
            raise ConfigError(f"{binding} = {str(path)!r}: no readable config.json to take the model's shape "
                              f"from") from None
        try:
            return cls.from_config(config, name=Path(path).name)
        except ShapeError as err:
            raise ConfigError(f"{binding} = {str(path)!r}: {file} {err.predicate}") from None

    def config_dict(self) -> dict:
        """A transformers config of this shape (what `from_config` reads back): a Qwen2 when the q/k/v
        projections alone carry a bias, else a Llama; for a shape without a config.json (the tiny
        default, the published shapes) to be checked as the trainer checks a policy's."""
        qwen2 = self.qkv_bias and not self.o_bias
        return {"model_type": "qwen2" if qwen2 else "llama",
                "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
                "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
                **({} if qwen2 else {"attention_bias": self.o_bias, "mlp_bias": self.mlp_bias})}

    def linears(self) -> Dict[str, tuple]:
        """(in, out) features of each linear layer of one block."""
        h, q, kv, f = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    @property
    def layer_params(self) -> int:
        """One block: its seven projections, their biases, two RMSNorms (and Qwen3's q/k norms)."""
        lin = self.linears()
        weights = sum(i * o for i, o in lin.values())
        bias = (lin["q_proj"][1] + 2 * lin["k_proj"][1] if self.qkv_bias else 0) + \
            (self.hidden_size if self.o_bias else 0) + \
            (2 * self.intermediate_size + self.hidden_size if self.mlp_bias else 0)
        return weights + bias + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def parameter_count(self, lm_head: bool = True) -> int:
        """Parameters of the causal LM (tied embeddings counted once); `lm_head=False`: the backbone
        alone (what the critic and a reward model keep), which loses only an untied head."""
        head = self.embedding_params if lm_head and not self.tie_word_embeddings else 0
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + head

    def matmul_params(self, lm_head: bool = True) -> int:
        """Weights that go through matmuls (the projections, and the LM head): what bf16 autocast copies."""
        return self.num_layers * sum(i * o for i, o in self.linears().values()) + \
            (self.embedding_params if lm_head else 0)

    def lora_params(self, rank: int, targets: Sequence[str]) -> int:
        """Adapter parameters: rank x (in + out) for every targeted projection of every block."""
        lin = self.linears()
        return self.num_layers * rank * sum(lin[t][0] + lin[t][1] for t in targets)


def parameter_count(config) -> int:
    """Parameters of a causal LM from its config alone (a transformers config or a dict)."""
    return ModelShape.from_config(config).parameter_count()


KNOWN_SHAPES = {
    # Qwen2.5 base/instruct config.json files (Hugging Face, 2024): hidden, layers, heads, KV heads,
    # intermediate, vocab, tied embeddings.
    "qwen2.5-0.5b": ModelShape(896, 24, 14, 2, 64, 4864, 151936, True, True, name="Qwen2.5-0.5B"),
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 2, 128, 8960, 151936, True, True, name="Qwen2.5-1.5B"),
    "qwen2.5-3b": ModelShape(2048, 36, 16, 2, 128, 11008, 151936, True, True, name="Qwen2.5-3B"),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 4, 128, 18944, 152064, False, True, name="Qwen2.5-7B"),
}
"""Published shapes, for planning without a checkpoint (`python -m rlhf.memory --shape`)."""


def tiny_shape(tiny) -> ModelShape:
    """The embedded default (rlhf/tiny.py): a Llama of `tiny_model`'s shape over the character vocabulary."""
    from rlhf.tiny import CHARACTERS, SPECIAL_TOKENS
    return ModelShape(tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_heads,
                      tiny.hidden_size // tiny.num_heads, tiny.intermediate_size,
                      len(SPECIAL_TOKENS) + len(CHARACTERS), name="tiny")


def lora_targets(target_modules) -> tuple:
    """The block projections `ppo.lora_target_modules` adapts ('all-linear': all seven)."""
    if target_modules == "all-linear":
        return LINEARS
    names = []
    for t in target_modules:
        names.extend(FUSED_LINEARS.get(t, (t,)))
    return tuple(n for n in LINEARS if n in names)


# ====================================================================== predicted: the formulas
# Bytes per element: `act` is the activations' (2 under bf16 autocast on a GPU, else 4); weights
# are fp32 (4) when trained in full, bf16 (2) for a frozen base on a GPU. Each formula is one
# micro-batch on one GPU; `tokens` counts padded positions (rows x (prompt + response)) or a
# packed token budget.

def layer_activation_bytes(shape: ModelShape, act: int, lora_rank: int = 0, lora: Sequence[str] = ()) -> int:
    """Bytes one block keeps for its backward, per token: two RMSNorms' fp32 input and normalised
    output (16 h); under autocast each projection saves its own cast input (q/k/v: 3 h, gate/up:
    2 h); the q/k/v outputs, their rotary copies, the attention output and o_proj's input; the MLP's
    gate, up, SiLU and product (4 f). LoRA adds its own cast copy of o_proj's and down_proj's input
    and each adapter's rank-r intermediate. Flash/memory-efficient attention keeps no T x T scores
    (the math kernel would). Checked against a measured peak (module docstring)."""
    h, f = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_token = 16 * h + act * (3 * h + (q + 2 * kv) + (q + kv) + 2 * q + 2 * h + 4 * f)
    if lora_rank:
        lin = shape.linears()
        per_token += act * (sum(lin[t][0] for t in ("o_proj", "down_proj") if t in lora) + lora_rank * len(lora))
    return per_token


def saved_activation_bytes(shape: ModelShape, tokens: int, act: int, checkpointing: bool, lora_rank: int = 0,
                           lora: Sequence[str] = (), residual: int = 4) -> int:
    """Activations kept from the forward to the backward of one micro-batch. Without gradient
    checkpointing every block's (`layer_activation_bytes`) plus the final norm's; with it each
    block keeps only its input hidden state (`residual` bytes a value: the weights' dtype, 2 for a
    bf16 LoRA base) and one block at a time is recomputed in full during the backward."""
    layer = layer_activation_bytes(shape, act, lora_rank, lora) * tokens
    if checkpointing:
        return shape.num_layers * residual * shape.hidden_size * tokens + layer
    return shape.num_layers * layer + 8 * shape.hidden_size * tokens


def backward_working_bytes(shape: ModelShape, tokens: int, act: int) -> int:
    """The backward's own temporaries: the gradients of one block's activations (about what that block
    saved) and the residual stream's gradient in and out (fp32)."""
    return layer_activation_bytes(shape, act) * tokens + 2 * 4 * shape.hidden_size * tokens


def forward_working_bytes(shape: ModelShape, tokens: int, act: int) -> int:
    """A forward-only pass (no grad) keeps nothing for a backward: at most one block's tensors are
    alive at once (bounded by what that block would save), plus the residual stream in and out."""
    return layer_activation_bytes(shape, act) * tokens + 2 * 4 * shape.hidden_size * tokens


def lm_head_bytes(shape: ModelShape, positions: int, act: int, train: bool, entropy: bool = True) -> int:
    """The LM head runs on response positions only (R + 1 a sequence, `logits_to_keep`), LM_HEAD_CHUNK
    of them at a time (rlhf/roles/forward.py `response_logprobs`): one chunk's logits [chunk, V] in the
    compute dtype, their fp32 copy and the log-softmax / entropy temporaries (fp32). Forward-only with
    entropy a + 16 bytes an element, without entropy (the reference) a + 8; for a backward the chunk
    is recomputed and its logits' gradient (fp32 and the compute dtype) is live beside it (2a + 24).
    Each position keeps its log-prob and entropy (and their gradients) whole."""
    from rlhf.roles.forward import LM_HEAD_CHUNK
    chunk = min(positions, LM_HEAD_CHUNK)
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


def _shard(n: int, world_size: int) -> int:
    return -(-n // world_size)


# ====================================================================== predicted: roles, phases, verdict
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


@dataclasses.dataclass
class Phase:
    """One phase of a PPO step on one GPU: the roles resident, the vLLM engine when awake, what the
    phase's micro-batch adds, and the reserve (RESERVE_BYTES + FRAGMENTATION of torch's share)."""

    name: str
    role: str
    roles: tuple
    resident: int
    engine: int
    transient: int
    reserve: int

    @property
    def total(self) -> int:
        return self.resident + self.engine + self.transient + self.reserve


PHASES = ("generate", "reward_model", "reference", "old_logprobs", "values", "update_critic", "update_actor",
          "sync_weights")


@dataclasses.dataclass
class MemoryPlan:
    """The predicted plan of a run on its busiest GPU."""

    roles: Dict[str, RoleMemory]
    phases: List[Phase]
    engine: int
    available: Optional[int]
    """Bytes the run may use on each GPU (None: not a GPU run, nothing to check)."""
    offload: bool
    sleep: bool
    gpus: int
    settings: dict

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.available is None else self.peak.total <= (1 - SAFETY_MARGIN) * self.available

    @property
    def slim(self) -> bool:
        return bool(self.fits) and self.available - self.peak.total < SLIM_MARGIN * self.available

    def headroom(self) -> int:
        """What the runtime decision keeps free beside the roles' state: the largest phase's micro-batch
        plus its reserve, on this GPU."""
        return max(p.transient + p.reserve for p in self.phases)

    def breakdown(self, phase: Optional[Phase] = None) -> str:
        """'at update_actor: actor 121.6 = weights 30.4 + ..., vLLM 41.7, activations 38.0, reserve 8.0'"""
        p = phase or self.peak
        parts = []
        for name in p.roles:
            role = self.roles[name]
            if role.resident:
                detail = f" = {role.parts()}" if "+" in role.parts() else ""
                parts.append(f"{name} {role.resident / GIB:.1f}{detail}")
        if p.engine:
            parts.append(f"vLLM {p.engine / GIB:.1f}")
        if p.transient:
            parts.append(f"{p.name} micro-batch {p.transient / GIB:.1f}")
        parts.append(f"reserve {p.reserve / GIB:.1f}")
        return f"at {p.name}: " + ", ".join(parts)

    def verdict(self) -> str:
        peak = self.peak
        if self.available is None:
            size = f"{peak.total / GIB:.1f} GiB" if peak.total >= GIB else f"{peak.total / 2 ** 20:.1f} MiB"
            return f"needs {size} at its peak ({peak.name}; nothing to check off a GPU)"
        size = f"{self.available / GIB:.1f}"
        article = "an" if size.startswith("8") or size.split(".")[0] in ("11", "18") else "a"
        head = f"needs {peak.total / GIB:.1f} GiB on {article} {size} GiB GPU"
        if not self.fits:
            return f"{head}: it does not fit ({self.breakdown()})"
        spare = (self.available - peak.total) / GIB
        if self.slim:
            return (f"{head}: it fits with a slim margin of {spare:.1f} GiB ({self.breakdown()}); the activations "
                    f"are an estimate (packed micro-batches with short prompts, the attention kernel and the "
                    f"allocator's fragmentation can take more): watch the first steps' peak memory")
        return f"{head}: it fits with {spare:.1f} GiB to spare ({self.breakdown()})"

    def to_dict(self) -> dict:
        gb = lambda b: round(b / GIB, 3)  # noqa: E731
        return {"peak_gb": gb(self.peak.total), "peak_phase": self.peak.name, "fits": self.fits,
                "available_gb": gb(self.available) if self.available is not None else None,
                "gpus": self.gpus, "offload": self.offload, "rollout_sleep": self.sleep,
                "engine_gb": gb(self.engine), "settings": self.settings,
                "roles": {n: {"weights_gb": gb(r.weights), "grads_gb": gb(r.grads), "optimizer_gb": gb(r.optimizer),
                              "replica_gb": gb(r.replica), "resident_gb": gb(r.resident),
                              "train_micro_batch_gb": gb(r.train), "forward_micro_batch_gb": gb(r.forward)}
                          for n, r in self.roles.items()},
                "phases": {p.name: {"total_gb": gb(p.total), "resident_gb": gb(p.resident), "engine_gb": gb(p.engine),
                                    "micro_batch_gb": gb(p.transient), "reserve_gb": gb(p.reserve)}
                           for p in self.phases},
                "verdict": self.verdict()}


def _micro_batches(ppo, prompt: int, response: int) -> dict:
    """Rows, tokens and LM-head positions of one update and one forward micro-batch on one rank.
    Padded: micro_batch_size (forward_batch_size) sequences of prompt + response tokens. Packed
    (`max_tokens_per_micro_batch`): one row of the budget (at least one whole sequence); its
    response positions are taken in proportion to max_response_length : max_prompt_length, which
    prompts shorter than their maximum exceed (the verdict names that risk)."""
    seq = prompt + response
    if ppo.max_tokens_per_micro_batch:
        tokens = max(ppo.max_tokens_per_micro_batch, seq)
        positions = min(tokens, math.ceil(tokens * (response + 1) / seq))
        return {"train": (1, tokens, positions), "forward": (1, tokens, positions)}
    train = min(ppo.micro_batch_size, ppo.mini_batch_size // ppo.world_size)
    forward = min(ppo.forward_batch_size, _shard(ppo.rollout_batch_size, ppo.world_size))
    return {"train": (train, train * seq, train * (response + 1)),
            "forward": (forward, forward * seq, forward * (response + 1))}


def _trained_role(name: str, shape: ModelShape, ppo, rank: int, lm_head: bool, gpu: bool, act: int,
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
    role = RoleMemory(name, weights=_shard(weights, n), grads=_shard(4 * trainable, n),
                      optimizer=_shard(8 * trainable, n),
                      note=f"LoRA rank {rank} on {len(targets)} projections" if rank else "full fine-tuning")
    copies = autocast_copy_bytes(shape, lm_head) if (gpu and act == 2 and not rank) else 0
    rows, tokens, positions = batches["train"]
    ckpt = ppo.gradient_checkpointing
    head = (lm_head_bytes(shape, positions, act, train=True) if lm_head
            else value_head_bytes(rows, tokens // rows, train=True))
    saved = saved_activation_bytes(shape, tokens, act, ckpt, rank, targets, residual=base_bytes)
    working = backward_working_bytes(shape, tokens, act)
    if ckpt:
        # The LM head's chunks run (and are recomputed) before the first block's recompute: the two
        # working sets follow one another above the checkpointed block inputs.
        layer = layer_activation_bytes(shape, act, rank, targets) * tokens
        activations = (saved - layer) + max(layer + working, head)
    else:
        activations = saved + working + head
    role.train = activations + copies + fsdp_gather_bytes(shape, base_bytes, n, train=not rank, lm_head=lm_head)
    rows, tokens, positions = batches["forward"]
    head_fwd = (lm_head_bytes(shape, positions, act, train=False) if lm_head
                else value_head_bytes(rows, tokens // rows, train=False))
    role.forward = (forward_working_bytes(shape, tokens, act) + head_fwd + copies
                    + fsdp_gather_bytes(shape, base_bytes, n, train=False, lm_head=lm_head))
    return role


def predict(cfg: RunConfig, policy: ModelShape, reward_model: Optional[ModelShape] = None, *,
            available: Optional[int] = None, device_total: Optional[int] = None, gpu: bool = True) -> MemoryPlan:
    """The run's predicted memory on its busiest GPU, phase by phase (no GPU, no weights).

    `available`: bytes the run may use on each GPU (None: nothing to check against); `device_total`:
    the GPU's whole memory, of which vLLM takes its share (default `available`). `gpu=False` plans the
    CPU path (fp32, no engine). Offloading and vLLM sleep left at 'auto' are decided as the runtime
    decides them: on when the roles, the awake engine and the largest micro-batch do not fit."""
    ppo, n = cfg.ppo, cfg.ppo.world_size
    total = device_total if device_total is not None else available
    act = 2 if gpu and ppo.bf16_autocast else 4
    prompt, response = ppo.max_prompt_length, ppo.max_response_length
    batches = _micro_batches(ppo, prompt, response)

    roles: Dict[str, RoleMemory] = {}
    actor = _trained_role("actor", policy, ppo, ppo.lora_rank, True, gpu, act, batches)
    if ppo.rollout_backend == "hf" and n > 1:
        actor.replica = policy.parameter_count() * 4
    roles["actor"] = actor
    rows, tokens, positions = batches["forward"]
    if ppo.lora_rank:  # the actor's base with its adapter off: no weights of its own
        ref = RoleMemory("reference", note="the actor's base, adapter off")
        ref.forward = (forward_working_bytes(policy, tokens, act) + lm_head_bytes(policy, positions, act, False, False)
                       + fsdp_gather_bytes(policy, 2 if gpu else 4, n, False, True))
    else:
        ref = RoleMemory("reference", weights=_shard(policy.parameter_count() * 4, n), note="frozen fp32 policy")
        ref.forward = (forward_working_bytes(policy, tokens, act) + lm_head_bytes(policy, positions, act, False, False)
                       + fsdp_gather_bytes(policy, 4, n, False, True))
    roles["reference"] = ref
    if ppo.adv_estimator == "gae":
        roles["critic"] = _trained_role("critic", policy, ppo, ppo.resolved_critic_lora_rank, False, gpu, act,
                                        batches, head_params=policy.hidden_size + 1)
    if cfg.reward.uses_model and reward_model is not None:
        rm_bytes = 2 if gpu else 4  # bf16 on a GPU (rlhf/reward_model/score.py)
        rm_rows = cfg.reward.micro_batch_size
        rm = RoleMemory("reward_model", weights=_shard((reward_model.parameter_count(False) + reward_model.hidden_size)
                                                       * rm_bytes, n), note="forward only")
        rm.forward = (forward_working_bytes(reward_model, rm_rows * (prompt + response), act)
                      + value_head_bytes(rm_rows, prompt + response, False)
                      + fsdp_gather_bytes(reward_model, rm_bytes, n, False, False))
        roles["reward_model"] = rm

    gen_rows = ppo.rollout_micro_batch_size * ppo.samples_per_prompt
    transient = {
        "generate": hf_generate_bytes(policy, gen_rows, prompt, response, act) if ppo.rollout_backend == "hf" else 0,
        "reward_model": roles["reward_model"].forward if "reward_model" in roles else None,
        "reference": ref.forward,
        "old_logprobs": actor.forward,
        "values": roles["critic"].forward if "critic" in roles else None,
        "update_critic": roles["critic"].train if "critic" in roles else None,
        "update_actor": actor.train,
        # A sharded actor gathers its full weights on every rank to hand them to the rollout engine.
        "sync_weights": actor.weights * n if n > 1 else 0,
    }
    active = {"reference": "actor" if ppo.lora_rank else "reference", "reward_model": "reward_model",
              "values": "critic", "update_critic": "critic"}
    engine = engine_bytes(ppo, total) if gpu and total is not None else 0
    if ppo.resolved_placement == "split":
        devices = [(name,) for name in roles if roles[name].resident or name == "actor"]
    else:
        devices = [tuple(roles)]

    def phases_of(device: tuple, offload: bool, sleep: bool) -> List[Phase]:
        out = []
        for name in PHASES:
            role = active.get(name, "actor")
            if transient[name] is None or role not in device:
                continue
            on = (role,) if offload else device
            resident = sum(roles[r].resident for r in on)
            awake = engine if "actor" in device and (name in ("generate", "sync_weights") or not sleep) else 0
            reserve = int(RESERVE_BYTES + FRAGMENTATION * (resident + transient[name])) if gpu else 0
            out.append(Phase(name, role, on, resident, awake, transient[name], reserve))
        return out

    def busiest(offload: bool, sleep: bool) -> List[Phase]:
        return max((phases_of(d, offload, sleep) for d in devices), key=lambda ps: max(p.total for p in ps))

    fits_awake = available is None or max(p.total for p in busiest(False, False)) <= available
    can_offload = gpu and ppo.resolved_placement == "colocated"
    offload = (ppo.offload_idle_models if isinstance(ppo.offload_idle_models, bool) else not fits_awake) and can_offload
    sleep = bool(engine) and (ppo.vllm_sleep if isinstance(ppo.vllm_sleep, bool) else not fits_awake)
    settings = {"lora_rank": ppo.lora_rank, "critic_lora_rank": ppo.resolved_critic_lora_rank,
                "gradient_checkpointing": ppo.gradient_checkpointing,
                "tokens_per_micro_batch": batches["train"][1], "forward_tokens_per_micro_batch": batches["forward"][1],
                "world_size": n, "placement": ppo.resolved_placement, "activation_bytes": act,
                "policy_params": policy.parameter_count(),
                "reward_model_params": reward_model.parameter_count(False) if "reward_model" in roles else None}
    return MemoryPlan(roles=roles, phases=busiest(offload, sleep), engine=engine, available=available,
                      offload=offload, sleep=sleep, gpus=n * len(devices), settings=settings)


# ====================================================================== predicted: suggestions and the check
def _options(cfg: RunConfig) -> List[List[dict]]:
    """For each binding the suggestions may change, in the order they are tried, its values (each a
    {field: value} of `ppo`), best first: LoRA (the critic follows), a packed token budget (the largest
    that fits: no padding, no recompute), gradient checkpointing, a smaller micro-batch, more GPUs (FSDP2)."""
    ppo = cfg.ppo
    seq = ppo.max_prompt_length + ppo.max_response_length
    options = []
    if not ppo.lora_rank:
        change = {"lora_rank": LORA_SUGGESTION}
        if ppo.adv_estimator == "gae" and ppo.critic_lora_rank == 0:
            change["critic_lora_rank"] = -1
        options.append([change])
    rows = min(ppo.micro_batch_size, ppo.mini_batch_size // ppo.world_size)
    current = ppo.max_tokens_per_micro_batch or rows * seq
    budgets = sorted({2 ** k for k in range(10, 20) if seq <= 2 ** k < current} |
                     ({-(-seq // 256) * 256} if -(-seq // 256) * 256 < current else set()), reverse=True)
    if budgets:
        options.append([{"max_tokens_per_micro_batch": b} for b in budgets])
    if not ppo.gradient_checkpointing:  # after a budget: recomputing every block costs a third more compute
        options.append([{"gradient_checkpointing": True}])
    if not ppo.max_tokens_per_micro_batch:
        smaller = [d for d in range(ppo.micro_batch_size - 1, 0, -1) if ppo.mini_batch_size % d == 0]
        if smaller:
            options.append([{"micro_batch_size": d} for d in smaller])
    sizes = [w for w in (2, 4, 8) if w > ppo.world_size and ppo.mini_batch_size % w == 0]
    if sizes:
        extra = {"placement": "colocated"} if ppo.placement == "local" else {}
        options.append([{"world_size": w, **extra} for w in sizes])
    return options


def _bindings(change: dict) -> List[str]:
    return [f"ppo.{k} = {v!r}" for k, v in change.items()]


def suggest(cfg: RunConfig, policy: ModelShape, reward_model: Optional[ModelShape], *, available: int,
            device_total: Optional[int] = None):
    """(bindings, plan) of the first change that fits: each candidate binding alone, in `_options`'
    order, then pairs, triples... of them; None when nothing tried fits."""
    options = _options(cfg)
    for size in range(1, len(options) + 1):
        for group in itertools.combinations(options, size):
            kinds = {next(iter(g[0])) for g in group}
            if {"max_tokens_per_micro_batch", "micro_batch_size"} <= kinds:
                continue  # a token budget replaces the fixed micro-batch
            for values in itertools.product(*group):
                change = {k: v for value in values for k, v in value.items()}
                try:
                    candidate = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, **change))
                except ConfigError:
                    continue
                plan = predict(candidate, policy, reward_model, available=available, device_total=device_total)
                if plan.fits:
                    return _bindings(change), plan
    return None


def check(cfg: RunConfig, policy: ModelShape, reward_model: Optional[ModelShape] = None, *, available: int,
          device_total: Optional[int] = None) -> MemoryPlan:
    """The predicted plan, or a one-line ConfigError when the run cannot fit in `available` bytes a
    GPU, naming the bindings that would make it fit and their predicted peak."""
    plan = predict(cfg, policy, reward_model, available=available, device_total=device_total)
    if plan.fits:
        return plan
    found = suggest(cfg, policy, reward_model, available=available, device_total=device_total)
    if found is None:
        tried = ", ".join(f"ppo.{next(iter(o[0]))}" for o in _options(cfg))
        fix = (f"no change of {tried or 'the memory bindings'}, alone or combined, makes it fit: "
               f"use a GPU with more memory or a smaller model")
    else:
        bindings, fitted = found
        gpus = f" on {fitted.gpus} GPUs" if fitted.gpus > 1 else ""
        fix = f"it fits with {' and '.join(bindings)} ({fitted.peak.total / GIB:.1f} GiB a GPU{gpus})"
    raise ConfigError(f"ppo: the run {plan.verdict()}; {fix}")


def check_policy(cfg: RunConfig, policy: Optional[ModelShape] = None) -> None:
    """The run's policy checked before anything is built, by the trainer's start and by
    `python -m rlhf.memory` alike (rlhf/models.py `check_policy_dir`: a causal LM, its shape, the LoRA
    bindings against its layers and the critic's): model.name_or_path's config.json, the tiny
    default's shape, or `policy` (a published shape, `--shape`) instead."""
    if policy is not None:
        check_policy_dir(policy.name, "--shape", cfg.ppo, config=policy.config_dict())
    elif cfg.model.name_or_path == "tiny":
        check_policy_dir("tiny", "model.name_or_path", cfg.ppo, config=tiny_shape(cfg.tiny_model).config_dict())
    else:
        check_policy_dir(cfg.model.name_or_path, "model.name_or_path", cfg.ppo)


def run_shapes(cfg: RunConfig, model_dir: Optional[str | Path] = None, policy: Optional[ModelShape] = None) -> tuple:
    """(policy shape, reward-model shape or None) of a run, from config.json files only: the start
    checkpoint (`ppo.init_from`) or the policy dir, and `reward.model_path`. `policy`: given instead."""
    if policy is not None:
        pass
    elif model_dir is not None:
        policy = ModelShape.from_dir(model_dir)
    elif cfg.ppo.init_from and (Path(cfg.ppo.init_from) / "actor" / "config.json").is_file():
        policy = ModelShape.from_dir(Path(cfg.ppo.init_from) / "actor", "ppo.init_from")
    elif cfg.model.name_or_path == "tiny":
        policy = tiny_shape(cfg.tiny_model)
    else:
        policy = ModelShape.from_dir(cfg.model.name_or_path)
    reward_model = ModelShape.from_dir(cfg.reward.model_path, "reward.model_path") if cfg.reward.uses_model else None
    return policy, reward_model


def preflight(cfg: RunConfig, model_dir: Optional[str | Path], device: Optional[torch.device], log=print,
              device_memory_bytes: Optional[tuple] = None) -> Optional[MemoryPlan]:
    """The check at the start of a run, before any model is built. On a GPU (`device` cuda, or a Ray
    run whose driver sees one) the prediction must fit in the GPU's free memory, or a ConfigError
    names the fix; on the CPU the plan is only logged. `device_memory_bytes`: (free, total) to use
    instead of asking CUDA. Returns None (logged) when a model's shape cannot be read."""
    try:
        policy, reward_model = run_shapes(cfg, model_dir)
    except (ConfigError, ValueError) as err:
        log(f"memory plan: not predicted ({str(err).splitlines()[0]})")
        return None
    if device_memory_bytes is None and cfg.ppo.device != "cpu" and torch.cuda.is_available() and (
            device is None or torch.device(device).type == "cuda"):
        device_memory_bytes = torch.cuda.mem_get_info(device if device is not None else 0)
    if device_memory_bytes is None:
        plan = predict(cfg, policy, reward_model, gpu=False)
        log(f"memory plan (predicted, CPU): {plan.verdict()}")
        return plan
    free, total = device_memory_bytes
    plan = check(cfg, policy, reward_model, available=int(free), device_total=int(total))
    log(f"memory plan (predicted): the run {plan.verdict()}")
    return plan


class Offloader:
    """Keeps one role's state on the device: the others' weights, buffers and optimizer state go
    to pinned host buffers (allocated once, reused) with non-blocking copies, which the device's
    stream orders before any later kernel. FSDP2-sharded modules move with their own `.to()`."""

    def __init__(self, roles: Dict[str, "PlacedRole"], device: torch.device):
        self.roles = roles
        self.device = device
        self.active = None
        self.pinned: Dict[tuple, torch.Tensor] = {}

    def _host(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        """`t` copied into its pinned host buffer (keyed by the owning object, which outlives `.data`)."""
        buf = self.pinned.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self.pinned[key] = buf
        buf.copy_(t.detach(), non_blocking=True)
        return buf

    def _move(self, name: str, to_device: bool) -> bool:
        """Moves one role's state; returns whether anything moved."""
        moved = False
        modules, optimizers = self.roles[name].device_state()
        target = self.device if to_device else torch.device("cpu")
        for module in modules:
            tensors = [t for t in _tensors(module) if (t.device.type == "cuda") != to_device]
            moved |= bool(tensors)
            if any(isinstance(p, DTensor) for p in module.parameters()):
                module.to(target)
                continue
            for t in tensors:
                t.data = t.data.to(self.device, non_blocking=True) if to_device else self._host((id(t),), t.data)
        for optimizer in optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step" and (value.device.type == "cuda") != to_device:
                        state[key] = (value.to(self.device, non_blocking=True) if to_device
                                      else self._host((id(state), key), value))
                        moved = True
        return moved

    def activate(self, name: str) -> None:
        if self.active == name:
            return
        freed = [self._move(other, to_device=False) for other in self.roles if other != name]
        if any(freed):
            torch.cuda.empty_cache()  # give the freed blocks back (a vLLM engine allocates outside torch's cache)
        self._move(name, to_device=True)
        self.active = name

    def restore_all(self) -> None:
        for name in self.roles:
            self._move(name, to_device=True)
        self.active = None
        torch.cuda.synchronize(self.device)

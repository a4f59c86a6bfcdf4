"""The predicted memory plan of a run (no GPU, no weights): `predict` sums, for every role on a GPU
(actor, critic, reference, reward model, the vLLM engine), its resident state and what each phase of
a PPO step adds for one micro-batch (rlhf/memory/formulas.py), phase by phase, on the busiest GPU.
`check` refuses a run that cannot fit with one line naming the bindings that would make it fit
(`suggest`); `preflight` is that check at a run's start, before any model is built.

Offloading idle models (`ppo.offload_idle_models`) and vLLM sleep (`ppo.vllm_sleep`) left at 'auto'
resolve by one rule (`resolve_auto`), which the prediction and the runtime decision
(rlhf/memory/runtime.py) share.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Dict, List, Optional

import torch

from rlhf.config import RunConfig
from rlhf.errors import ConfigError
from rlhf.memory.formulas import (
    GIB,
    RoleMemory,
    compiled,
    cublas_workspace_bytes,
    engine_bytes,
    engine_side_bytes,
    forward_peak_bytes,
    fsdp_gather_bytes,
    hf_generate_bytes,
    lm_head_bytes,
    micro_batches,
    shard,
    trained_role,
    value_head_bytes,
)
from rlhf.memory.shapes import ModelShape, tiny_shape
from rlhf.models import check_policy_dir

RESERVE_BYTES = 1 * GIB
"""Kept free on every GPU for what torch does not count: the CUDA context, cuBLAS and NCCL workspaces."""
FRAGMENTATION = 0.04
"""Share of a phase's micro-batch added for the caching allocator's fragmentation."""
RESIDENT_FRAGMENTATION = 0.06
"""Share of the resident roles' state added for the allocator's fragmentation. It stays between phases:
with expandable segments, after each phase's `empty_cache`, the 0.5B recipe's trainer held 0.92 GiB
reserved beside 16.69 allocated (5.5%), in pages that live blocks keep mapped
(bench/results/memory_snapshot/instruct05b_own_process_h100.json; 2.43 GiB with torch's fixed segments,
*_no_expandable_h100.json). At a phase's peak the micro-batch's blocks fill much of that: the updates
reserved 1.8-1.9% above their allocation (instruct05b_recipe_mb12k_own_process_samecall2_h100.json)."""
ENGINE_FRAGMENTATION = 0.02
"""Share of an awake vLLM engine's memory added for what torch reserves beyond it (its sleep-mode pool
and sampling buffers). Measured at the Qwen2.5-7B shape while generating, torch reserved 1.8 GiB above
what it allocated (bench/results/lora7b_recipe_addmm_h200.json) and 2.15 in a later run
(lora7b_recipe_h200.json), where the roles' fragmentation covers 1.6."""
SAFETY_MARGIN = 0.05
"""Share of the GPU a run must leave spare to count as fitting: whole steps can take more than the
per-phase estimate, and a run predicted with less spare ran out of memory (bench/results/gpu_h200.md),
so a fit closer than this is refused."""
SLIM_MARGIN = 0.10
"""A run that fits with less than this share of the GPU to spare is flagged as a slim fit."""
LORA_SUGGESTION = 64
"""The LoRA rank the suggestions try (verl's and OpenRLHF's examples commonly use 32-64)."""


def fragmentation_bytes(resident: int, transient: int) -> int:
    """What the caching allocator holds beyond a phase's allocation: RESIDENT_FRAGMENTATION of the roles'
    resident state and FRAGMENTATION of the micro-batch."""
    return int(RESIDENT_FRAGMENTATION * resident + FRAGMENTATION * transient)


def resolve_auto(offload_mode, sleep_mode, fits: bool, can_offload: bool) -> tuple:
    """(offload, sleep): `ppo.offload_idle_models` and `ppo.vllm_sleep` as bound when True or False;
    'auto' turns either on only when the roles do not fit beside the awake engine (`fits`). Idle
    roles leave the device only where the placement can move them (`can_offload`)."""
    offload = (offload_mode if isinstance(offload_mode, bool) else not fits) and can_offload
    sleep = sleep_mode if isinstance(sleep_mode, bool) else not fits
    return offload, sleep


@dataclasses.dataclass
class Phase:
    """One phase of a PPO step on one GPU: the roles resident, the vLLM engine when awake, what the
    phase's micro-batch adds, the trainer's cuBLAS workspaces (`cublas_workspace_bytes`), and the reserve
    (RESERVE_BYTES + the allocator's fragmentation of the roles and the micro-batch, `fragmentation_bytes`,
    + ENGINE_FRAGMENTATION of an awake engine + what the engine holds beyond its share, awake or asleep:
    `engine_side_bytes`)."""

    name: str
    role: str
    roles: tuple
    resident: int
    engine: int
    transient: int
    reserve: int
    workspaces: int = 0

    @property
    def allocated(self) -> int:
        """What torch allocates in the phase at its peak: everything but the reserve."""
        return self.resident + self.engine + self.transient + self.workspaces

    @property
    def total(self) -> int:
        return self.allocated + self.reserve


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
        return (self.available is not None and bool(self.fits)
                and self.available - self.peak.total < SLIM_MARGIN * self.available)

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
        if p.workspaces:
            parts.append(f"cuBLAS {p.workspaces / GIB:.1f}")
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
                                    "micro_batch_gb": gb(p.transient), "cublas_gb": gb(p.workspaces),
                                    "reserve_gb": gb(p.reserve)}
                           for p in self.phases},
                "verdict": self.verdict()}


def planned_prompt(ppo, longest_prompt: Optional[int] = None) -> int:
    """The prompt length the plan sizes the policy's sequences by: the longest prompt of the run's data
    (in the policy's tokens, as the trainer measures it at its start), never above
    ppo.max_prompt_length, which the rollout cuts longer prompts to; ppo.max_prompt_length when the
    data was not measured."""
    return min(ppo.max_prompt_length, longest_prompt) if longest_prompt else ppo.max_prompt_length


def predict(cfg: RunConfig, policy: ModelShape, reward_model: Optional[ModelShape] = None, *,
            available: Optional[int] = None, device_total: Optional[int] = None, gpu: bool = True,
            longest_prompt: Optional[int] = None) -> MemoryPlan:
    """The run's predicted memory on its busiest GPU, phase by phase (no GPU, no weights).

    `available`: bytes the run may use on each GPU (None: nothing to check against); `device_total`:
    the GPU's whole memory, of which vLLM takes its share (default `available`). `gpu=False` plans the
    CPU path (fp32, no engine). `longest_prompt`: the data's longest prompt in the policy's tokens
    (`planned_prompt`); the reward model, whose own template encodes the conversation, keeps
    ppo.max_prompt_length. Offloading and vLLM sleep left at 'auto' are decided as the runtime
    decides them: on when the roles, the awake engine and the largest micro-batch do not fit."""
    ppo, n = cfg.ppo, cfg.ppo.world_size
    total = device_total if device_total is not None else available
    act = 2 if gpu and ppo.bf16_autocast else 4
    prompt, response = planned_prompt(ppo, longest_prompt), ppo.max_response_length
    batches = micro_batches(ppo, prompt, response)

    roles: Dict[str, RoleMemory] = {}
    actor = trained_role("actor", policy, ppo, ppo.lora_rank, True, gpu, act, batches)
    if ppo.rollout_backend == "hf" and n > 1:
        actor.replica = policy.parameter_count() * 4
    roles["actor"] = actor
    rows, tokens, positions = batches["forward"]
    ref_head = lm_head_bytes(policy, positions, act, False, False, fused=compiled(ppo, gpu))
    if ppo.lora_rank:  # the actor's base with its adapter off: no weights of its own
        ref = RoleMemory("reference", note="the actor's base, adapter off")
        ref.forward = (forward_peak_bytes(policy, tokens, act, ref_head)
                       + fsdp_gather_bytes(policy, 2 if gpu else 4, n, False, True))
    else:
        ref = RoleMemory("reference", weights=shard(policy.parameter_count() * 4, n), note="frozen fp32 policy")
        ref.forward = (forward_peak_bytes(policy, tokens, act, ref_head)
                       + fsdp_gather_bytes(policy, 4, n, False, True))
    roles["reference"] = ref
    if ppo.uses_critic:
        roles["critic"] = trained_role("critic", policy, ppo, ppo.resolved_critic_lora_rank, False, gpu, act,
                                        batches, head_params=policy.hidden_size + 1)
    if cfg.reward.uses_model and reward_model is not None:
        rm_bytes = 2 if gpu else 4  # bf16 on a GPU (rlhf/reward_model/score.py)
        rm_rows = cfg.reward.micro_batch_size
        rm = RoleMemory("reward_model", weights=shard((reward_model.parameter_count(False) + reward_model.hidden_size)
                                                       * rm_bytes, n), note="forward only")
        rm_seq = ppo.max_prompt_length + response
        rm.forward = (forward_peak_bytes(reward_model, rm_rows * rm_seq, act, value_head_bytes(rm_rows, rm_seq, False))
                      + fsdp_gather_bytes(reward_model, rm_bytes, n, False, False))
        roles["reward_model"] = rm

    gen_rows = ppo.rollout_micro_batch_size * ppo.samples_per_prompt
    transient = {
        "generate": hf_generate_bytes(policy, gen_rows, prompt, response, act) if ppo.rollout_backend == "hf" else 0,
        "reward_model": roles["reward_model"].forward if "reward_model" in roles else None,
        "reference": ref.forward,
        "old_logprobs": None if ppo.on_policy_update else actor.forward,  # an on-policy update skips the pass
        "values": roles["critic"].forward if "critic" in roles else None,
        "update_critic": roles["critic"].train if "critic" in roles else None,
        "update_actor": actor.train,
        # A sharded actor gathers its full weights on every rank to hand them to the rollout engine.
        "sync_weights": actor.weights * n if n > 1 else 0,
    }
    active = {"reference": "actor" if ppo.lora_rank else "reference", "reward_model": "reward_model",
              "values": "critic", "update_critic": "critic"}
    engine = engine_bytes(ppo, total) if gpu and total is not None else 0
    engine_side = engine_side_bytes(ppo, policy) if engine else 0  # awake or asleep
    if ppo.resolved_placement == "split":
        devices = [(name,) for name in roles if roles[name].resident or name == "actor"]
    else:
        devices = [tuple(roles)]

    def phases_of(device: tuple, offload: bool, sleep: bool) -> List[Phase]:
        out = []
        workspaces = cublas_workspace_bytes(device, gpu)
        for name in PHASES:
            role = active.get(name, "actor")
            if transient[name] is None or role not in device:
                continue
            on = (role,) if offload else device
            resident = sum(roles[r].resident for r in on)
            awake = engine if "actor" in device and (name in ("generate", "sync_weights") or not sleep) else 0
            reserve = int(RESERVE_BYTES + fragmentation_bytes(resident, transient[name])
                          + ENGINE_FRAGMENTATION * awake + (engine_side if "actor" in device else 0)) if gpu else 0
            out.append(Phase(name, role, on, resident, awake, transient[name], reserve, workspaces))
        return out

    def busiest(offload: bool, sleep: bool) -> List[Phase]:
        return max((phases_of(d, offload, sleep) for d in devices), key=lambda ps: max(p.total for p in ps))

    # 'auto' keeps the engine awake only where the whole plan then fits as `fits` counts fitting
    # (within SAFETY_MARGIN): an engine left awake in a plan that the check then refuses helps no one.
    fits_awake = available is None or max(p.total for p in busiest(False, False)) <= (1 - SAFETY_MARGIN) * available
    can_offload = gpu and ppo.resolved_placement == "colocated"
    offload, sleep = resolve_auto(ppo.offload_idle_models, ppo.vllm_sleep, fits_awake, can_offload)
    sleep = bool(engine) and sleep
    settings = {"lora_rank": ppo.lora_rank, "critic_lora_rank": ppo.resolved_critic_lora_rank,
                "gradient_checkpointing": ppo.gradient_checkpointing,
                "prompt_tokens": prompt,
                "tokens_per_micro_batch": batches["train"][1], "forward_tokens_per_micro_batch": batches["forward"][1],
                "world_size": n, "placement": ppo.resolved_placement, "activation_bytes": act,
                "policy_params": policy.parameter_count(),
                "reward_model_params": (reward_model.parameter_count(False)
                                        if "reward_model" in roles and reward_model is not None else None)}
    return MemoryPlan(roles=roles, phases=busiest(offload, sleep), engine=engine, available=available,
                      offload=offload, sleep=sleep, gpus=n * len(devices), settings=settings)


# ====================================================================== predicted: suggestions and the check
def _options(cfg: RunConfig, longest_prompt: Optional[int] = None) -> List[List[dict]]:
    """For each binding the suggestions may change, in the order they are tried, its values (each a
    {field: value} of `ppo`), best first: a packed token budget (the largest that fits of the powers of
    two and the 3 x 2^k between them: no padding, no recompute), gradient checkpointing, LoRA (the
    critic follows), a smaller micro-batch, more GPUs (FSDP2). The first two change only how the same
    update is computed; LoRA changes what trains, so it comes after them (alone or with them where
    nothing else fits). A budget holds at least one whole sequence (`planned_prompt` + response)."""
    ppo = cfg.ppo
    seq = planned_prompt(ppo, longest_prompt) + ppo.max_response_length
    options = []
    rows = min(ppo.micro_batch_size, ppo.mini_batch_size // ppo.world_size)
    current = ppo.max_tokens_per_micro_batch or rows * seq
    # Powers of two and the steps between them (3 x 2^k: 12288 between 8192 and 16384): the largest that fits.
    budgets = sorted({m << k for m in (2, 3) for k in range(9, 19) if seq <= m << k < current} |
                     ({-(-seq // 256) * 256} if -(-seq // 256) * 256 < current else set()), reverse=True)
    if budgets:
        options.append([{"max_tokens_per_micro_batch": b} for b in budgets])
    if not ppo.gradient_checkpointing:  # after a budget: recomputing every block costs a third more compute
        options.append([{"gradient_checkpointing": True}])
    if not ppo.lora_rank:
        change = {"lora_rank": LORA_SUGGESTION}
        if ppo.uses_critic and ppo.critic_lora_rank == 0:
            change["critic_lora_rank"] = -1
        options.append([change])
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
    """The change as bindings, LoRA's first: of a combination it is the change that matters most."""
    first = ("lora_rank", "critic_lora_rank")
    order = sorted(change, key=lambda k: (k not in first, first.index(k) if k in first else 0))
    return [f"ppo.{k} = {change[k]!r}" for k in order]


def suggest(cfg: RunConfig, policy: ModelShape, reward_model: Optional[ModelShape], *, available: int,
            device_total: Optional[int] = None, longest_prompt: Optional[int] = None):
    """(bindings, plan) of the first change that fits: each candidate binding alone, in `_options'
    order, then pairs, triples... of them, first on the run's GPUs and only then with more of them
    (`ppo.world_size`); None when nothing tried fits."""
    options = _options(cfg, longest_prompt)
    same_gpus = [o for o in options if "world_size" not in o[0]]
    groups = [g for size in range(1, len(same_gpus) + 1) for g in itertools.combinations(same_gpus, size)]
    groups += [g for size in range(1, len(options) + 1) for g in itertools.combinations(options, size)
               if any("world_size" in o[0] for o in g)]
    for group in groups:
        kinds = {next(iter(g[0])) for g in group}
        if {"max_tokens_per_micro_batch", "micro_batch_size"} <= kinds:
            continue  # a token budget replaces the fixed micro-batch
        for values in itertools.product(*group):
            change = {k: v for value in values for k, v in value.items()}
            try:
                candidate = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, **change))
            except ConfigError:
                continue
            plan = predict(candidate, policy, reward_model, available=available, device_total=device_total,
                           longest_prompt=longest_prompt)
            if plan.fits:
                return _bindings(change), plan
    return None


def check(cfg: RunConfig, policy: ModelShape, reward_model: Optional[ModelShape] = None, *, available: int,
          device_total: Optional[int] = None, longest_prompt: Optional[int] = None) -> MemoryPlan:
    """The predicted plan, or a one-line ConfigError when the run cannot fit in `available` bytes a
    GPU, naming the bindings that would make it fit and their predicted peak."""
    plan = predict(cfg, policy, reward_model, available=available, device_total=device_total,
                   longest_prompt=longest_prompt)
    if plan.fits:
        return plan
    found = suggest(cfg, policy, reward_model, available=available, device_total=device_total,
                    longest_prompt=longest_prompt)
    if found is None:
        tried = ", ".join(f"ppo.{next(iter(o[0]))}" for o in _options(cfg, longest_prompt))
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
              device_memory_bytes: Optional[tuple] = None, longest_prompt: Optional[int] = None
              ) -> Optional[MemoryPlan]:
    """The check at the start of a run, before any model is built. On a GPU (`device` cuda, or a Ray
    run whose driver sees one) the prediction must fit in the GPU's free memory, or a ConfigError
    names the fix; on the CPU the plan is only logged. `device_memory_bytes`: (free, total) to use
    instead of asking CUDA; `longest_prompt`: the data's, measured (`planned_prompt`). Returns None
    (logged) when a model's shape cannot be read."""
    try:
        policy, reward_model = run_shapes(cfg, model_dir)
    except (ConfigError, ValueError) as err:
        log(f"memory plan: not predicted ({str(err).splitlines()[0]})")
        return None
    if device_memory_bytes is None and cfg.ppo.device != "cpu" and torch.cuda.is_available() and (
            device is None or torch.device(device).type == "cuda"):
        device_memory_bytes = torch.cuda.mem_get_info(device if device is not None else 0)
    prompt = planned_prompt(cfg.ppo, longest_prompt)
    sequences = (f"; sequences of the data's longest prompt, {prompt} tokens, + {cfg.ppo.max_response_length}"
                 if prompt < cfg.ppo.max_prompt_length else "")
    if device_memory_bytes is None:
        plan = predict(cfg, policy, reward_model, gpu=False, longest_prompt=longest_prompt)
        log(f"memory plan (predicted, CPU): {plan.verdict()}{sequences}")
        return plan
    free, total = device_memory_bytes
    plan = check(cfg, policy, reward_model, available=int(free), device_total=int(total),
                 longest_prompt=longest_prompt)
    log(f"memory plan (predicted): the run {plan.verdict()}{sequences}")
    return plan


# ====================================================================== measured: a phase that ran out anyway
UPDATE_PHASES = ("update_actor", "update_critic")
FORWARD_PHASES = ("reference", "old_logprobs", "values", "reward_model")


def relief(cfg: RunConfig, phase: str, longest_prompt: Optional[int] = None) -> str:
    """The binding that most directly shrinks what `phase` holds, for the line of a phase that ran out
    of GPU memory: a smaller micro-batch of that phase (its token budget halved while a whole sequence,
    `planned_prompt` + response, still fits), gradient checkpointing for an update, or vLLM asleep for
    what the awake engine takes."""
    ppo = cfg.ppo
    seq = planned_prompt(ppo, longest_prompt) + ppo.max_response_length
    if phase == "reward_model":
        return f"reward.micro_batch_size = {max(1, cfg.reward.micro_batch_size // 2)}"
    if phase in UPDATE_PHASES:
        if ppo.max_tokens_per_micro_batch and ppo.max_tokens_per_micro_batch // 2 >= seq:
            return f"ppo.max_tokens_per_micro_batch = {ppo.max_tokens_per_micro_batch // 2}"
        if not ppo.gradient_checkpointing:
            return "ppo.gradient_checkpointing = True"
        if not ppo.max_tokens_per_micro_batch and ppo.micro_batch_size > 1:
            return f"ppo.micro_batch_size = {ppo.micro_batch_size // 2}"
    if phase in FORWARD_PHASES:
        budget = ppo.forward_max_tokens
        if budget and budget // 2 >= max(seq, ppo.max_tokens_per_micro_batch):
            return f"ppo.forward_max_tokens_per_micro_batch = {budget // 2}"
        if budget and ppo.max_tokens_per_micro_batch // 2 >= seq:
            return f"ppo.max_tokens_per_micro_batch = {ppo.max_tokens_per_micro_batch // 2}"
        if not budget and ppo.forward_batch_size > 1:
            return f"ppo.forward_micro_batch_size = {ppo.forward_batch_size // 2}"
    if phase == "generate" and ppo.rollout_backend == "hf" and ppo.rollout_micro_batch_size > 1:
        return (f"ppo.rollout_micro_batch_size = {ppo.rollout_micro_batch_size // 2} (and ppo.num_rollout_batches "
                f"= {ppo.num_rollout_batches * 2} for the same prompts an iteration)")
    if ppo.rollout_backend == "vllm" and ppo.vllm_sleep is not True:
        return "ppo.vllm_sleep = True"
    return "a smaller model, or ppo.world_size > 1 (the model sharded over more GPUs)"

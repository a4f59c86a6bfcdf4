"""The memory plan applied on a GPU once the roles are built: the sum of what each holds resident
(`state_bytes`: weights and buffers; for a trained role also its gradients and AdamW's two moments)
plus the predicted activations must fit beside the awake rollout engine, or idle roles are offloaded
(rlhf/memory/offload.py) and vLLM sleeps, by the rule the prediction uses (rlhf/memory/plan.py
`resolve_auto`). The decision and its figures are logged and recorded in provenance
(`placement.memory`, beside the prediction in `placement.memory_predicted`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

from rlhf.memory.formulas import GIB, engine_bytes
from rlhf.memory.plan import SAFETY_MARGIN, resolve_auto

if TYPE_CHECKING:
    from rlhf.memory.plan import MemoryPlan
    from rlhf.roles import ActorRole, PlacedRole

ACTIVATION_HEADROOM = 0.2
"""Share of the device's memory kept free for activations when no prediction is at hand."""


def device_memory(device: torch.device) -> dict:
    if torch.device(device).type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"device_free_gb": free / GIB, "device_total_gb": total / GIB,
            "allocated_gb": torch.cuda.memory_allocated(device) / GIB}


def module_tensors(module: torch.nn.Module) -> List[torch.Tensor]:
    """A module's parameters and buffers: what it holds on its device."""
    return list(module.parameters()) + list(module.buffers())


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t  # a sharded parameter: this rank's part
    return local.numel() * local.element_size()


def state_bytes(role: "PlacedRole") -> int:
    """Bytes the role holds on its device when resident and at work (this rank's shard)."""
    modules, optimizers = role.device_state()
    total = sum(_local_bytes(t) for m in modules for t in module_tensors(m))
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                # gradient + AdamW's exp_avg and exp_avg_sq, in the parameter's dtype
                total += 3 * _local_bytes(p)
    return total


def plan_memory(offload_mode, sleep_mode, role_bytes: Dict[str, int], available: int, total: int,
                can_offload: bool, headroom: Optional[int] = None) -> dict:
    """Whether idle roles leave the device between phases (`ppo.offload_idle_models`) and whether
    the vLLM engine sleeps between rollouts (`ppo.vllm_sleep`), and why. 'auto' (`resolve_auto`) turns
    either on only when the roles' resident state plus `headroom` (the predicted activations and reserve;
    default a flat ACTIVATION_HEADROOM of the device) does not fit in `available` (what the device
    has beside the awake engine, counting what the roles hold already)."""
    need = sum(role_bytes.values())
    predicted = headroom is not None
    headroom = int(ACTIVATION_HEADROOM * total) if headroom is None else int(headroom)
    # The predicted plan's margin (rlhf/memory/plan.py SAFETY_MARGIN), so that both decide alike.
    fits = need + headroom <= available - SAFETY_MARGIN * total
    offload, sleep = resolve_auto(offload_mode, sleep_mode, fits, can_offload)
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

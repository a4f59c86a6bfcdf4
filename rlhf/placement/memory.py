"""Device memory for colocated roles: what each role's state takes, whether the roles fit on the
device together, and moving idle roles' state to pinned host memory when they do not.

`ppo.offload_idle_models = 'auto'` (the default) builds colocated roles with offloading on, so
building never overflows, then sums what each would hold resident (weights and buffers; for a
trained role also its gradients and AdamW's two moments, allocated at its first step) and keeps
every role on the device when that sum plus a headroom for activations fits in what the device
has free beside the awake rollout engine; `ppo.vllm_sleep = 'auto'` keeps the engine awake on
the same condition. The decision and its figures are logged and recorded in provenance
(`placement.memory`).
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch
from torch.distributed.tensor import DTensor

ACTIVATION_HEADROOM = 0.2
"""Share of the device's memory kept free for activations, logits and the allocator's slack."""
GIB = 2 ** 30


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


def state_bytes(role) -> int:
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
                can_offload: bool) -> dict:
    """Whether idle roles leave the device between phases (`ppo.offload_idle_models`) and whether
    the vLLM engine sleeps between rollouts (`ppo.vllm_sleep`), and why. 'auto' turns either on
    only when the roles' resident state plus the activation headroom does not fit in `available`
    (what the device has free beside the awake engine, plus what the roles hold already)."""
    need = sum(role_bytes.values())
    headroom = int(ACTIVATION_HEADROOM * total)
    fits = need + headroom <= available
    offload = (offload_mode if isinstance(offload_mode, bool) else not fits) and can_offload
    sleep = sleep_mode if isinstance(sleep_mode, bool) else not fits
    reason = (f"the roles need {need / GIB:.2f} GiB resident + {headroom / GIB:.1f} GiB headroom of "
              f"{available / GIB:.1f} GiB available: " + ("they fit" if fits else "they do not fit"))
    return {"offload": offload, "rollout_sleep": sleep, "fits": fits, "reason": reason,
            "modes": {"offload_idle_models": offload_mode, "vllm_sleep": sleep_mode},
            "role_gb": {k: round(v / GIB, 3) for k, v in role_bytes.items()}, "resident_gb": round(need / GIB, 3),
            "available_gb": round(available / GIB, 3), "headroom_gb": round(headroom / GIB, 3)}


def describe(plan: dict) -> str:
    return (f"memory plan: offload idle models {'on' if plan['offload'] else 'off'}, vLLM sleep "
            f"{'on' if plan['rollout_sleep'] else 'off'} ({plan['reason']})")


class Offloader:
    """Keeps one role's state on the device: the others' weights, buffers and optimizer state go
    to pinned host buffers (allocated once, reused) with non-blocking copies, which the device's
    stream orders before any later kernel. FSDP2-sharded modules move with their own `.to()`."""

    def __init__(self, roles: dict, device: torch.device):
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

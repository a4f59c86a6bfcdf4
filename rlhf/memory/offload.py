"""Moving idle roles' state to pinned host memory and back, when the roles do not fit on the device
together (`ppo.offload_idle_models`, decided by rlhf/memory/runtime.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch
from torch.distributed.tensor import DTensor

from rlhf.memory.runtime import module_tensors

if TYPE_CHECKING:
    from rlhf.roles import PlacedRole


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
            tensors = [t for t in module_tensors(module) if (t.device.type == "cuda") != to_device]
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

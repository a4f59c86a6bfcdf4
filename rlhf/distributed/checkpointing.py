"""Stand-ins for a model, optimizer and scheduler whose state lives on a group's ranks.

`rlhf/checkpoint.py` calls `save_pretrained`, `state_dict` and `load_state_dict` on the objects it
is given; these answer with the full (unsharded) states gathered on rank 0 and hand loaded states
to every rank, so a distributed run writes and reads the single-process checkpoint format, and
the controller writes every file (the ranks may run on other machines).
"""

from __future__ import annotations

from pathlib import Path

import ray
from torch.nn.modules.module import _IncompatibleKeys


class ModelStandIn:
    def __init__(self, group):
        self.group = group

    def save_pretrained(self, path, safe_serialization: bool = True) -> None:
        """The policy as an HF checkpoint, exactly as the one-process model would write it."""
        files = self.group.on_all("model_files")[0]
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (out / name).write_bytes(data)

    def state_dict(self) -> dict:
        return self.group.on_all("model_state")[0]

    def load_state_dict(self, state: dict, strict: bool = True):
        missing, unexpected = self.group.on_all("load_model_state", ray.put(dict(state)), strict)[0]
        if strict and (missing or unexpected):
            raise RuntimeError(f"state does not match the {self.group.role}: missing {missing}, unexpected {unexpected}")
        return _IncompatibleKeys(missing, unexpected)


class OptimizerStandIn:
    def __init__(self, group):
        self.group = group

    def state_dict(self) -> dict:
        return self.group.on_all("optimizer_state")[0]

    def load_state_dict(self, state: dict) -> None:
        self.group.on_all("load_optimizer_state", ray.put(state))


class SchedulerStandIn:
    def __init__(self, group):
        self.group = group

    def state_dict(self) -> dict:
        return ray.get(self.group.hosts[0].call.remote(self.group.role, "scheduler_state"))

    def load_state_dict(self, state: dict) -> None:
        self.group.on_all("load_scheduler_state", state)

"""What the trained roles (actor, critic) share on a rank: full state dicts of their FSDP2 shards
for checkpoints, and moving the shards and optimizer state off and back onto the device."""

from __future__ import annotations

from typing import Dict

import torch

from rlhf.distributed import fsdp


class TrainableShard:
    """Mixin over `self.worker` (an ActorWorker or CriticWorker with a sharded model) and `self.device`."""

    def model_state(self) -> Dict[str, torch.Tensor]:
        return fsdp.full_model_state(self.worker.model, rank0_cpu=True)

    def load_model_state(self, state: Dict[str, torch.Tensor], strict: bool):
        result = fsdp.load_full_model_state(self.worker.model, state, strict)
        return list(result.missing_keys), list(result.unexpected_keys)

    def optimizer_state(self) -> dict:
        return fsdp.full_optimizer_state(self.worker.model, self.worker.optimizer)

    def load_optimizer_state(self, state: dict) -> None:
        fsdp.load_full_optimizer_state(self.worker.model, self.worker.optimizer, state)

    def scheduler_state(self) -> dict:
        return self.worker.scheduler.state_dict()

    def load_scheduler_state(self, state: dict) -> None:
        self.worker.scheduler.load_state_dict(state)

    def offload(self) -> None:
        fsdp.move_model(self.worker.model, torch.device("cpu"))
        fsdp.move_optimizer(self.worker.optimizer, torch.device("cpu"))

    def onload(self) -> None:
        fsdp.move_model(self.worker.model, self.device)
        fsdp.move_optimizer(self.worker.optimizer, self.device)

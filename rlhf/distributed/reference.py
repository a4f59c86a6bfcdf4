"""The reference policy on one rank: its FSDP2 shard of the frozen starting policy."""

from __future__ import annotations

import torch

from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.distributed import fsdp
from rlhf.models import load_policy
from rlhf.workers.reference import ReferenceWorker


class ReferenceRole:
    def __init__(self, ranks, device: torch.device, ppo: PPOConfig, model_dir: str, autocast_dtype=None):
        self.device = device
        model = fsdp.shard(load_policy(model_dir).to(device), device.type, ranks.world_size)
        self.worker = ReferenceWorker(model, device, ppo.temperature, ppo.micro_batch_size, autocast_dtype)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.worker.compute_logprobs(batch)

    def offload(self) -> None:
        fsdp.move_model(self.worker.model, torch.device("cpu"))

    def onload(self) -> None:
        fsdp.move_model(self.worker.model, self.device)

"""The critic on one rank: its FSDP2 shard of the value model, trained by the local `CriticWorker`."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

from rlhf import checkpoint
from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.distributed import fsdp
from rlhf.distributed.trainable import TrainableShard
from rlhf.models import ValueModel
from rlhf.rollout import derive_seed
from rlhf.workers.critic import CriticWorker


class CriticRole(TrainableShard):
    def __init__(self, ranks, device: torch.device, ppo: PPOConfig, model_dir: str, random_init: bool,
                 total_updates: int, autocast_dtype=None):
        self.ranks = ranks
        self.device = device
        # Same seed and same weights as the single-process critic: the value head starts identical.
        model = ValueModel.from_policy_checkpoint(model_dir, seed=derive_seed(ppo.seed, 1), random_init=random_init)
        if ppo.init_from and (Path(ppo.init_from) / "critic.safetensors").is_file():
            checkpoint.load_weights(model, Path(ppo.init_from) / "critic.safetensors")
        model = fsdp.shard(model.to(device), device.type, ranks.world_size)
        self.worker = CriticWorker(model, ppo, device, total_updates, autocast_dtype, ranks=ranks)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return self.worker.compute_values(batch)

    def update(self, batch: Batch, shuffle_seed: int) -> Dict[str, float]:
        return self.worker.update(batch, shuffle_seed=shuffle_seed)

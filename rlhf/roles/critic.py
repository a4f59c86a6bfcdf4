"""The critic: a value model trained on GAE returns with a clipped value loss."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

from rlhf import algos, checkpoint
from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.models import ValueModel
from rlhf.packing import micro_batches, packed_row
from rlhf.roles.common import StatAccumulator, TrainedRole, global_stats, sequence_inputs
from rlhf.roles.dispatch import ALL, ROWS, dispatch
from rlhf.rollout import derive_seed


class Critic(TrainedRole):
    name = "critic"
    learning_rate = "critic_learning_rate"

    def __init__(self, ctx, ppo: PPOConfig, model_dir: str, random_init: bool, total_updates: int,
                 model: torch.nn.Module | None = None):
        """The policy's backbone with a value head; the same seed gives the same head on every
        placement. `ppo.init_from` with a critic restores its weights. `model`: already built."""
        if model is None:
            model = ValueModel.from_policy_checkpoint(model_dir, seed=derive_seed(ppo.seed, 1), random_init=random_init)
            if ppo.init_from and (Path(ppo.init_from) / "critic.safetensors").is_file():
                checkpoint.load_weights(model, Path(ppo.init_from) / "critic.safetensors")
        super().__init__(ctx, model, ppo, total_updates)

    def _values(self, micro: Batch) -> torch.Tensor:
        row = packed_row(micro, self.device)
        if row is not None:  # one row without padding (rlhf/packing.py), back to the padded [B, R]
            with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype,
                                enabled=self.autocast_dtype is not None):
                values = self.model(row.input_ids, position_ids=row.position_ids)
            return row.unpack(values[0, row.index].float())
        ids, mask, P = sequence_inputs(micro, self.device)
        R = micro["response_ids"].shape[1]
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            values = self.model(ids, mask)
        return values[:, P - 1:P - 1 + R].float()

    @dispatch(ROWS)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """V(prompt + response[:t]) for every response position t, [B, R]."""
        self.model.eval()
        return torch.cat([self._values(m).cpu() for m in micro_batches(
            batch, self.cfg.forward_batch_size, self.cfg.max_tokens_per_micro_batch, self.ranks)])

    @dispatch(ALL)
    def update(self, batch: Batch, shuffle_seed: int) -> Dict[str, float]:
        """Value regression on the rollout buffer (epochs, mini-batches and rank shares as in
        TrainedWorker.optimize)."""
        cfg = self.cfg
        stats = StatAccumulator()

        def micro_step(micro: Batch, normalizer: float) -> None:
            mask = micro["response_mask"].to(self.device).float()
            returns = micro["returns"].to(self.device)
            values = self._values(micro)
            loss, vstats = algos.value_loss(values, micro["values"].to(self.device), returns, mask,
                                            cfg.value_clip_range, cfg.loss_aggregation, normalizer)
            loss.backward()
            vstats["value_loss"] = algos.masked_mean(0.5 * (values.detach() - returns).square(), mask)
            stats.add({k: float(v) for k, v in vstats.items()}, float(mask.sum()))

        grad_norm = self.optimize(batch, shuffle_seed, micro_step)
        out = {f"critic/{k}": v for k, v in global_stats(stats, self.ranks).items()}
        out["critic/grad_norm"] = grad_norm
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        return out

"""The critic: a value model trained on GAE returns with a clipped value loss."""

from __future__ import annotations

from typing import Dict

import torch

from rlhf import algos
from rlhf.batch import Batch
from rlhf.workers.common import StatAccumulator, TrainedWorker, global_stats, sequence_inputs


class CriticWorker(TrainedWorker):
    learning_rate = "critic_learning_rate"

    def _values(self, micro: Batch) -> torch.Tensor:
        ids, mask, P = sequence_inputs(micro, self.device)
        R = micro["response_ids"].shape[1]
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None):
            values = self.model(ids, mask)
        return values[:, P - 1:P - 1 + R].float()

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """V(prompt + response[:t]) for every response position t, [B, R]."""
        self.model.eval()
        return torch.cat([self._values(m).cpu() for m in batch.split(self.cfg.micro_batch_size)])

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

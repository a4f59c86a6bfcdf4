"""The actor: the policy being trained. Recomputes old log-probs and runs the clipped PPO update
over `ppo_epochs` x mini-batches, each mini-batch accumulated over micro-batches."""

from __future__ import annotations

from typing import Dict

import torch

from rlhf import algos
from rlhf.batch import Batch
from rlhf.workers.common import StatAccumulator, TrainedWorker, global_stats, response_logprobs

RATIO_BIN_EDGES = [round(0.05 * i, 2) for i in range(41)]  # 0.0 .. 2.0; ratios above 2 land in the last bin


class ActorWorker(TrainedWorker):
    learning_rate = "actor_learning_rate"

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the sampled response tokens and per-token entropy, [B, R] each."""
        self.model.eval()
        logps, ents = [], []
        for micro in batch.split(self.cfg.micro_batch_size):
            logprobs, entropy = response_logprobs(self.model, micro, self.device, self.cfg.temperature,
                                                  self.autocast_dtype, fused=self.fused)
            logps.append(logprobs.cpu())
            ents.append(entropy.cpu())
        return torch.cat(logps), torch.cat(ents)

    def update(self, batch: Batch, shuffle_seed: int, kl_coef: float) -> Dict[str, object]:
        """PPO update on the rollout buffer (epochs, mini-batches and rank shares as in
        TrainedWorker.optimize). `batch` carries old_logprobs, advantages, response_mask and, when
        the KL is a loss term, ref_logprobs."""
        cfg, ranks = self.cfg, self.ranks
        stats = StatAccumulator()
        ratio_counts = torch.zeros(len(RATIO_BIN_EDGES) - 1, dtype=torch.long)

        def micro_step(micro: Batch, normalizer: float) -> None:
            mask = micro["response_mask"].to(self.device).float()
            old_logprobs, advantages = micro["old_logprobs"].to(self.device), micro["advantages"].to(self.device)
            logprobs, entropy = response_logprobs(self.model, micro, self.device, cfg.temperature,
                                                  self.autocast_dtype, fused=self.fused)
            pg_loss, pg_stats = algos.policy_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_range,
                                                  cfg.dual_clip, cfg.loss_aggregation, normalizer)
            entropy_term = algos.aggregate(entropy, mask, cfg.loss_aggregation, normalizer)
            loss = pg_loss - cfg.entropy_coef * entropy_term
            if cfg.kl_mode == "loss":
                kl = algos.kl_penalty(logprobs, micro["ref_logprobs"].to(self.device), cfg.kl_estimator)
                loss = loss + kl_coef * algos.aggregate(kl, mask, cfg.loss_aggregation, normalizer)
                pg_stats["kl_loss"] = algos.masked_mean(kl.detach(), mask)
            loss.backward()
            with torch.no_grad():
                ratio = torch.exp(logprobs.detach() - old_logprobs)
                pg_stats["entropy"] = algos.masked_mean(entropy.detach(), mask)
                pg_stats["pg_loss"] = algos.masked_mean(-advantages * ratio, mask)
                ratio_counts.add_(torch.histc(ratio[mask.bool()].clamp(0, 2).cpu().float(),
                                              bins=len(RATIO_BIN_EDGES) - 1, min=0, max=2).long())
            stats.add({k: float(v) for k, v in pg_stats.items()}, float(mask.sum()))

        grad_norm = self.optimize(batch, shuffle_seed, micro_step)
        ratio_counts = ranks.sum(ratio_counts)
        out = {f"actor/{k}": v for k, v in global_stats(stats, ranks).items()}
        out["actor/grad_norm"] = grad_norm
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        out["policy_ratio_hist"] = {"bin_edges": RATIO_BIN_EDGES, "counts": ratio_counts.tolist()}
        return out

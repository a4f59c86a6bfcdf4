"""The reference policy: the frozen starting policy that the KL penalty measures against."""

from __future__ import annotations

import torch

from rlhf import algos
from rlhf.batch import Batch
from rlhf.workers.common import response_logits


class ReferenceWorker:
    def __init__(self, model: torch.nn.Module, device: torch.device, temperature: float, micro_batch_size: int,
                 autocast_dtype=None):
        self.model = model.eval().requires_grad_(False)
        self.device = device
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.autocast_dtype = autocast_dtype

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        out = []
        for micro in batch.split(self.micro_batch_size):
            logits = response_logits(self.model, micro, self.device, self.temperature, self.autocast_dtype)
            out.append(algos.logprobs_from_logits(logits, micro["response_ids"].to(self.device)).cpu())
        return torch.cat(out)

"""How an update walks its rollout buffer: `ppo_epochs` x seeded shuffled mini-batches (one optimizer
step each) x micro-batches (one forward and backward each, gradients accumulated), with the loss
scale that makes the accumulated micro-batch losses the mini-batch's loss. The actor's and the
critic's `update` loop over `mini_batches` and compute their losses themselves.

With several ranks each takes its share of every mini-batch, and the loss scale is the global one
divided by the world size: FSDP averages the ranks' gradients, so the average of the shares is the
one-process gradient."""

from __future__ import annotations

import dataclasses
from typing import Iterator, List

import torch

from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.packing import micro_batches
from rlhf.roles.forward import on_device


@dataclasses.dataclass
class MiniBatch:
    """One optimizer step's share of the buffer on this rank."""

    micro_batches: List[Batch]
    """Its micro-batches, in row order (`ppo.micro_batch_size` rows, or packed to
    `ppo.max_tokens_per_micro_batch` tokens): one forward and backward each."""
    loss_normalizer: float
    """What each micro-batch's summed loss is divided by (`algos.aggregate`'s `normalizer`):
    the mini-batch's token or sequence count (`loss_normalizer`)."""


def mini_batches(batch: Batch, cfg: PPOConfig, shuffle_seed: int, device, ranks) -> Iterator[MiniBatch]:
    """The mini-batches of `ppo_epochs` passes over `batch`, each pass in the order of
    `minibatch_indices(len(batch), ppo.mini_batch_size, shuffle_seed + epoch)`, each on `device`."""
    # Every tensor of the buffer on the device once; the mini-batches are selected there by a
    # device index, so the update never waits for the GPU (the statistics stay on the device
    # until the caller reads them once, after its loop).
    resident = on_device(batch, device, cfg.max_tokens_per_micro_batch, keys=None)
    for epoch in range(cfg.ppo_epochs):
        indices = minibatch_indices(len(batch), cfg.mini_batch_size, shuffle_seed + epoch)
        placed = torch.cat(indices).to(resident.tensors["response_mask"].device).split([len(i) for i in indices])
        for mb_index, mb_placed in zip(indices, placed):
            mini = ranks.share(resident.select(mb_placed))
            # The normalizer from the host copy of the mask: a number the host needs now.
            host_mask = Batch({"response_mask": batch["response_mask"][mb_index]})
            normalizer = loss_normalizer(ranks.share(host_mask), cfg.loss_aggregation, ranks)
            yield MiniBatch(micro_batches(mini, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, ranks),
                            normalizer)


def loss_normalizer(mini: Batch, aggregation: str, ranks) -> float:
    """The mini-batch's token count (token_mean) or non-empty sequence count (seq_mean), summed
    over ranks and divided by the world size (FSDP averages the ranks' gradients), so that the
    micro-batch losses of all ranks add up to the one-process mini-batch loss."""
    mask = mini.tensors["response_mask"].float()
    count = mask.sum() if aggregation == "token_mean" else (mask.sum(-1) > 0).sum()
    return ranks.sum(count).clamp(min=1).item() / ranks.world_size


def minibatch_indices(n: int, mini_batch_size: int, seed: int) -> List[torch.Tensor]:
    """A seeded shuffle of range(n) cut into mini-batches."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    return [perm[i:i + mini_batch_size] for i in range(0, n, mini_batch_size)]

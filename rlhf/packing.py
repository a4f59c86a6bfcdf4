"""Micro-batches by count or by token budget, and packing a micro-batch into one row without
padding (`ppo.max_tokens_per_micro_batch`; verl's `use_dynamic_bsz` + `use_remove_padding`,
OpenRLHF's `--packing_samples`, TRL's `padding_free`).

Shapes: a micro-batch holds B sequences, prompts left-padded to width P and responses
right-padded to width R (`prompt_mask` / `response_mask` are 1 on real tokens). Its real tokens
are T = prompt_mask.sum() + response_mask.sum(), N = response_mask.sum() of them response tokens.

With a budget, a (mini-)batch's sequences, in their order, are cut into contiguous micro-batches
of at most `max_tokens` real tokens each, and each runs as one row: input_ids [1, T] holding every
sequence's real tokens one after the other, and position_ids [1, T] restarting at 0 for each
sequence. Each row also carries its sequences' lengths (`PackedRow.forward_kwargs`), with which the
engine's attention (rlhf/attention.py) runs every sequence causally over itself: torch's variable-length
flash kernel on a GPU, no [T, T] mask anywhere.
`PackedRow.index` [N] names the row positions whose outputs belong to response tokens (the token
before each, as in the padded forward) and `PackedRow.unpack` scatters [1, N] outputs back to
the padded [B, R] layout, zero where response_mask is 0, so the losses read the same shapes.

Everything here is pure tensor and index logic; the forwards that use it are in
rlhf/roles/forward.py (`response_logprobs`, `response_values`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import torch

from rlhf.attention import packed_kwargs, prepared_mask
from rlhf.batch import Batch, to_device


def real_lengths(batch: Batch) -> torch.Tensor:
    """Real (prompt + response) tokens of each sequence: [B] long."""
    return batch["prompt_mask"].long().sum(-1) + batch["response_mask"].long().sum(-1)


def budget_partition(lengths: Sequence[int], max_tokens: int) -> List[range]:
    """Contiguous ranges of sequence indices, in order, each holding at most `max_tokens` tokens
    (greedy: a range closes when the next sequence would not fit). A sequence longer than the
    budget gets a range of its own (the config refuses budgets that allow one)."""
    parts, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > max_tokens:
            parts.append(range(start, i))
            start, total = i, 0
        total += n
    if len(lengths):
        parts.append(range(start, len(lengths)))
    return parts


def balanced_partition(lengths: Sequence[int], parts: int) -> List[range]:
    """Exactly `parts` contiguous, non-empty ranges of sequence indices, in order, whose largest
    token count is as small as it can be (1 <= parts <= len(lengths)). When a budget's greedy
    partition needs at most `parts` ranges, every range here is within that budget."""
    n = len(lengths)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} sequences into {parts} non-empty micro-batches")

    def greedy_count(cap: int) -> int:
        return len(budget_partition(lengths, cap))

    lo, hi = max(lengths), sum(lengths)  # the smallest cap that `parts` ranges can meet is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy_count(mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    # Greedy under the cap, closing ranges early once every remaining sequence must open one.
    out, start, total = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and (total + length > lo or n - i == parts - len(out) - 1):
            out.append(range(start, i))
            start, total = i, 0
        total += length
    out.append(range(start, n))
    return out


def micro_batches(batch: Batch, size: int, max_tokens: int = 0, ranks=None) -> List[Batch]:
    """The micro-batches of `batch`, in row order: the one place that chooses how a role cuts
    its mini-batches (update) and its forward-only batches.

    max_tokens = 0: `size` sequences each (the last may be shorter), padded as they come.
    max_tokens > 0: contiguous runs of at most `max_tokens` real tokens (`budget_partition`),
    each a `PackedBatch` whose forward runs packed into one row. Sharded models need every rank
    to run the same number of forward passes, so with several `ranks` (each with as many rows,
    as shares and dispatch give them) all take the largest of their greedy counts and a rank
    with fewer cuts its rows into that many balanced runs (`balanced_partition`), each still
    within the budget."""
    if not max_tokens:
        return list(batch.split(size))
    lengths = real_lengths(batch).tolist()
    parts = budget_partition(lengths, max_tokens)
    if ranks is not None and ranks.world_size > 1:
        count = int(ranks.max(torch.tensor(len(parts), dtype=torch.long)))
        if count != len(parts):
            parts = balanced_partition(lengths, count)
    return [PackedBatch.of(batch.select(r)) for r in parts]


@dataclasses.dataclass
class PackedRow:
    """One micro-batch as a single row without padding.

    input_ids, position_ids: [1, T]; index: [N] row positions whose outputs belong to the
    response tokens (position of the token before each); tokens: [1, N] those response tokens;
    rows, cols: [N] where each goes in the padded [B, R] layout; lengths: each sequence's real
    tokens (host ints, summing to T); attention: what every attention layer reads
    (`rlhf.attention.packed_kwargs`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple
    lengths: tuple
    attention: dict

    def forward_kwargs(self, model: torch.nn.Module) -> dict:
        """The inputs of the row's forward through `model`: ids, positions, the sequences' spans and,
        where the model's attention reads no mask, a prepared one (`rlhf.attention.prepared_mask`)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, **self.attention,
                **prepared_mask(model, self.input_ids.device)}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-response-token outputs [1, N] (or [N]) to the padded [B, R], 0 where response_mask
        is 0; differentiable."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values.reshape(-1))


def pack(batch: Batch, device=None) -> PackedRow:
    """Packs a micro-batch's real tokens into one row, sequence after sequence (see the module
    docstring). Assumes the engine's layout, left-padded prompts and responses whose real tokens
    come first; then every output equals the padded forward's at the same token. Every sequence
    with response tokens needs at least one prompt token (the one that predicts its first)."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    keep = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1).bool()
    P = batch["prompt_ids"].shape[1]
    T = int(keep.sum())
    positions = keep.long().cumsum(-1) - 1  # [B, P + R]: each real token's position in its sequence
    slot = torch.full(ids.shape, -1, dtype=torch.long)
    slot[keep] = torch.arange(T)  # each real token's place in the row
    response = keep[:, P:]
    rows, cols = response.nonzero(as_tuple=True)
    if len(rows) and bool((positions[:, P:][response] == 0).any()):
        raise ValueError("a sequence to pack has response tokens but no prompt token")
    index = slot[:, P:][response] - 1
    lengths = tuple(n for n in keep.sum(-1).tolist() if n)
    to = (lambda t: to_device(t, device)) if device is not None else (lambda t: t)
    return PackedRow(input_ids=to(ids[keep][None]), position_ids=to(positions[keep][None]), index=to(index),
                     tokens=to(batch["response_ids"][rows, cols][None]), rows=to(rows), cols=to(cols),
                     shape=tuple(batch["response_ids"].shape), lengths=lengths,
                     attention=packed_kwargs(lengths, device if device is not None else "cpu"))


class PackedBatch(Batch):
    """A micro-batch that runs packed: its fields are the padded rows of any `Batch` (the losses
    read them as usual); `row(device)` is its packed forward input, built once per device."""

    _rows: Dict[str, PackedRow]

    @classmethod
    def of(cls, batch: Batch) -> "PackedBatch":
        out = cls(batch.tensors, batch.meta)
        out._rows = {}
        return out

    def row(self, device) -> PackedRow:
        key = str(device)
        if key not in self._rows:
            self._rows[key] = pack(self, device)
        return self._rows[key]


def packed_row(batch: Batch, device) -> PackedRow | None:
    """The packed row of a micro-batch that runs packed (from `micro_batches` with a budget), else None."""
    return batch.row(device) if isinstance(batch, PackedBatch) else None

"""The one batch type that crosses role boundaries: named tensors sharing a leading batch
dimension, plus per-sample Python values (prompts, answers, decoded responses).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence

import torch
import torch.nn.functional as F


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device` without making the host wait. A copy from pageable host memory to a GPU
    blocks the host until every kernel queued before it has run, so a micro-batch's inputs copied
    that way drain the device before each micro-batch and again before its loss; through pinned
    memory the copy is queued on the stream like a kernel (torch keeps the pinned block until the
    copy has run). Anywhere else (a CPU run, a tensor already there) it is `tensor.to(device)`."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class Batch:
    def __init__(self, tensors: Dict[str, torch.Tensor] | None = None, meta: Dict[str, list] | None = None):
        self.tensors: Dict[str, torch.Tensor] = dict(tensors or {})
        self.meta: Dict[str, list] = dict(meta or {})
        sizes = {v.shape[0] for v in self.tensors.values()} | {len(v) for v in self.meta.values()}
        if len(sizes) > 1:
            raise ValueError(f"batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> Any:
        """The tensor or the per-sample list named `key` (Any: the key, known only at run time, decides which)."""
        return self.tensors[key] if key in self.tensors else self.meta[key]

    def __setitem__(self, key: str, value) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.meta[key] = list(value)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def select(self, index: torch.Tensor | Sequence[int]) -> "Batch":
        """The rows `index`, in its order. An index tensor on the device the tensors live on
        selects there without a host synchronisation (when the batch holds no per-sample values,
        whose selection needs the rows on the host)."""
        idx = index if isinstance(index, torch.Tensor) else torch.as_tensor(index, dtype=torch.long)
        meta = {}
        if self.meta:
            rows = idx.tolist()
            meta = {k: [v[i] for i in rows] for k, v in self.meta.items()}
        return Batch({k: v[idx] for k, v in self.tensors.items()}, meta)

    def slice(self, start: int, stop: int) -> "Batch":
        """Rows start..stop-1 as views: no copy and, on a GPU, no host synchronisation."""
        return Batch({k: v[start:stop] for k, v in self.tensors.items()},
                     {k: v[start:stop] for k, v in self.meta.items()})

    def split(self, size: int) -> Iterator["Batch"]:
        for start in range(0, len(self), size):
            yield self.slice(start, min(start + size, len(self)))

    def to(self, device, keys: Sequence[str] | None = None) -> "Batch":
        """The batch with its tensors on `device`; with `keys`, only those tensors (and no
        per-sample values): what a role's phase reads, moved in one go rather than per micro-batch."""
        if keys is None:
            return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.meta)
        return Batch({k: self.tensors[k].to(device) for k in keys if k in self.tensors})

    @staticmethod
    def concat(parts: List["Batch"], pad_values: Dict[str, int] | None = None,
               left_pad: Sequence[str] = ()) -> "Batch":
        """Concatenates along the batch; 2-D tensors of different widths are padded (on the left
        for keys in `left_pad`, else on the right) with pad_values[key] (default 0)."""
        pad_values = pad_values or {}
        tensors = {}
        for key in parts[0].tensors:
            items = [p.tensors[key] for p in parts]
            if items[0].dim() == 2:
                width = max(t.shape[1] for t in items)
                value = pad_values.get(key, 0)
                side = (lambda n: (n, 0)) if key in left_pad else (lambda n: (0, n))
                items = [F.pad(t, side(width - t.shape[1]), value=value) if t.shape[1] < width else t
                         for t in items]
            tensors[key] = torch.cat(items, 0)
        meta = {k: [x for p in parts for x in p.meta[k]] for k in parts[0].meta}
        return Batch(tensors, meta)

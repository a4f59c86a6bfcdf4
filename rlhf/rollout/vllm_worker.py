"""The vLLM engine in its own process (`ppo.vllm_own_process`): what runs in vLLM's worker, and how the
trainer's weights reach it.

vLLM mixes `EngineWorker` into its worker class (`worker_extension_cls`); `VLLMRollout` calls the
methods by name through `LLM.collective_rpc`, whose arguments and results cross the process boundary
as msgpack (lists, strings, numbers, bytes: nothing that needs vLLM's pickle fallback).

Weights go through one staging buffer on the GPU, allocated by the worker and opened by the trainer
from its CUDA IPC handle: the trainer copies a bucket of tensors into it (device to device, each at a
256-byte aligned offset), then the worker loads the bucket's views into its model by their HF names
(`load_weights`, as the in-process engine does). The worker allocates the buffer in plain cudaMalloc
segments whatever the allocator's setting, because a CUDA IPC handle to memory of expandable segments
is opened with `pidfd_getfd`, which containers commonly forbid; the trainer only opens the handle, so
its own allocator may keep expandable segments. The buffer grows to the largest tensor sent (the
embedding) and stays allocated, outside vLLM's sleep-mode pool, for the run.

Seeds: the engine's samplers draw from its process's generators (the CUDA generator, and numpy's global
one for requests without a seed), so `rlhf_seed` seeds them there before each rollout, as the
in-process engine's are seeded in the trainer's process.
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from rlhf import allocator

ALIGN = 256
"""Each tensor starts at a multiple of this many bytes in the staging buffer (any dtype's alignment)."""
STAGING_BYTES = 512 * 2**20
"""The staging buffer's first size; it grows to the largest tensor sent."""

Entry = List  # [HF name, dtype name, shape, byte offset]: msgpack-friendly


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unpack(buffer: torch.Tensor, entries: Iterable[Entry]) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) views of a bucket in a uint8 `buffer`, as `send_weights` wrote them."""
    for name, dtype, shape, offset in entries:
        dt = getattr(torch, dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        yield name, buffer[offset:offset + nbytes].view(dt).view(tuple(shape))


def send_weights(pairs: Iterable[Tuple[str, torch.Tensor]], buffer: torch.Tensor, *,
                 grow: Callable[[int], torch.Tensor], load: Callable[[List[Entry]], None],
                 sync: Callable[[], None] = lambda: None) -> Tuple[torch.Tensor, int]:
    """Copies `pairs` into the uint8 `buffer` bucket by bucket, calling `load(entries)` whenever the next
    tensor would not fit and once at the end, after `sync()` (the copies must be done before the reader
    looks). A tensor larger than the buffer gets a new one from `grow(nbytes)`. Returns the buffer in use
    and the number of buckets sent."""
    entries: List[Entry] = []
    cursor, buckets = 0, 0

    def flush() -> None:
        nonlocal buckets
        if entries:
            sync()
            load(list(entries))
            entries.clear()
            buckets += 1

    for name, tensor in pairs:
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        offset = -(-cursor // ALIGN) * ALIGN
        if offset + nbytes > buffer.numel():
            flush()
            offset = 0
            if nbytes > buffer.numel():
                buffer = grow(nbytes)
        if nbytes:
            buffer[offset:offset + nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        entries.append([name, dtype_name(t.dtype), list(t.shape), offset])
        cursor = offset + nbytes
    flush()
    return buffer, buckets


@contextlib.contextmanager
def plain_segments():
    """Allocations in this block get cudaMalloc segments even where expandable segments are on (the
    setting vLLM's own sleep-mode pool switches the same way)."""
    expandable = allocator.expandable()
    if expandable:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if expandable:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def open_shared(blob: bytes, device: torch.device) -> torch.Tensor:
    """The trainer's view of the worker's staging buffer, from `EngineWorker.rlhf_staging`'s reply."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    args = list(pickle.loads(blob))
    args[6] = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    return rebuild_cuda_tensor(*args)


class EngineWorker:
    """Mixed into vLLM's worker (`worker_extension_cls`); `self.model_runner` is the worker's."""

    rlhf_buffer: Optional[torch.Tensor] = None

    def rlhf_seed(self, seed: int) -> None:
        """Seeds the generators the engine samples with, in its process."""
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)

    def rlhf_staging(self, nbytes: int) -> bytes:
        """Allocates the staging buffer (dropping the previous one) and returns its CUDA IPC handle:
        the arguments of torch's `rebuild_cuda_tensor`, pickled (read by `open_shared`)."""
        from torch.multiprocessing.reductions import reduce_tensor
        self.rlhf_buffer = None
        with plain_segments():
            self.rlhf_buffer = torch.empty(int(nbytes), dtype=torch.uint8, device=torch.cuda.current_device())
        _, args = reduce_tensor(self.rlhf_buffer)
        return pickle.dumps(args)

    def rlhf_load(self, entries: Sequence[Entry]) -> None:
        """Loads one bucket of the staging buffer into the model by HF names."""
        buffer = self.rlhf_buffer
        if buffer is None:
            raise RuntimeError("rlhf_load before rlhf_staging: the worker has no staging buffer")
        model = self.model_runner.model  # pyright: ignore[reportAttributeAccessIssue]  # vLLM's worker
        model.load_weights(unpack(buffer, entries))
        if buffer.is_cuda:  # the next bucket overwrites the buffer once this returns
            torch.cuda.synchronize(buffer.device)

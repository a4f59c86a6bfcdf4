"""The CUDA caching allocator the engine runs with, and what it reports when a phase runs out.

Expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`): torch maps physical pages
into one growing address range instead of cudaMalloc-ing fixed segments, so the memory one phase's
micro-batches free is reused by the next phase's micro-batches of other sizes. Without them a packed
update at 7B without gradient checkpointing stopped with 14.6 GiB reserved but unallocated beside 124.1
GiB allocated; with them the same run went to its end.

vLLM's sleep-mode memory pool cannot use expandable segments. vLLM 0.24 turns them off for its pool
while it allocates there and on again afterwards when this variable says they are on
(`vllm/device_allocator/cumem.py`), so the engine sets the variable, which its Ray ranks receive too
(rlhf/placement/cluster.py `FORWARDED_ENV`), before CUDA starts. A PYTORCH_CUDA_ALLOC_CONF the user set
is left as it is.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def configure(environ: MutableMapping[str, str] = os.environ) -> str:
    """Expandable segments for this process and the ranks it starts, unless the user's environment
    sets PYTORCH_CUDA_ALLOC_CONF; returns the setting in effect ('' when none). CUDA reads the
    variable when it starts; a process where it has started already gets the setting applied."""
    if environ.get(ALLOC_CONF) is None:
        environ[ALLOC_CONF] = EXPANDABLE
        torch = sys.modules.get("torch")
        if environ is os.environ and torch is not None and torch.cuda.is_initialized():
            torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    return environ.get(ALLOC_CONF, "")


def expandable(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether this process's allocator runs with expandable segments."""
    return "expandable_segments:true" in environ.get(ALLOC_CONF, "").replace(" ", "").lower()


class OutOfMemory(RuntimeError):
    """A phase ran out of GPU memory. Its message is the one line the engine prints, with
    EXIT_OUT_OF_MEMORY (rlhf/errors.py): `oom_line`."""


def oom_line(phase: str, allocated_gib: float, reserved_gib: float, total_gib: float,
             planned_gib: float | None, binding: str) -> str:
    """'out of GPU memory in update_critic: ...': the phase, what torch held at the failure (allocated
    and reserved, of the GPU's total), the memory plan's figure for the phase and the binding to change."""
    plan = (f"the memory plan predicted {planned_gib:.1f} GiB for this phase" if planned_gib is not None
            else "the memory plan had no figure for this phase")
    return (f"out of GPU memory in {phase}: torch held {allocated_gib:.1f} GiB allocated and {reserved_gib:.1f} GiB "
            f"reserved of {total_gib:.1f} GiB; {plan}; set {binding} (python -m rlhf.memory RECIPE -b ... shows "
            f"the new plan); the checkpoints in --out stay, --resume continues from the last")

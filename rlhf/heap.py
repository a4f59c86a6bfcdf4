"""The process's long-lived Python heap, taken out of the cyclic garbage collector's passes.

A training process holds a large heap that lives as long as it does: the models' modules and
parameters, the compiled layers' graphs and guards (built in the first iteration), the tokenizer,
the prompts and, in process, the vLLM engine. The collector's oldest generation walks all of it
at every full pass, a pause that grows with the heap and stops whatever runs (a rollout's decoding
steps, which vLLM drives from the host one by one, or an update's kernel launches), and finds
nothing to free there. After the first iteration `freeze` collects once and moves every surviving
object into the permanent generation (`gc.freeze`), which later passes skip; reference counting
still frees them. vLLM freezes its own start-up heap the same way (`vllm.utils.gc_utils`); a
trainer's heap grows long after that.
"""

from __future__ import annotations

import gc
from typing import Callable


def freeze() -> int:
    """Collects the garbage there is, then freezes every object left; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class FrozenAfterFirst:
    """A run's loop: `settle()` after each iteration freezes this process's heap (and through
    `others` that of every other process holding a role) the first time only; leaving the block
    unfreezes this process's, so that what the run built can be collected once it is dropped
    (a process that runs several trainers, such as a test session)."""

    def __init__(self, others: Callable[[], object] = lambda: None):
        self.others = others
        self.frozen = False

    def __enter__(self) -> "FrozenAfterFirst":
        return self

    def settle(self) -> None:
        if not self.frozen:
            freeze()
            self.others()
            self.frozen = True

    def __exit__(self, *exc) -> None:
        if self.frozen:
            gc.unfreeze()

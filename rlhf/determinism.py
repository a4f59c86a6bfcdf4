"""Determinism on a GPU: every engine process asks torch for its deterministic algorithms (warn
only: an op without one warns), and the updates' backward passes run them strictly where
`ppo.deterministic` says so, which alone makes flash attention's backward deterministic
(bench/results/determinism_h200.md). CPU runs are deterministic either way (rlhf/numerics.py pins
their kernels)."""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch

from rlhf.errors import ConfigError


def deterministic_algorithms(device_type: str) -> None:
    """Deterministic algorithms (warn only) for a process that computes on `device_type`, as every
    engine process asks (the trainer's, each Ray rank's). On a GPU without deterministic mode's NaN
    fill of every new tensor: the fill exposes reads of uninitialised memory, which no op of the
    engine or of vLLM makes, and vLLM allocates anew every decoding step, so there it is a memset
    per allocation for nothing. The CPU path keeps torch's default."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device_type == "cuda":
        torch.utils.deterministic.fill_uninitialized_memory = False  # pyright: ignore[reportAttributeAccessIssue]


NO_DETERMINISTIC_KERNEL = re.compile(r"^(.*?) does not have a deterministic implementation")
"""torch's error for an op without a deterministic kernel under strict deterministic algorithms."""


@contextlib.contextmanager
def deterministic_backward(enabled: bool) -> Iterator[None]:
    """Strict deterministic algorithms while the block runs (a backward pass), where `enabled`
    (`ppo.deterministic` on a GPU); the process's own setting (warn only) is restored after. Only
    strict mode makes flash attention's backward deterministic: warn-only mode warns and keeps its
    atomic adds. An op with no deterministic kernel raises torch's error; it becomes one line
    naming the op and the binding."""
    if not enabled:
        yield
        return
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    except RuntimeError as err:
        found = NO_DETERMINISTIC_KERNEL.search(str(err))
        if found is None:
            raise
        raise ConfigError(f"ppo.deterministic = True: {found.group(1)} has no deterministic kernel in torch "
                          f"{torch.__version__}; set ppo.deterministic = False to run it without") from None
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)

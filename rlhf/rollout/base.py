"""The rollout interface every backend implements, and what backends share.

`RolloutBackend.generate(prompts, sampling, seed)` returns a `Batch` with left-padded
`prompt_ids`/`prompt_mask` [B, P], right-padded `response_ids`/`response_mask` [B, R]
(R = max_new_tokens; the mask covers tokens up to and including EOS) and `finished` [B]
(False when the response hit R without EOS). `generate_calls(requests, sampling)` runs several
such calls, one `(prompts, seed)` each, and returns their batches: the HF backend in turn, vLLM as
one continuous batch (an iteration's prompts together). A backend may add `rollout_logprobs` [B, R] (its
sampling log-probs, 0 past the mask). `sync_weights(model)` loads the trainer's new weights (an
HF-named module or state dict); the HF backend shares the actor's module, so it has nothing to
copy. `release_memory()` lets a backend free what it holds between rollouts (vLLM: sleep mode).
Backends are registered by name in `rlhf/rollout/__init__.py` and built with `from_config`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import List, Mapping, Optional, Protocol, Sequence

import numpy as np
import torch

from rlhf.batch import Batch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one generation call samples: built from the run's `PPOConfig` by `from_ppo`, whose fields
    hold every default."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    max_prompt_length: int
    truncation: str
    """Which end of a prompt longer than max_prompt_length is cut: 'left' (its first tokens) or 'right'."""

    @classmethod
    def from_ppo(cls, ppo, temperature: Optional[float] = None) -> "SamplingParams":
        """The sampling of `ppo`'s rollouts, or at `temperature` (an evaluation's: 0 is greedy, which
        samples from no nucleus, so top_p is 1). A too-long prompt is cut on its right under
        ppo.prompt_truncation = 'right', else on its left (under 'error' no prompt is too long)."""
        temperature = ppo.temperature if temperature is None else temperature
        return cls(max_new_tokens=ppo.max_response_length, temperature=temperature,
                   top_p=ppo.top_p if temperature > 0 else 1.0, top_k=ppo.top_k,
                   max_prompt_length=ppo.max_prompt_length,
                   truncation="right" if ppo.prompt_truncation == "right" else "left")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def derive_seed(*parts: int) -> int:
    """A well-mixed 31-bit seed from integers (run seed, step, call index, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


class SeedStream(enum.IntEnum):
    """The named streams `derive_seed` mixes in beside the run seed, so no two uses of ppo.seed draw the
    same numbers. The training rollouts' stream names none: its parts are (seed, step, call index).
    The values are fixed: a run's samples, shuffles and so its metrics follow from them."""

    CRITIC_SHUFFLE = 2
    """The critic's mini-batch order of a step: (seed, step, CRITIC_SHUFFLE)."""
    ACTOR_SHUFFLE = 3
    """The actor's mini-batch order of a step: (seed, step, ACTOR_SHUFFLE)."""
    EVAL = 7_919
    """The evaluations' generations: (seed, EVAL, step, call index)."""
    TEST = 104_729
    """The held-out test split's generations (experiments/heldout.py): (seed, TEST, call index)."""


def encode_prompts(tokenizer, prompts: Sequence[str | Sequence[int]], max_prompt_length: int,
                   truncation: str = "left"):
    """Left-padded prompt ids and mask; prompts longer than the limit keep their last tokens
    (`truncation = 'left'`) or their first ('right'). A prompt is text (encoded with the
    tokenizer's special tokens) or token ids already rendered (rlhf/chat.py: the chat template's
    ids, as the trainer passes them)."""
    keep = slice(-max_prompt_length, None) if truncation == "left" else slice(0, max_prompt_length)
    ids = [(tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else list(p))[keep]
           for p in prompts]
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            out[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
    return out, mask


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int,
                           lengths: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Response ids [B, R] -> (mask [B, R] long, finished [B] bool). The mask covers the tokens up to
    and including the first EOS, and only the first `lengths[b]` positions of row b (the tokens the
    engine returned; by default all R, as HF generate pads rows after their EOS); `finished` says
    whether a row has an EOS there. A row without one was cut at the limit: all its tokens count."""
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    returned = positions[None] < (lengths[:, None] if lengths is not None else response_ids.shape[1])
    is_eos = (response_ids == eos_token_id) & returned
    finished = is_eos.any(-1)
    # Tokens after the first EOS: the count of EOS strictly before position t is > 0.
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    mask = ((eos_before == 0) & returned).long()
    return mask, finished


def response_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                   eos_token_id: int, pad_token_id: int, lengths: Optional[torch.Tensor] = None) -> Batch:
    """The rollout `Batch` every backend returns, from right-padded response ids [B, R]
    (`response_mask_from_ids`); the ids outside the mask become `pad_token_id`."""
    mask, finished = response_mask_from_ids(response_ids, eos_token_id, lengths)
    response = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, pad_token_id))
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                  "response_ids": response, "response_mask": mask, "finished": finished})


class RolloutBackend(Protocol):
    """What the actor role asks of its generation engine."""

    shares_module: bool
    """True when the backend generates with the trainer's own module (nothing to copy on sync)."""

    @classmethod
    def from_config(cls, ppo, *, model: Optional[torch.nn.Module], tokenizer, device: torch.device,
                    model_dir: str, log=print) -> "RolloutBackend": ...

    def generate(self, prompts: Sequence[str], sampling: SamplingParams, seed: int) -> Batch: ...

    def generate_calls(self, requests: Sequence[tuple], sampling: SamplingParams) -> List[Batch]: ...

    def sync_weights(self, model: torch.nn.Module | Mapping[str, torch.Tensor]) -> None: ...

    def release_memory(self) -> None: ...

    def set_sleep(self, enabled: bool) -> None:
        """Whether `release_memory` frees anything (a backend without a sleep mode ignores it)."""

    def asleep_bytes(self) -> int:
        """Bytes torch's memory statistics count for the backend that are not on the device while it
        sleeps (vLLM's sleep-mode pool: its blocks stay allocated to torch, their memory released)."""
        return 0


def decode_responses(tokenizer, batch: Batch) -> List[str]:
    """Response text without the EOS and padding."""
    out = []
    for ids, mask in zip(batch["response_ids"], batch["response_mask"]):
        toks = ids[mask.bool()].tolist()
        if toks and toks[-1] == tokenizer.eos_token_id:
            toks = toks[:-1]
        out.append(tokenizer.decode(toks, skip_special_tokens=True))
    return out


def rollout_logprob_gap(batch: Batch) -> float | None:
    """Mean |rollout log-prob - trainer old log-prob| over response tokens, or None when the
    backend returned no sampling log-probs (`ppo.rollout_logprobs`)."""
    if "rollout_logprobs" not in batch or "old_logprobs" not in batch:
        return None
    mask = batch["response_mask"].float()
    gap = (batch["rollout_logprobs"].float() - batch["old_logprobs"].float()).abs() * mask
    return float(gap.sum() / mask.sum().clamp(min=1))

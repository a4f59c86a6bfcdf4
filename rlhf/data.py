"""Prompt datasets: the embedded arithmetic task, or prompts from JSONL / parquet files.

A dataset is a list of `Example(prompt, answer)`. The train / held-out split is deterministic
(a hash of the prompt), so it never depends on the seed or on file order. `PromptSampler`
walks the train split in a seeded order per epoch; its position (epoch, index) is part of a
checkpoint, so a resumed run sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from rlhf.config import ConfigError, TaskConfig


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def _unit_hash(text: str) -> float:
    """A stable number in [0, 1) from a string (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_examples(examples: Sequence[Example], eval_fraction: float) -> Tuple[List[Example], List[Example]]:
    """Deterministic hash split; the held-out list is ordered by hash so 'the first N' is stable."""
    train, held = [], []
    for ex in examples:
        (held if _unit_hash(ex.prompt) < eval_fraction else train).append(ex)
    held.sort(key=lambda ex: _unit_hash("order:" + ex.prompt))
    return train, held


def arithmetic_examples(max_operand: int) -> List[Example]:
    """Every `a+b=` and `a-b=` with operands in [0, max_operand]; the answer is the integer."""
    out = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            out.append(Example(f"{a}+{b}=", str(a + b)))
            out.append(Example(f"{a}-{b}=", str(a - b)))
    return out


def read_records(path: str | Path) -> List[dict]:
    """Rows of a JSONL or parquet file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task data file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ConfigError(f"task data file {str(path)!r}: must end in .jsonl or .parquet")


def records_to_examples(records: Sequence[dict], prompt_key: str, answer_key: str, where: str) -> List[Example]:
    out = []
    for i, row in enumerate(records):
        if prompt_key not in row or answer_key not in row:
            raise ConfigError(f"{where} row {i} lacks task.prompt_key={prompt_key!r} or "
                              f"task.answer_key={answer_key!r}; it has keys {sorted(row)}")
        out.append(Example(str(row[prompt_key]), str(row[answer_key])))
    return out


def load_task(cfg: TaskConfig) -> Tuple[List[Example], List[Example]]:
    """Returns (train, held_out) examples for the task config."""
    if cfg.name == "arithmetic":
        return split_examples(arithmetic_examples(cfg.max_operand), cfg.eval_fraction)
    train = records_to_examples(read_records(cfg.train_path), cfg.prompt_key, cfg.answer_key, cfg.train_path)
    if cfg.eval_path:
        held = records_to_examples(read_records(cfg.eval_path), cfg.prompt_key, cfg.answer_key, cfg.eval_path)
        return train, held
    return split_examples(train, cfg.eval_fraction)


def dataset_hash(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(ex.prompt.encode() + b"\x00" + ex.answer.encode() + b"\x01")
    return h.hexdigest()


class PromptSampler:
    """Seeded, resumable walk over the train split: a fresh permutation per epoch."""

    def __init__(self, examples: Sequence[Example], seed: int):
        if not examples:
            raise ConfigError("the task's train split is empty")
        self.examples = list(examples)
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(len(self.examples))

    def next(self, n: int) -> List[Example]:
        out = []
        while len(out) < n:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            out.append(self.examples[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.index = state["index"]
        self._order = self._permutation(self.epoch)

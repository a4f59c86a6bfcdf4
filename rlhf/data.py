"""Prompt datasets: the embedded arithmetic task, or rows from JSONL / parquet files in the
formats users have (`task.format`, detected from the columns when 'auto'):

- 'plain': `{task.prompt_key: str or chat messages, task.answer_key: str}` rows;
- 'verl': verl's RL rows, `data_source`, `prompt` (chat messages), `reward_model.ground_truth`,
  `extra_info` (parquet or JSONL);
- 'preference': pairs for reward-model training, TRL / OpenRLHF shapes: `chosen` / `rejected`
  with an explicit `prompt` or an implicit one (the shared start), plain text or conversational;
  an optional `margin`.

A prompt is a string or a list of `{'role', 'content'}` messages (`rlhf/chat.py` renders it; a
content may be OpenAI-style text parts). A file that cannot be read, fits no format, or has a row
with an empty prompt, a null answer or a non-text content part is a ConfigError: one line naming
the file (and line or row) and what is accepted. Each Example keeps its row (`where`) and
`data_source`, which `task.reward_fn = 'auto'` routes by (`check_sources`).

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
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from rlhf.chat import Prompt, is_messages, normalize_messages, prompt_key
from rlhf.config import TaskConfig
from rlhf.errors import ConfigError
from rlhf.rewards import DATA_SOURCES, REWARD_FUNCTIONS, routes_by_source, scorer_for
from rlhf.validation import why_not_a_file

FORMATS = ("plain", "verl", "preference")


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: Prompt
    """A string, or a list of {'role', 'content'} chat messages."""
    answer: str
    """The ground truth the rule reward (and gold accuracy) compares against."""
    data_source: str = ""
    """The row's `data_source` (verl's column): with task.reward_fn = 'auto' it picks the scorer."""
    where: str = dataclasses.field(default="", compare=False)
    """The file and row it came from ('' for the embedded task), for messages."""


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One comparison for reward-model training. `prompt` is a string or messages (None when the
    file gives whole conversations: implicit prompt); `chosen` / `rejected` are the continuations
    (text, or the assistant's messages), or whole texts / conversations when the prompt is implicit."""
    prompt: Optional[Prompt]
    chosen: Union[str, List[dict]]
    rejected: Union[str, List[dict]]
    margin: float = 0.0


def _unit_hash(text: str) -> float:
    """A stable number in [0, 1) from a string (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_examples(examples: Sequence[Example], eval_fraction: float) -> Tuple[List[Example], List[Example]]:
    """Deterministic hash split; the held-out list is ordered by hash so 'the first N' is stable."""
    train, held = [], []
    for ex in examples:
        (held if _unit_hash(prompt_key(ex.prompt)) < eval_fraction else train).append(ex)
    held.sort(key=lambda ex: _unit_hash("order:" + prompt_key(ex.prompt)))
    return train, held


def arithmetic_examples(max_operand: int) -> List[Example]:
    """Every `a+b=` and `a-b=` with operands in [0, max_operand]; the answer is the integer."""
    out = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            out.append(Example(f"{a}+{b}=", str(a + b)))
            out.append(Example(f"{a}-{b}=", str(a - b)))
    return out


def _one_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _read_jsonl(path: Path) -> List[dict]:
    """JSON Lines (or, for a .json file, one JSON array of objects), decoded as UTF-8 line by line
    so a bad line is reported with its number."""
    raw = path.read_bytes()
    if path.suffix == ".json" and raw.lstrip()[:1] == b"[":
        try:
            rows = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); "
                              f"re-save it as UTF-8") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno})") from None
        where = [f"{path}: item {i}" for i in range(len(rows))]
    else:
        rows, where = [], []
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text (byte 0x{line[err.start]:02x} at column "
                                  f"{err.start + 1}); re-save the file as UTF-8") from None
            if lineno == 1:
                text = text.lstrip("\ufeff")  # a byte-order mark
            if not text.strip():
                continue
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({err.msg}, column {err.colno}); "
                                  f"each line of a JSONL file must be one JSON object") from None
            where.append(f"{path}:{lineno}")
    for row, at in zip(rows, where):
        if not isinstance(row, dict):
            raise ConfigError(f"{at}: a row must be a JSON object, got {type(row).__name__}")
    return rows


def read_records(path: str | Path) -> List[dict]:
    """Rows of a JSONL or parquet file as dicts. Raises ConfigError (one line naming the file, and
    the line for JSONL) for a missing, unreadable, malformed or empty file."""
    path = Path(path)
    problem = why_not_a_file(path)
    if problem:
        raise ConfigError(f"task data file {str(path)!r} {problem}; expected a .jsonl, .json or .parquet file")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise ConfigError(f"{path}: not a readable parquet file ({_one_line(err)})") from None
    elif path.suffix in (".jsonl", ".json"):
        rows = _read_jsonl(path)
    else:
        raise ConfigError(f"task data file {str(path)!r}: must end in .jsonl, .json or .parquet")
    if not rows:
        raise ConfigError(f"task data file {str(path)!r} is empty (no rows)")
    return rows


# ----------------------------------------------------------------------------- formats
def _columns(records: Sequence[dict]) -> List[str]:
    cols: dict = {}
    for row in records[:100]:
        cols.update(dict.fromkeys(row))
    return list(cols)


def _accepted(prompt_key_: str, answer_key: str) -> str:
    return (f"plain (columns task.prompt_key={prompt_key_!r} and task.answer_key={answer_key!r}), "
            f"verl ('data_source', 'prompt' as chat messages, 'reward_model' with 'ground_truth'), "
            f"preference ('chosen' and 'rejected', optional 'prompt')")


def detect_format(records: Sequence[dict], where: str, prompt_key_: str = "prompt",
                  answer_key: str = "answer") -> str:
    """'plain', 'verl' or 'preference' from the first row's columns; ConfigError (one line) otherwise."""
    row = records[0]
    if "chosen" in row and "rejected" in row:
        return "preference"
    if "reward_model" in row and "prompt" in row:
        return "verl"
    if prompt_key_ in row and answer_key in row:
        return "plain"
    raise ConfigError(f"{where} fits no dataset format: columns found {_columns(records)}; "
                      f"accepted: {_accepted(prompt_key_, answer_key)}")


def _prompt_value(value: Any, where: str) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: the prompt is empty; every row needs the text the policy continues")
        return value
    if is_messages(value):
        msgs = normalize_messages(value, where)
        if not any(m["content"].strip() for m in msgs):
            raise ConfigError(f"{where}: every message of the prompt is empty; every row needs the text the "
                              f"policy continues")
        return msgs
    raise ConfigError(f"{where}: the prompt must be a string or a list of {{'role', 'content'}} messages, "
                      f"got {type(value).__name__} {str(value)[:60]!r}")


def records_to_examples(records: Sequence[dict], prompt_key: str, answer_key: str, where: str) -> List[Example]:
    """'plain' rows: the prompt (a string or chat messages) and the answer under the given keys."""
    out = []
    for i, row in enumerate(records):
        if prompt_key not in row or answer_key not in row:
            raise ConfigError(f"{where} row {i} lacks task.prompt_key={prompt_key!r} or "
                              f"task.answer_key={answer_key!r}; it has keys {sorted(row)}")
        at = f"{where} row {i}"
        if row[answer_key] is None:
            raise ConfigError(f"{at}: task.answer_key={answer_key!r} is null; every row needs its ground truth "
                              f"(the rule reward and gold accuracy compare against it)")
        out.append(Example(_prompt_value(row[prompt_key], at), str(row[answer_key]),
                           _source(row.get("data_source")), where=at))
    return out


def _source(value: Any) -> str:
    return "" if value is None else str(value)


def verl_to_examples(records: Sequence[dict], where: str) -> List[Example]:
    """verl rows: `prompt` (messages), `reward_model.ground_truth`, `data_source`."""
    out = []
    for i, row in enumerate(records):
        at = f"{where} row {i}"
        rm = row.get("reward_model")
        if "prompt" not in row or not isinstance(rm, dict) or rm.get("ground_truth") is None:
            raise ConfigError(f"{at}: a verl row needs 'prompt' and 'reward_model' with 'ground_truth'; "
                              f"it has keys {sorted(row)}"
                              + (f" (reward_model has {sorted(rm)})" if isinstance(rm, dict) else ""))
        truth = rm["ground_truth"]
        if not isinstance(truth, str):
            truth = json.dumps(truth) if isinstance(truth, (list, dict)) else str(truth)
        out.append(Example(_prompt_value(row["prompt"], at), truth, _source(row.get("data_source")), where=at))
    return out


def _side(value: Any, where: str, name: str):
    if isinstance(value, str):
        return value
    if is_messages(value):
        return normalize_messages(value, f"{where} {name!r}")
    raise ConfigError(f"{where}: {name!r} must be a string or a list of chat messages, got "
                      f"{type(value).__name__}")


def records_to_pairs(records: Sequence[dict], where: str, prompt_key_: str = "prompt") -> List[PreferencePair]:
    """Preference rows in the TRL / OpenRLHF shapes (explicit or implicit prompt, text or messages)."""
    out = []
    for i, row in enumerate(records):
        at = f"{where} row {i}"
        if "chosen" not in row or "rejected" not in row:
            raise ConfigError(f"{at}: a preference row needs 'chosen' and 'rejected'; it has keys {sorted(row)}")
        prompt = row.get(prompt_key_)
        prompt = None if prompt in (None, "", []) else _prompt_value(prompt, at)
        chosen, rejected = _side(row["chosen"], at, "chosen"), _side(row["rejected"], at, "rejected")
        if isinstance(chosen, str) != isinstance(rejected, str):
            raise ConfigError(f"{at}: 'chosen' and 'rejected' must both be text or both be chat messages")
        margin = row.get("margin", 0.0)
        if not isinstance(margin, (int, float)) or isinstance(margin, bool):
            raise ConfigError(f"{at}: 'margin' must be a number, got {margin!r}")
        out.append(PreferencePair(prompt, chosen, rejected, float(margin)))
    return out


def load_pairs(path: str | Path, fmt: str = "auto", prompt_key_: str = "prompt") -> List[PreferencePair]:
    """Preference pairs from a JSONL / parquet file (reward-model training)."""
    records = read_records(path)
    found = detect_format(records, str(path), prompt_key_) if fmt == "auto" else fmt
    if found != "preference":
        raise ConfigError(f"{path} holds {found!r} rows, not preference pairs: reward-model training needs "
                          f"'chosen' and 'rejected' columns (columns found {_columns(records)})")
    return records_to_pairs(records, str(path), prompt_key_)


def check_sources(reward_fn, examples: Sequence, where: str) -> None:
    """Every row of a file has a scorer under `task.reward_fn`: a ConfigError (one line naming the
    source, the row and what is known) for the first that has none. Rows need no data_source when
    task.reward_fn names one reward."""
    if not routes_by_source(reward_fn):
        return
    known = (f"the mapping's sources {', '.join(map(repr, sorted(reward_fn)))}" if isinstance(reward_fn, dict) else
             f"the registered names {', '.join(map(repr, sorted(REWARD_FUNCTIONS)))} and verl's "
             + ", ".join(f"{s!r} ({n})" for s, n in sorted(DATA_SOURCES.items())))
    for i, ex in enumerate(examples):
        if scorer_for(reward_fn, ex.data_source) is None:
            at = ex.where or f"{where} row {i}"
            what = (f"data_source {ex.data_source!r} has no scorer" if ex.data_source else
                    "the row has no data_source to pick its scorer")
            raise ConfigError(f"{at}: {what} under task.reward_fn = {reward_fn!r} (it knows {known}); map the "
                              f"source with task.reward_fn = {{'{ex.data_source or 'SOURCE'}': NAME}}, or name one "
                              f"reward for every row (task.reward_fn = 'gsm8k', ...)")


def examples_from_file(path: str | Path, cfg: TaskConfig) -> List[Example]:
    """A PPO task's examples from one file, in the format task.format names (or detects)."""
    records = read_records(path)
    fmt = cfg.format if cfg.format != "auto" else detect_format(records, str(path), cfg.prompt_key, cfg.answer_key)
    if fmt == "preference":
        raise ConfigError(f"{path} holds preference pairs ('chosen'/'rejected'): they train a reward model "
                          f"(python -m rlhf.reward_model); a PPO task needs plain or verl rows with ground truth")
    if fmt == "verl":
        examples = verl_to_examples(records, str(path))
    else:
        examples = records_to_examples(records, cfg.prompt_key, cfg.answer_key, str(path))
    check_sources(cfg.reward_fn, examples, str(path))
    return examples


def load_task(cfg: TaskConfig) -> Tuple[List[Example], List[Example]]:
    """Returns (train, held_out) examples for the task config."""
    if cfg.name == "arithmetic":
        examples = arithmetic_examples(cfg.max_operand)
        check_sources(cfg.reward_fn, examples, "the embedded arithmetic task")
        return split_examples(examples, cfg.eval_fraction)
    train = examples_from_file(cfg.train_path, cfg)
    if cfg.eval_path:
        return train, examples_from_file(cfg.eval_path, cfg)
    return split_examples(train, cfg.eval_fraction)


def check_prompt_lengths(splits: Dict[str, Tuple[Sequence[Example], Sequence[int]]], max_length: int,
                         truncation: str, log=print) -> Dict[str, float]:
    """Prompt lengths (in tokens, per split name) against ppo.max_prompt_length, before any compute.
    Under ppo.prompt_truncation = 'error' a prompt that does not fit is a ConfigError naming the
    longest one's row and the bindings to change, and {} is returned; under 'left' / 'right' each
    split's fraction of prompts that will be cut is returned (and logged in one line when any is)."""
    rows = [(n, ex) for examples, lengths in splits.values() for ex, n in zip(examples, lengths)]
    if not rows:
        return {}
    longest, ex = max(rows, key=lambda r: r[0])
    over = {name: sum(n > max_length for n in lengths) for name, (_, lengths) in splits.items()}
    total, cut = len(rows), sum(over.values())
    where = ex.where or f"the prompt {prompt_key(ex.prompt)[:60]!r}"
    if truncation == "error":
        if cut:
            raise ConfigError(f"the longest prompt ({where}) is {longest} tokens, over ppo.max_prompt_length = "
                              f"{max_length} ({cut} of {total} prompts are longer); raise ppo.max_prompt_length to "
                              f"at least {longest}, or set ppo.prompt_truncation = 'left' (or 'right') to cut them")
        return {}
    if cut:
        end = "first" if truncation == "left" else "last"
        log(f"ppo.prompt_truncation = {truncation!r}: {cut} of {total} prompts ("
            + ", ".join(f"{over[name]} {name}" for name in splits)
            + f") are longer than ppo.max_prompt_length = {max_length} and lose their {end} tokens "
              f"(the longest: {longest} tokens, {where})")
    return {name: over[name] / len(lengths) if len(lengths) else 0.0 for name, (_, lengths) in splits.items()}


def dataset_hash(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(prompt_key(ex.prompt).encode() + b"\x00" + ex.answer.encode() + b"\x01")
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

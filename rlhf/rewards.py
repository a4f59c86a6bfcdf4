"""Rule rewards, by name.

A reward function scores one decoded response against its reference answer:
`fn(response: str, answer: str, finished: bool, **task_params) -> RewardResult`.
`finished` is False when generation hit max_response_length without EOS. Registered names are
what `task.reward_fn` accepts; `task.reward_fn = 'auto'` (or a mapping {data_source: name}) picks
each row's scorer by its `data_source`, as verl does (`DATA_SOURCES` names verl's sources).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, List, Optional, cast

REWARD_FUNCTIONS: Dict[str, Callable[..., "RewardResult"]] = {}

DATA_SOURCES = {"openai/gsm8k": "gsm8k"}
"""verl's `data_source` names (its `default_compute_score`) of the scorers registered here; a
registered name used as a data_source picks itself."""


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    correct: bool
    well_formed: bool


def register(name: str):
    def wrap(fn):
        REWARD_FUNCTIONS[name] = fn
        return fn
    return wrap


_INT = re.compile(r"^-?\d+$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _normalize_number(text: str) -> str:
    text = text.replace(",", "").strip()
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value == int(value) else str(value)


def _score(correct: bool, well_formed: bool, finished: bool, format_reward: float,
           missing_eos_penalty: float) -> RewardResult:
    reward = (1.0 if correct else 0.0) + (format_reward if well_formed else 0.0)
    if not finished:
        reward -= missing_eos_penalty
    return RewardResult(reward=reward, correct=correct, well_formed=well_formed)


@register("arithmetic")
def arithmetic_reward(response: str, answer: str, finished: bool, format_reward: float = 0.1,
                      missing_eos_penalty: float = 0.5) -> RewardResult:
    """Exact integer answer. Well formed: the response is one integer and ended with EOS."""
    text = response.strip()
    well_formed = finished and bool(_INT.match(text))
    correct = well_formed and int(text) == int(answer)
    return _score(correct, well_formed, finished, format_reward, missing_eos_penalty)


def extract_gsm8k_answer(text: str) -> str | None:
    """GSM8K convention: the answer follows '####'; otherwise the last number in the text."""
    if "####" in text:
        tail = text.split("####")[-1]
        m = _NUMBER.search(tail)
        return _normalize_number(m.group(0)) if m else None
    numbers = _NUMBER.findall(text)
    return _normalize_number(numbers[-1]) if numbers else None


@register("gsm8k")
def gsm8k_reward(response: str, answer: str, finished: bool, format_reward: float = 0.1,
                 missing_eos_penalty: float = 0.5) -> RewardResult:
    """Exact match of the extracted final number; well formed when a '####' answer is present."""
    predicted = extract_gsm8k_answer(response)
    reference = extract_gsm8k_answer(answer) or _normalize_number(answer)
    well_formed = finished and "####" in response and predicted is not None
    correct = predicted is not None and predicted == reference
    return _score(correct, well_formed, finished, format_reward, missing_eos_penalty)


@register("exact_match")
def exact_match_reward(response: str, answer: str, finished: bool, format_reward: float = 0.1,
                       missing_eos_penalty: float = 0.5) -> RewardResult:
    """Whitespace-stripped exact match."""
    correct = response.strip() == answer.strip()
    well_formed = finished and bool(response.strip())
    return _score(correct, well_formed, finished, format_reward, missing_eos_penalty)


# ----------------------------------------------------------------------------- reward kinds
class RunningMeanStd:
    """Running mean and variance over every score seen (Chan et al.'s parallel update); its state
    goes into checkpoints so a resumed run normalises as an uninterrupted one."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values) -> None:
        import torch
        x = torch.as_tensor(values, dtype=torch.float64)
        n = int(x.numel())
        if n == 0:
            return
        mean, m2 = float(x.mean()), float(((x - x.mean()) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta ** 2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count > 1 else 1.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def scorer_for(reward_fn, data_source: str) -> Optional[str]:
    """The registered reward name that scores a row of `data_source` under `task.reward_fn`
    (a name, 'auto' or a mapping), or None when there is none."""
    if isinstance(reward_fn, dict):
        return reward_fn.get(data_source)
    if reward_fn == "auto":
        return data_source if data_source in REWARD_FUNCTIONS else DATA_SOURCES.get(data_source)
    return reward_fn


def routes_by_source(reward_fn) -> bool:
    """True when `task.reward_fn` picks the scorer per row by its data_source."""
    return isinstance(reward_fn, dict) or reward_fn == "auto"


def rule_results(reward_fn, responses, answers, finished, data_sources: Optional[List[str]] = None, **params):
    """Each response's RewardResult under `task.reward_fn`: one named reward for every row, or each
    row's by its data source ('auto' or a mapping, which need `data_sources`)."""
    if routes_by_source(reward_fn):
        if data_sources is None:
            raise ValueError(f"task.reward_fn = {reward_fn!r} picks scorers by data_source; the batch has none")
        # rlhf/data.py refuses, before the run, every row whose data_source has no scorer
        names = [cast(str, scorer_for(reward_fn, s)) for s in data_sources]
    else:
        names = [reward_fn] * len(responses)
    return [REWARD_FUNCTIONS[n](r, a, bool(f), **params)
            for n, r, a, f in zip(names, responses, answers, list(finished))]


class RewardCombiner:
    """What the policy trains on, from the rule's results and the reward model's raw scores:

    - 'rule': the rule reward (its format bonus and missing-EOS penalty included), as always;
    - 'model': the model score, normalised ('none' | 'batch' | 'running') and clipped;
    - 'combined': rule_weight x (rule reward without the penalty) + model_weight x the model term;
    then the missing-EOS penalty on top for 'model' and 'combined'."""

    def __init__(self, task, reward):
        self.task, self.cfg = task, reward
        self.running = RunningMeanStd()

    def model_term(self, raw, update: bool):
        import torch
        x = raw.float()
        if self.cfg.normalize == "batch":
            x = (x - x.mean()) / (x.std(unbiased=False) + 1e-6) if x.numel() > 1 else x - x.mean()
        elif self.cfg.normalize == "running":
            if update:
                self.running.update(x)
            x = (x - self.running.mean) / (self.running.std + 1e-6)
        if self.cfg.clip:
            x = x.clamp(-self.cfg.clip, self.cfg.clip)
        return x.to(torch.float32)

    def combine(self, responses, answers, finished, rm_scores=None, update: bool = True,
                data_sources: Optional[List[str]] = None) -> dict:
        import torch
        t = self.task
        finished = torch.as_tensor(finished, dtype=torch.bool)
        results = rule_results(t.reward_fn, responses, answers, finished.tolist(), data_sources,
                               format_reward=t.format_reward, missing_eos_penalty=t.missing_eos_penalty)
        out = {"correct": torch.tensor([r.correct for r in results], dtype=torch.bool),
               "well_formed": torch.tensor([r.well_formed for r in results], dtype=torch.bool)}
        rule = torch.tensor([r.reward for r in results], dtype=torch.float32)
        if self.cfg.kind == "rule":
            out["scores"] = rule
            return out
        if rm_scores is None:
            raise ValueError(f"reward.kind = {self.cfg.kind!r} needs the reward model's scores (rm_scores)")
        penalty = (~finished).float() * t.missing_eos_penalty
        model = self.model_term(rm_scores, update)
        if self.cfg.kind == "model":
            scores = model
        else:
            scores = self.cfg.rule_weight * (rule + penalty) + self.cfg.model_weight * model
        out["scores"] = scores - penalty
        out["rm_scores"] = rm_scores.float()
        return out

    def state_dict(self) -> dict:
        return {"running": self.running.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "running" in state:
            self.running.load_state_dict(state["running"])


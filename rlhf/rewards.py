"""Rule rewards, by name.

A reward function scores one decoded response against its reference answer:
`fn(response: str, answer: str, finished: bool, **task_params) -> RewardResult`.
`finished` is False when generation hit max_response_length without EOS. Registered names are
what `task.reward_fn` accepts.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict

REWARD_FUNCTIONS: Dict[str, Callable[..., "RewardResult"]] = {}


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

"""Reward-model scoring math, as plain functions (no placement): load a checkpoint, encode
conversations with the reward model's own tokenizer and template, score at the last non-pad token.

A reward model is any local `AutoModelForSequenceClassification` checkpoint with one output
(`num_labels = 1`). Sequences are packed with left padding, with explicit position ids, and the
classifier is made to pool at the last position (`reads_last_position`), which is every
sequence's last real token, whatever the pad id (often the EOS id) and whatever padding the
caller's batch had. The forward is an ordinary `model(input_ids=...)` call, so it works on a
model sharded with FSDP2 too. The score of a sequence does not depend on its batch or micro-batch beyond float rounding.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import List, Optional, Sequence, cast

import torch
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from rlhf.chat import Prompt, PromptRenderer
from rlhf.errors import ConfigError


def check_reward_checkpoint(path: str | Path, binding: str = "reward.model_path") -> dict:
    """Reads config.json and checks it is a one-output sequence classifier, before any weights load."""
    from rlhf.models import config_architectures, config_num_labels, read_model_config
    path = Path(path)
    config = read_model_config(path, binding, "give an AutoModelForSequenceClassification checkpoint with "
                                              "num_labels = 1")
    archs = config_architectures(config)
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"{binding} = {str(path)!r} is invalid: a {', '.join(archs)} checkpoint is not a sequence "
                          f"classifier; a reward model is an AutoModelForSequenceClassification with num_labels = 1")
    labels = config_num_labels(config)
    if labels != 1:
        raise ConfigError(f"{binding} = {str(path)!r} is invalid: the model has num_labels = {labels}; a reward model "
                          f"has one output (num_labels = 1)")
    return config


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32, binding: str = "reward.model_path"):
    """The checkpoint as an eval-mode AutoModelForSequenceClassification (safetensors, local files only)."""
    check_reward_checkpoint(path, binding)
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{binding} = {str(path)!r}: cannot load it as AutoModelForSequenceClassification "
                          f"({first})") from None
    if model.config.num_labels != 1:
        raise ConfigError(f"{binding} = {str(path)!r} is invalid: num_labels = {model.config.num_labels}, must be 1")
    model.eval()
    return model


def load_reward_tokenizer(path: str | Path, binding: str = "reward.tokenizer_path"):
    """`binding`: the one that named `path` (SCOPE.tokenizer_path, or the model's binding when the
    tokenizer is the model's own); a directory without a tokenizer names SCOPE.tokenizer_path to set."""
    from rlhf.models import read_tokenizer
    tok = read_tokenizer(path, binding, fix=f"{binding.split('.')[0]}.tokenizer_path")
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ConfigError(f"{binding} = {str(path)!r}: the tokenizer has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    return tok


PROBE_FILE = "tokenizer_probe.json"
"""Written beside a trained reward model: a probe text and the ids its training tokenizer gave."""
PROBE_TEXT = "Q: What is 12 + 30?\n\nA:  42.\tDone, 'ok' (x_1 = -3.5e2) {a: [b]} # end"


def write_tokenizer_probe(tokenizer, directory: str | Path) -> None:
    """Records how the tokenizer a reward model was trained with encodes `PROBE_TEXT` (spaces,
    newlines, digits, punctuation), so that whoever scores with it can check their tokenizer agrees."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    (Path(directory) / PROBE_FILE).write_text(json.dumps({"text": PROBE_TEXT, "input_ids": ids}) + "\n")


def check_tokenizer_probe(tokenizer, model_dir: str | Path, binding: str) -> None:
    """The tokenizer about to score (named by `binding`) encodes the reward model's probe text into
    the ids its training tokenizer gave; otherwise one ConfigError saying where they part."""
    try:
        probe = json.loads((Path(model_dir) / PROBE_FILE).read_text())
    except (OSError, ValueError):
        return  # a reward model from elsewhere: nothing recorded to check against
    got = tokenizer(probe["text"], add_special_tokens=False)["input_ids"]
    if got != probe["input_ids"]:
        at = next((i for i, (a, b) in enumerate(zip(got, probe["input_ids"])) if a != b),
                  min(len(got), len(probe["input_ids"])))
        raise ConfigError(
            f"{binding}: this tokenizer ({type(tokenizer).__name__}) encodes text differently from the one the reward "
            f"model {str(model_dir)!r} was trained with (its {PROBE_FILE}: {len(probe['input_ids'])} ids, here "
            f"{len(got)}, first difference at id {at}); set reward.tokenizer_path to the tokenizer it was trained with")


def ensure_pad_id(model, tokenizer) -> None:
    """The classifier refuses batches without a pad id in its config; which id it is does not matter
    here (sequences are left-padded and the last position is read)."""
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text_config, "pad_token_id", None) is None:
        text_config.pad_token_id = tokenizer.pad_token_id
        model.config.pad_token_id = tokenizer.pad_token_id


# ----------------------------------------------------------------------------- encoding
def encode_conversation(renderer: PromptRenderer, prompt: Optional[Prompt], response, finished: bool = True,
                        eos_token_id: Optional[int] = None) -> List[int]:
    """Token ids of (prompt, response) as the reward model reads them: the one encoding, used by
    reward-model training (`rlhf/reward_model/bradley_terry.py`) and PPO scoring (`RewardModelScorer`) alike.

    With a chat template: the whole conversation through `apply_chat_template` (the response as
    the assistant's turn, closed by the template whether or not it finished: the missing-EOS
    penalty is the reward's; `response` may also be a list of messages). Without one: the prompt's
    raw encoding, the response's tokens, and EOS when the response finished, the same ids a policy
    with this tokenizer generated. `prompt=None` means `response` is the whole text/conversation."""
    tok = renderer.tokenizer
    eos = tok.eos_token_id if eos_token_id is None else eos_token_id
    if isinstance(response, list):  # chat messages: the assistant turn(s), or the whole conversation
        convo = (renderer.messages(prompt) if prompt is not None else []) + list(response)
        if renderer.uses_template:
            return list(tok.apply_chat_template(convo, chat_template=renderer.template, tokenize=True,
                                                add_generation_prompt=False, return_dict=False))
        prompt_part = renderer.messages(prompt) if prompt is not None else convo[:-1]
        prefix = renderer.ids(prompt_part) if prompt_part else []
        return prefix + list(tok(convo[-1]["content"], add_special_tokens=False)["input_ids"]) + \
            ([eos] if finished and eos is not None else [])
    if renderer.uses_template and prompt is not None:
        return renderer.full_ids(prompt, response)
    prefix = renderer.ids(prompt) if prompt is not None else list(tok("", add_special_tokens=True)["input_ids"])
    return prefix + list(tok(response, add_special_tokens=False)["input_ids"]) + \
        ([eos] if finished and eos is not None else [])


def policy_responses(policy_tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> List[str]:
    """Each rollout response as the reward model reads it: the policy's tokens decoded with their
    special tokens and without clean-up, the closing EOS dropped (`encode_conversation` adds the
    end: EOS without a template, the assistant turn's closing tokens with one). A tokenizer that
    reads its own text back (the embedded character tokenizer) thus re-encodes the very ids the
    policy generated."""
    out = []
    for ids, mask in zip(response_ids, response_mask):
        toks = ids[mask.bool()].tolist()
        if toks and toks[-1] == policy_tokenizer.eos_token_id:
            toks = toks[:-1]
        out.append(policy_tokenizer.decode(toks, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return out


def pack_left(seqs: Sequence[Sequence[int]], pad_id: int, max_length: int = 0):
    """Left-padded ids, mask and position ids; sequences longer than max_length keep their end."""
    if max_length:
        seqs = [list(s)[-max_length:] for s in seqs]
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@contextlib.contextmanager
def reads_last_position(model):
    """While active, the classifier pools at the last position of every row: its pad id is set to
    one that never occurs (-1), so "the rightmost non-pad token" is the last position, which for
    left-packed rows is the last real token, even when the real pad id is the EOS id that ends a
    response. The saved config keeps its own pad id."""
    configs = {id(c): c for c in (model.config, model.config.get_text_config()
                                 if hasattr(model.config, "get_text_config") else model.config)}.values()
    saved = [(c, c.pad_token_id) for c in configs]
    for c, _ in saved:
        c.pad_token_id = -1
    try:
        yield model
    finally:
        for c, pad in saved:
            c.pad_token_id = pad


def last_token_scores(model, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[B] float32 scores of left-packed sequences at their last (real) token; differentiable."""
    with reads_last_position(model):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    return out.logits[:, 0].float()


@torch.no_grad()
def score_sequences(model, seqs: Sequence[Sequence[int]], pad_id: int, micro_batch_size: int,
                    device: torch.device | str = "cpu", autocast_dtype: Optional[torch.dtype] = None,
                    max_length: int = 0) -> torch.Tensor:
    """Scores [B] (float32, CPU) of token sequences, `micro_batch_size` sequences per forward."""
    device = torch.device(device)
    scores = []
    for start in range(0, len(seqs), micro_batch_size):
        ids, mask, pos = pack_left(seqs[start:start + micro_batch_size], pad_id, max_length)
        with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            s = last_token_scores(model, ids.to(device), mask.to(device), pos.to(device))
        scores.append(s.cpu())
    return torch.cat(scores) if scores else torch.zeros(0)


class RewardModelScorer:
    """A reward model with its own tokenizer and template, scoring rollout batches.

    `score_batch(batch)` reads `prompts` (strings or messages, whole: a prompt the rollout cut
    under ppo.prompt_truncation is scored whole, as verl's reward model reads the raw prompt),
    `response_ids` / `response_mask` (decoded with the policy's tokenizer, `policy_responses`) and
    `finished`, and encodes each conversation with `encode_conversation`, exactly as reward-model
    training encodes a pair, whether or not the reward model shares the policy's tokenizer."""

    def __init__(self, model_path: str, tokenizer_path: str = "", chat_template: str = "auto", *,
                 policy_tokenizer=None, system_prompt: str = "", instruction_suffix: str = "",
                 micro_batch_size: int = 32, device: torch.device | str = "cpu", max_length: int = 0, place=None,
                 log=print):
        """`policy_tokenizer` decodes the rollout's response ids (needed by `score_batch`);
        `place(model) -> model` puts the model on its device (a placement context's `place`, which
        may shard it with FSDP2; default `model.to(device)`); `log=None` logs nothing."""
        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = load_reward_tokenizer(tokenizer_path or model_path,
                                               "reward.tokenizer_path" if tokenizer_path else "reward.model_path")
        self.renderer = PromptRenderer(self.tokenizer, chat_template, system_prompt, instruction_suffix,
                                       binding="reward.chat_template")
        model = load_reward_model(model_path, dtype)
        ensure_pad_id(model, self.tokenizer)
        self.model = (place(model) if place is not None else model.to(self.device)).eval().requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.policy_tokenizer = policy_tokenizer
        self.description = (f"reward model {model_path}: {self.renderer.describe()}; each conversation is encoded "
                            f"as in reward-model training")
        if log is not None:
            log(self.description)

    def sequences(self, batch) -> List[List[int]]:
        """The token ids the reward model scores, one list per row."""
        if self.policy_tokenizer is None:
            raise ValueError("RewardModelScorer needs policy_tokenizer to decode the rollout's responses")
        responses = policy_responses(self.policy_tokenizer, batch["response_ids"], batch["response_mask"])
        return [encode_conversation(self.renderer, p, r, bool(f))
                for p, r, f in zip(batch["prompts"], responses, batch["finished"].tolist())]

    def score_batch(self, batch) -> torch.Tensor:
        pad_id = cast(int, self.tokenizer.pad_token_id)  # load_reward_tokenizer sets one
        return score_sequences(self.model, self.sequences(batch), pad_id, self.micro_batch_size,
                               self.device, max_length=self.max_length)

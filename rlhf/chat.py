"""Chat prompts: how a task row's prompt (a string or a list of chat messages) becomes the text
and token ids the policy sees, and how a (prompt, response) pair becomes a conversation that a
reward model scores.

`task.chat_template` chooses the template:
- 'auto': the tokenizer's own chat template with the generation prompt when it has one, else
  the raw text (the choice is logged once);
- 'none': the raw text (a string prompt as it is; messages joined by newlines);
- a path to a Jinja template file, used in place of the tokenizer's.
`task.system_prompt` (prepended as a system message unless the conversation has one) and
`task.instruction_suffix` (appended to the last user message, e.g. verl's GSM8K "Let's think
step by step and output the final answer after \"####\".") apply in every mode.

Templates are rendered by transformers' `tokenizer.apply_chat_template`; rollout, evaluation
and the reward model all go through `PromptRenderer`, so they see the same conversation.
`check_rows` renders every row once at start, so a row a template rejects (or, in raw-text mode,
a role other than system / user / assistant) is one line naming it, before any compute.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from rlhf.errors import ConfigError

Message = Dict[str, str]
Prompt = Union[str, List[Message]]

_PROBE = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "1+1="}]
RAW_ROLES = ("system", "user", "assistant")
"""The roles a raw-text prompt (no chat template) may hold: it shows only the contents."""


def is_messages(value: Any) -> bool:
    """True for a non-empty list of {'role': str, 'content': str} dicts."""
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI-style content parts whose text parts are
    joined by newlines (as vLLM joins them); any other part is refused, the policy reads text only."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and content and all(isinstance(p, dict) for p in content):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ConfigError(f"{where}: content part {j} is of type {part.get('type')!r}; only text parts "
                                  f"({{'type': 'text', 'text': ...}}) are accepted (the policy reads text)")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ConfigError(f"{where}: 'content' must be a string or a list of text parts "
                      f"({{'type': 'text', 'text': ...}}), got {type(content).__name__} {str(content)[:60]!r}")


def normalize_messages(value: Sequence[dict], where: str) -> List[Message]:
    """Messages as plain {'role', 'content'} string dicts (parquet structs carry extra None fields;
    content parts become their joined text)."""
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m.get("content") is None:
            raise ConfigError(f"{where}: message {i} must be a dict with string 'role' and 'content', got {m!r:.80}")
        out.append({"role": m["role"], "content": _content_text(m["content"], f"{where}: message {i}")})
    return out


def prompt_key(prompt: Prompt) -> str:
    """A stable string for a prompt (the prompt itself for strings), for hashing and splits."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(list(prompt), ensure_ascii=False, sort_keys=True)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _render_check(tokenizer, template: str, where: str) -> None:
    try:
        text = tokenizer.apply_chat_template(_PROBE, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as err:  # jinja2 TemplateError, TypeError from a bad filter, ...
        raise ConfigError(f"{where}: the chat template does not render ({type(err).__name__}: "
                          f"{_first_line(err)})") from None
    if not isinstance(text, str) or "1+1=" not in text:
        raise ConfigError(f"{where}: the chat template renders no message content "
                          f"(got {str(text)[:60]!r}); it must output each message's content")


def resolve_template(tokenizer, chat_template: str, binding: str = "task.chat_template") -> Optional[str]:
    """The Jinja template text to use, or None for raw text. Raises ConfigError (one line) for a
    missing or non-rendering template file."""
    if chat_template == "none":
        return None
    if chat_template == "auto":
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):  # several named templates: transformers uses 'default'
            own = own.get("default")
        return own or None
    path = Path(chat_template)
    if not path.is_file():
        raise ConfigError(f"{binding} = {chat_template!r} is invalid: no such template file "
                          f"(use 'auto', 'none' or the path of a Jinja chat template)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{binding} = {chat_template!r} is invalid: the template file is not UTF-8 text") from None
    _render_check(tokenizer, text, f"{binding} = {chat_template!r}")
    return text


class PromptRenderer:
    """Turns task prompts into the policy's text / token ids, and (prompt, response) into a
    conversation. One instance per tokenizer; `describe` says which template is in use."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str = "",
                 instruction_suffix: str = "", binding: str = "task.chat_template"):
        self.tokenizer = tokenizer
        self.mode = chat_template
        self.system_prompt = system_prompt
        self.instruction_suffix = instruction_suffix
        self.template = resolve_template(tokenizer, chat_template, binding)
        if self.template is not None and chat_template == "auto":
            _render_check(tokenizer, self.template, f"{binding} = 'auto' (the tokenizer's own template)")

    @classmethod
    def from_task(cls, tokenizer, task) -> "PromptRenderer":
        return cls(tokenizer, task.chat_template, task.system_prompt, task.instruction_suffix)

    @property
    def uses_template(self) -> bool:
        return self.template is not None

    def describe(self) -> str:
        if self.template is None:
            why = "task.chat_template = 'none'" if self.mode == "none" else "the tokenizer has no chat template"
            return f"prompts are raw text ({why})"
        source = "the tokenizer's own" if self.mode == "auto" else repr(self.mode)
        return f"prompts use {source} chat template with the generation prompt"

    # ------------------------------------------------------------------ conversations
    def messages(self, prompt: Prompt) -> List[Message]:
        """The conversation for a prompt: system prompt and instruction suffix applied."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else copy.deepcopy(list(prompt))
        if self.instruction_suffix:
            for m in reversed(msgs):
                if m["role"] == "user":
                    m["content"] = m["content"] + self.instruction_suffix
                    break
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def conversation(self, prompt: Prompt, response: str) -> List[Message]:
        """The prompt's conversation followed by the response as the assistant's turn."""
        return self.messages(prompt) + [{"role": "assistant", "content": response}]

    # ------------------------------------------------------------------ policy side
    def _raw_text(self, msgs: List[Message]) -> str:
        for i, m in enumerate(msgs):
            if m["role"] not in RAW_ROLES:
                raise ConfigError(f"message {i} has role {m['role']!r}, which raw-text prompts ({self.describe()}) "
                                  f"cannot show: they join the contents, so only the roles "
                                  f"{', '.join(map(repr, RAW_ROLES))} are accepted; rename it or set a chat "
                                  f"template (task.chat_template)")
        return "\n".join(m["content"] for m in msgs)

    def text(self, prompt: Prompt) -> str:
        """The prompt text the policy continues."""
        if self.template is None:
            if isinstance(prompt, str) and not self.system_prompt:  # today's raw prompt, unchanged
                return prompt + self.instruction_suffix
            return self._raw_text(self.messages(prompt))
        return self.tokenizer.apply_chat_template(self.messages(prompt), chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=True)

    def ids(self, prompt: Prompt) -> List[int]:
        """The prompt's token ids: `apply_chat_template(..., add_generation_prompt=True)` with a
        template, else the tokenizer's encoding of the raw text (with its special tokens)."""
        if self.template is None:
            return list(self.tokenizer(self.text(prompt), add_special_tokens=True)["input_ids"])
        out = self.tokenizer.apply_chat_template(self.messages(prompt), chat_template=self.template,
                                                 tokenize=True, add_generation_prompt=True, return_dict=False)
        return list(out)

    # ------------------------------------------------------------------ scorer side
    def full_text(self, prompt: Prompt, response: str) -> str:
        """The whole conversation (prompt and response) as this tokenizer's text, for a reward model."""
        if self.template is None:
            return self.text(prompt) + response
        return self.tokenizer.apply_chat_template(self.conversation(prompt, response), chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=False)

    def full_ids(self, prompt: Prompt, response: str) -> List[int]:
        """Token ids of `full_text` (with a template the text carries its own special tokens)."""
        if self.template is None:
            return list(self.tokenizer(self.full_text(prompt, response), add_special_tokens=True)["input_ids"])
        out = self.tokenizer.apply_chat_template(self.conversation(prompt, response), chat_template=self.template,
                                                 tokenize=True, add_generation_prompt=False, return_dict=False)
        return list(out)


def check_rows(examples: Sequence, encode: Callable[[Prompt], List[int]], binding: str) -> List[int]:
    """Encodes every example's prompt once, before any compute (`encode`: the policy's
    `PromptRenderer.ids`, or a reward model's encoding of the conversation), and returns the
    lengths in tokens. A row its chat template (or the raw-text mode) rejects is a ConfigError
    naming the row (`example.where`) and the template's own message."""
    lengths = []
    for i, ex in enumerate(examples):
        at = getattr(ex, "where", "") or f"prompt {i} ({prompt_key(ex.prompt)[:60]!r})"
        try:
            lengths.append(len(encode(ex.prompt)))
        except ConfigError as err:
            raise ConfigError(f"{at}: {err}") from None
        except Exception as err:  # jinja2's TemplateError (a template's raise_exception), TypeError, ...
            raise ConfigError(f"{at}: the chat template ({binding}) rejects this row ({type(err).__name__}: "
                              f"{_first_line(err)})") from None
    return lengths


def render_prompt(tokenizer, prompt: Prompt, cfg) -> str:
    """The text the policy continues for `prompt` under a TaskConfig's chat settings."""
    return PromptRenderer.from_task(tokenizer, cfg).text(prompt)


def encode_prompt(tokenizer, prompt: Prompt, cfg) -> List[int]:
    """The token ids the policy continues for `prompt` under a TaskConfig's chat settings."""
    return PromptRenderer.from_task(tokenizer, cfg).ids(prompt)

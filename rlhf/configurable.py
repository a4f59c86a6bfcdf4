"""Gin at the edge: the one module that registers the engine's config dataclasses with gin.

`resolve(recipe, bindings)` parses a recipe plus `-b` bindings and returns a validated
`RunConfig` and gin's operative config text. Every failure becomes a `ConfigError` whose
message is one line naming the binding and what is allowed.
"""

from __future__ import annotations

import difflib
import io
import logging
import os
import re
import tokenize
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import gin

from rlhf.config import ModelConfig, PPOConfig, RewardConfig, RunConfig, SFTConfig, TaskConfig, TinyModelConfig
from rlhf.errors import ConfigError
from rlhf.validation import why_not_a_file

SCOPES = {
    "ppo": PPOConfig,
    "model": ModelConfig,
    "task": TaskConfig,
    "sft": SFTConfig,
    "tiny_model": TinyModelConfig,
    "reward": RewardConfig,
}

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _register() -> None:
    for name, cls in SCOPES.items():
        try:
            gin.external_configurable(cls, name)
        except ValueError:  # already registered in this process
            pass


_register()


class _QuietIncludeProbe(logging.Filter):
    """gin probes an include as a Python package path before its search paths and logs an error
    when that probe misses; the include then resolves normally, so the message is only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Path not found")


logging.getLogger().addFilter(_QuietIncludeProbe())


def _guard_package_probe() -> None:
    """gin's package-path probe crashes (TypeError) when the include's first folder is also a
    namespace package on sys.path, e.g. a `models/` data folder in the working directory; a
    crash there must mean 'not found here', so the search paths get their turn."""
    from gin import config as gin_config

    for i, (reader, exists) in enumerate(gin_config._FILE_READERS):
        if getattr(exists, "_guarded", False) or exists is os.path.isfile:
            continue

        def safe(path, _exists=exists):
            try:
                return _exists(path)
            except (TypeError, AttributeError):
                return False

        safe._guarded = True
        gin_config._FILE_READERS[i] = (reader, safe)


_guard_package_probe()


OTHER_SCOPES: dict = {}
"""Scopes another CLI registers with gin (the reward model's `rm`): named in messages like SCOPES,
not built by `build`."""


def register_scope(name: str, cls) -> None:
    """Registers `cls` with gin as `name` for a CLI of its own (`python -m rlhf.reward_model`)."""
    OTHER_SCOPES[name] = cls
    try:
        gin.external_configurable(cls, name)
    except ValueError:  # already registered in this process
        pass


def _scope_class(scope: str) -> type[Any] | None:
    return SCOPES.get(scope) or OTHER_SCOPES.get(scope)


def _known_params(scope: str) -> list[str]:
    import dataclasses
    cls = _scope_class(scope)
    assert cls is not None, f"{scope} is not a known scope"  # callers ask only of known scopes
    return [f.name for f in dataclasses.fields(cls)]


def _close_param(param: str, known: Sequence[str]) -> str | None:
    """The known parameter `param` most likely means: a close spelling, else the one it abbreviates
    (its initials, 'lr' for learning_rate), else the one that contains it."""
    close = difflib.get_close_matches(param, known, n=1)
    if close:
        return close[0]
    for name in known:
        if "".join(part[0] for part in name.split("_") if part) == param.lower():
            return name
    inside = [name for name in known if len(param) >= 3 and param.lower() in name]
    return inside[0] if len(inside) == 1 else None


def _explain_gin_error(err: Exception, where: str | None = None) -> str:
    """Turns gin's multi-line errors into one line that says what is allowed; `where` (' (FILE:LINE)')
    when the caller knows it, else read from gin's message."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    m = re.search(r"In call to configurable 'macro' \(.*\) in scope '([^']+)'", text)
    if m and first.startswith("macro() missing"):  # gin calls an undefined macro with no value
        return _undefined_macro(m.group(1))
    if where is None:
        where = ""
        m = re.search(r"In (?:file \"?([^\"\n]+)\"?, line (\d+)|bindings string line (\d+))", text)
        if m:
            where = f" ({m.group(1)}:{m.group(2)})" if m.group(1) else " (-b binding)"
    m = re.match(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", first)
    if m:
        scope, param = m.groups()
        known = _known_params(scope) if _scope_class(scope) is not None else []
        close = _close_param(param, known)
        hint = f"; did you mean {scope}.{close}?" if close else ""
        return f"{scope}.{param} is not a known binding{where}{hint} Allowed: {scope}.{{{', '.join(known)}}}"
    m = re.match(r"No configurable matching '([\w.]+)'", first)
    if m:
        close = difflib.get_close_matches(m.group(1), list(SCOPES), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return (f"'{m.group(1)}' is not a known configurable{where}{hint} "
                f"Allowed scopes: {', '.join(SCOPES)}")
    if isinstance(err, SyntaxError):
        line = getattr(getattr(err, "args", [None, None])[1] if len(err.args) > 1 else None,
                       "line_content", "") or ""
        m = re.match(r"\s*(\w+)\.(\w+)\s*=\s*(.*?)\s*$", line)
        if m and first.startswith("malformed node or string"):  # a bare word where a value goes
            scope, param, value = m.groups()
            return f"{scope}.{param} = {value} is invalid{where}: not a value; {_expected(scope, param, value)}"
        msg = str(err.args[0]).splitlines()[0] if err.args else first
        what = f" {line.strip()!r}" if line.strip() else ""
        return f"cannot parse binding{what}{where}: {msg} (a binding reads scope.name = value)"
    return f"{first}{where}"


_TYPE_WORDS = {"float": "a number", "int": "an integer", "bool": "True or False", "str": "a quoted string"}


def _expected(scope: str, param: str, value: str) -> str:
    """'expected a number, e.g. ppo.kl_coef = 0.05', from the dataclass field of `scope.param`."""
    import dataclasses
    cls = _scope_class(scope)
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
    field = fields.get(param)
    if field is None:
        return "a value is a number, True/False, a quoted string, a list or a dict"
    kind = str(field.type)
    example = f", e.g. {scope}.{param} = {field.default!r}" if field.default is not dataclasses.MISSING else ""
    return f"expected {_TYPE_WORDS.get(kind, kind)}{example}"


def _unclosed(text: str) -> tuple[int, str] | None:
    """(line, what is wrong) for the first bracket or quote of gin text that does not close, or a
    closing bracket that closes nothing; None when they balance. gin tokenizes as Python does, and
    Python's tokenizer only says that the text ended inside a bracket, not where it opened."""
    opened: list[int] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                opened.append(tok.start[0])
            elif tok.type == tokenize.OP and tok.string in ")]}":
                if not opened:
                    return tok.start[0], f"{tok.string!r} closes no bracket"
                opened.pop()
            elif tok.type == tokenize.ERRORTOKEN and tok.string in ("'", '"'):
                return tok.start[0], "a bracket or quote is not closed"
    except tokenize.TokenError as err:
        line = opened[0] if opened and "string" not in str(err.args[0]) else err.args[1][0]
        return line, "a bracket or quote is not closed"
    return None


def _explain_parse_error(err: Exception, text: str, where: str) -> str:
    """One line for a parse error of `text`: a file (`where` is its path: the line is named) or a
    -b binding (`where` = '-b binding')."""
    in_file = where != "-b binding"
    unclosed = _unclosed(text)
    if unclosed is not None:
        line, what = unclosed
        lines = text.splitlines()
        content = lines[line - 1].strip() if in_file and 0 < line <= len(lines) else text.strip()
        return f"cannot parse {f'{where}:{line}' if in_file else where}: {content[:200]!r}: {what}"
    location = err.args[1] if isinstance(err, SyntaxError) and len(err.args) > 1 else None
    line = getattr(location, "line_num", None)
    return _explain_gin_error(err, f" ({where}:{line})" if in_file and line else f" ({where})")


def statements(text: str, where: str) -> list:
    """gin's statements of `text`, the contents of recipe file `where` or a -b binding (`where` =
    '-b binding'); configurables need not be registered. A syntax error is a ConfigError naming
    `where` and, for a file, the line: for a bracket or quote that does not close, the line it
    opens on."""
    from gin import config as gin_config
    from gin import config_parser
    try:
        return list(config_parser.ConfigParser(text, gin_config.ParserDelegate(skip_unknown=True)))
    except (tokenize.TokenError, SyntaxError, ValueError, TypeError, KeyError) as err:
        raise ConfigError(_explain_parse_error(err, text, where)) from None


def _search_paths(recipe: str | os.PathLike | None) -> list[str]:
    paths = []
    if recipe:
        paths.append(str(Path(recipe).resolve().parent))
    paths += [str(Path.cwd()), str(RECIPES_DIR), str(RECIPES_DIR.parent)]
    return paths


def find_recipe(name: str | os.PathLike, relative_to: str | os.PathLike | None = None) -> Path | None:
    """Where gin finds recipe `name` (given on the command line, or included by `relative_to`):
    as given from the working directory, then next to `relative_to`, the working directory,
    recipes/ and the repository root. None when it is nowhere. The one lookup of recipes: the
    engine's includes and a study's `baseline_recipe` use it."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path if path.is_file() else None
    for base in ("", *_search_paths(relative_to)):
        candidate = Path(base) / path if base else path
        if candidate.is_file():
            return candidate.resolve()
    return None


def iter_statements(recipe: str | os.PathLike):
    """(file, statement) for every statement of `recipe` and its includes, in gin's order (an
    include's statements where it is included). Includes resolve like gin's (`find_recipe`
    relative to the top recipe); one that is missing is left to gin to report. Raises ConfigError
    naming the file and line of a syntax error (`statements`), and naming the chain when includes
    form a cycle (gin would recurse until Python's limit)."""
    from gin import config_parser

    top = Path(recipe).resolve()

    def walk(path: Path, chain: tuple):
        if path in chain:
            names = " -> ".join(p.name for p in (*chain[chain.index(path):], path))
            raise ConfigError(f"include cycle: {names} ({path}); a recipe may not include itself, "
                              f"directly or through another recipe")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"cannot read recipe {path} ({getattr(err, 'strerror', None) or err})") from None
        for statement in statements(text, str(path)):
            if isinstance(statement, config_parser.IncludeStatement):
                found = find_recipe(statement.filename, top)
                if found is not None:
                    yield from walk(found, (*chain, path))
            else:
                yield path, statement

    yield from walk(top, ())


_parsed: tuple = (None, ())
"""The recipe and bindings `parse` last parsed, to say where an error of gin's later calls lies."""


def parse(recipe: str | os.PathLike | None, bindings: Iterable[str] = ()) -> None:
    """Clears gin and parses `recipe` then `bindings` (later wins). Raises ConfigError."""
    global _parsed
    gin.clear_config()
    for p in _search_paths(recipe):
        gin.add_config_file_search_path(p)
    problem = why_not_a_file(recipe) if recipe is not None else None
    if problem:
        raise ConfigError(f"recipe {str(recipe)!r} {problem}; expected a gin recipe file (e.g. recipes/tiny.gin)")
    bindings = list(bindings)
    _parsed = (recipe, tuple(bindings))
    if recipe is not None:
        for _ in iter_statements(recipe):  # syntax errors and include cycles: one line naming the file
            pass
    try:
        gin.parse_config_files_and_bindings([str(recipe)] if recipe else [], bindings,
                                            finalize_config=False)
    except (ValueError, SyntaxError, IOError, KeyError, TypeError) as err:
        raise ConfigError(_explain_gin_error(err)) from None
    except tokenize.TokenError as err:  # an unclosed bracket or string in a -b binding
        for binding in bindings:
            statements(binding, "-b binding")
        raise ConfigError(f"cannot parse the recipe or its bindings: {err.args[0]}") from None


def _macro_uses(value, name: str) -> bool:
    """True when a parsed gin value refers to macro `name` (`%name`), at any depth."""
    if isinstance(value, dict):
        return any(_macro_uses(k, name) or _macro_uses(v, name) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return any(_macro_uses(v, name) for v in value)
    return getattr(value, "scoped_selector", None) == f"{name}/gin.macro"


def _undefined_macro(name: str) -> str:
    """'macro %NAME is not defined (FILE:LINE: ...)': the last statement of the recipe, its
    includes or the bindings `parse` last read that uses it (the one gin calls)."""
    recipe, bindings = _parsed
    used = [(f"{path}:{s.location.line_num}", s) for path, s in (iter_statements(recipe) if recipe else ())]
    used += [("-b binding", s) for b in bindings for s in statements(b, "-b binding")]
    uses = [f" ({where}: {s.location.line_content.strip()!r})" for where, s in used
            if _macro_uses(getattr(s, "value", None), name)]
    return (f"macro %{name} is not defined{uses[-1] if uses else ''}; define it in the recipe "
            f"({name} = VALUE) or with -b '{name} = VALUE'")


def _required_unset() -> list[str]:
    """Bindings a recipe leaves as `%gin.REQUIRED` (it cannot run without them) and nothing set."""
    import dataclasses
    unset = []
    for scope, cls in SCOPES.items():
        for f in dataclasses.fields(cls):
            try:
                value = gin.query_parameter(f"{scope}.{f.name}")
            except ValueError:  # not bound: the dataclass default applies
                continue
            if repr(value) == "%gin.REQUIRED":  # gin's reference to its REQUIRED constant
                unset.append(f"{scope}.{f.name}")
    return unset


def build() -> RunConfig:
    """Calls every configurable with the parsed bindings; validation runs here."""
    unset = _required_unset()
    if unset:
        raise ConfigError(f"{', '.join(unset)} {'is' if len(unset) == 1 else 'are'} required: the recipe leaves "
                          f"{'it' if len(unset) == 1 else 'them'} %gin.REQUIRED; set "
                          f"{'it' if len(unset) == 1 else 'each'} with -b (e.g. -b \"{unset[0]} = ...\")")
    try:
        parts = {name: gin.get_configurable(name)() for name in SCOPES}
    except ConfigError as err:  # gin appends "In call to configurable ..." lines: keep the first
        raise ConfigError(str(err).strip().splitlines()[0]) from None
    except (TypeError, ValueError) as err:
        raise ConfigError(_explain_gin_error(err)) from None
    return RunConfig(**parts)


def resolve(recipe: str | os.PathLike | None, bindings: Sequence[str] = ()) -> tuple[RunConfig, str]:
    """Returns the validated RunConfig and gin's operative config text for `recipe` + `bindings`."""
    parse(recipe, bindings)
    cfg = build()
    return cfg, gin.operative_config_str()


def flat_dict(cfg: RunConfig) -> dict:
    """`{'ppo.kl_coef': 0.05, ...}`: the operative config as flat binding names."""
    out = {}
    for scope, values in cfg.to_dict().items():
        for k, v in values.items():
            out[f"{scope}.{k}"] = v
    return out


def nested_dict(flat: Mapping[str, object]) -> dict:
    """`{'ppo.kl_coef': 0.1}` -> `{'ppo': {'kl_coef': 0.1}}`: flat binding names as one level per dot
    (a params file, W&B's config, whose panels address `ppo.kl_coef` only in a nested config)."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out

"""Per-round overrides kept in a YAML file (`--overrides FILE:KEY`, e.g. params.yaml:round1, which
`dvc exp run -S '++round1.ppo.kl_coef=0.1'` writes): read as -b bindings, and checked against each
study before anything runs. One line naming FILE:KEY for anything the file holds that a binding
cannot say (a key twice, one binding in two forms with two values, a value that is no mapping)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Mapping, Sequence, Tuple

import yaml

from experiments.errors import StudyError
from experiments.study import STUDY_PARAMETERS, engine_binding, load_study
from rlhf.errors import ConfigError
from rlhf.validation import why_not_a_file

OVERRIDE_FIXED = ("study.name", "study.resume_from")
"""Study bindings an overrides file may not change: they wire a round to its results and the one it resumes."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (YAML forbids it; PyYAML
    keeps the last one without a word, so an override would be lost silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_overrides(spec: str) -> Tuple[str, ...]:
    """`FILE:KEY` (e.g. 'params.yaml:round1'): the bindings under KEY of the YAML file FILE, written
    as `{scope: {parameter: value}}` (DVC's `dvc exp run -S '++round1.ppo.kl_coef=0.1'` writes them
    so; a dotted 'scope.parameter: value' also works), as '-b' lines in the file's order. A scope is
    an engine scope or `study` (but not study.name or study.resume_from); KEY may hold nothing
    (`round1: {}`). Raises StudyError naming FILE:KEY."""


    path, sep, key = spec.rpartition(":")
    if not sep or not path or not key:
        raise StudyError(f"--overrides {spec!r} is invalid: expected FILE:KEY, e.g. params.yaml:round1")
    problem = why_not_a_file(Path(path))
    if problem:
        raise StudyError(f"--overrides {spec}: {path!r} {problem}; expected a YAML file of per-round overrides")
    try:
        data = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)
    except (OSError, yaml.YAMLError) as err:
        raise StudyError(f"--overrides {spec}: {path} is not readable YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, Mapping) or key not in data:
        keys = ", ".join(map(str, data)) if isinstance(data, Mapping) else "none"
        raise StudyError(f"--overrides {spec}: {path} has no key {key!r} (its keys: {keys or 'none'})")
    held = {} if data[key] is None else data[key]  # `round1:` alone holds none; `[]` or `0` is no mapping
    shape = "a mapping {scope: {parameter: value}}, e.g. {ppo: {kl_coef: 0.1}} ({} for none)"
    if not isinstance(held, Mapping):
        raise StudyError(f"--overrides {spec} = {held!r} is invalid: must be {shape}")
    flat = {}
    for scope, params in held.items():
        if isinstance(scope, str) and "." in scope:
            pairs = [(scope, params)]
        elif isinstance(params, Mapping):
            pairs = [(f"{scope}.{param}", value) for param, value in params.items()]
        else:
            raise StudyError(f"--overrides {spec}: {scope!r} = {params!r} is invalid: must be {shape}")
        for name, value in pairs:  # 'ppo.kl_coef: 0.1' beside 'ppo: {kl_coef: 0.2}': which one was meant?
            if name in flat and flat[name] != value:
                raise StudyError(f"--overrides {spec}: {name} is given twice, as {flat[name]!r} and {value!r} (its "
                                 f"dotted and nested forms); keep one")
            flat[name] = value
    bindings = []
    for name, value in flat.items():
        line = f"{name} = {value!r}"
        if name in OVERRIDE_FIXED:
            raise StudyError(f"--overrides {spec}: {name} may not be overridden (it wires the round to its results "
                             f"and to the round it resumes); edit the study recipe{still_there(spec)}")
        if name.startswith("study."):
            param = name.split(".", 1)[1]
            if param not in STUDY_PARAMETERS:
                close = difflib.get_close_matches(param, STUDY_PARAMETERS, n=1)
                hint = f" (did you mean study.{close[0]}?)" if close else ""
                raise StudyError(f"--overrides {spec}: {name} is not a study binding{hint}{still_there(spec)}")
        else:
            try:
                engine_binding(line, f"--overrides {spec}")
            except StudyError as err:
                raise StudyError(f"{err}{still_there(spec)}") from None
        bindings.append(line)
    return tuple(bindings)


def still_there(spec: str) -> str:
    """What a refused override's line adds: `dvc exp run -S` wrote the value into the file before the
    stage ran, and it stays there (every later `dvc repro` stops on it) until it is removed."""
    file = spec.rpartition(":")[0] or spec
    return (f"; the refused value is still in {file} (a `dvc exp run -S` writes it there before the stage runs): "
            f"remove it, or `git checkout -- {file}`, before the next `dvc repro`")


def check_overrides(path: str | Path, overrides: Sequence[str], spec: str) -> None:
    """Loads the study with `overrides` and resolves its baseline and variants, as planning will: an
    unknown parameter, an invalid value, or a value that makes a variant the baseline (the variant's
    own change) fails here, in one line naming `spec` (the overrides file and key), before anything
    runs. A problem the study has without the overrides is left to the usual checks."""
    from rlhf.configurable import flat_dict, resolve

    try:
        overridden = load_study(path, overrides)
        if any(not line.startswith("study.") for line in overrides):
            recipe, base = overridden.baseline_recipe, overridden.baseline_bindings
            flat = flat_dict(resolve(recipe, base)[0])
            for variant in overridden.variants:
                if flat_dict(resolve(recipe, [*base, *variant.bindings])[0]) == flat:
                    raise StudyError(f"it makes study.variants[{variant.name!r}] ({'; '.join(variant.bindings)}) the "
                                     f"baseline, so the variant would change nothing; override another parameter")
    except (ConfigError, StudyError) as err:
        try:
            plain = load_study(path)
            resolve(plain.baseline_recipe, plain.baseline_bindings)
        except (ConfigError, StudyError):
            return
        raise StudyError(f"--overrides {spec}: {str(err).replace(' (-b binding)', '')}{still_there(spec)}") from None

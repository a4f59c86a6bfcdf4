"""A study: one tuning round, declared in gin under the name `study`.

A study is a baseline (an engine recipe plus bindings), named variants that each change one
binding (a deliberately coupled multi-binding change must be listed in `study.coupled`), the
same seeds for every variant, a decision metric with its direction, guardrails, an optional
previous round to resume from, and the resources each run needs.

Study files bind only `study.*`; the engine's own bindings live in `study.baseline_bindings`,
so the recipe the engine runs stays an ordinary engine recipe. Everything is validated here,
before any planning or compute, with errors that name the binding and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import gin

from rlhf.configurable import RECIPES_DIR

from experiments.adaptive import AdaptiveSeeds, parse_adaptive_seeds


class StudyError(ValueError):
    """A study declaration is invalid; the message names the binding and what is allowed."""


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=+-]*$")
BINDING_RE = re.compile(r"^\s*([A-Za-z_][\w]*)\.([A-Za-z_]\w*)\s*=\s*(.+?)\s*$", re.S)
ENGINE_SCOPES = ("ppo", "model", "task", "sft", "tiny_model")
MANAGED_BINDINGS = ("ppo.seed", "ppo.init_from", "ppo.torch_threads")
"""Set by the manager per run; a study may not bind them (seeds come from `study.seeds`)."""
METRIC_SOURCES = ("final", "final_window")
DIRECTIONS = ("higher", "lower")
BASELINE = "baseline"


@dataclasses.dataclass(frozen=True)
class Guardrail:
    """`metric` (read from summary.json's final_window) must stay within [min, max]."""

    metric: str
    min: float | None = None
    max: float | None = None

    def violated_by(self, value: float | None) -> bool:
        if value is None or value != value:  # missing or NaN counts as a violation
            return True
        return (self.min is not None and value < self.min) or (self.max is not None and value > self.max)

    def describe(self) -> str:
        parts = []
        if self.min is not None:
            parts.append(f">= {self.min:g}")
        if self.max is not None:
            parts.append(f"<= {self.max:g}")
        return f"{self.metric} {' and '.join(parts)}"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    bindings: Tuple[str, ...]
    coupled: bool = False


@dataclasses.dataclass(frozen=True)
class Study:
    """A validated study. Built by `load_study`; every field is plain data."""

    name: str
    path: str
    description: str
    baseline_recipe: str
    baseline_bindings: Tuple[str, ...]
    variants: Tuple[Variant, ...]
    seeds: Tuple[int, ...]
    metric: str
    metric_from: str
    direction: str
    guardrails: Tuple[Guardrail, ...]
    resume_from: str
    resume_variant: str
    cpus_per_run: int
    gpus_per_run: float
    retries: int
    alpha: float
    wandb_project: str = ""
    adaptive_seeds: Optional[AdaptiveSeeds] = None
    """When set, seeds are added to undecided variants up to a maximum (experiments/adaptive.py)."""
    resume_setting: bool = False
    """Also take the resumed variant's bindings into the baseline (planning reads them)."""

    @property
    def all_variants(self) -> Tuple[Variant, ...]:
        """The baseline first, then the declared variants."""
        return (Variant(BASELINE, ()),) + self.variants


def study(name: str = gin.REQUIRED, description: str = "", baseline_recipe: str = "tiny.gin",
          baseline_bindings: Sequence[str] = (), variants: Mapping = gin.REQUIRED,
          coupled: Sequence[str] = (), seeds=3, metric: str = "eval/accuracy",
          metric_from: str = "final", direction: str = "higher", guardrails: Mapping = None,
          resume_from: str = "", resume_variant: str = "", cpus_per_run: int = 1,
          gpus_per_run: float = 0, retries: int = 1, alpha: float = 0.05, wandb_project: str = "",
          adaptive_seeds: Mapping = None, resume_setting: bool = False) -> dict:
    """The gin configurable `study`; returns its arguments for `_validate`.

    name: the study's name; its results live in RESULTS/<name>/.
    baseline_recipe: an engine recipe, found next to the study file, under recipes/, or from cwd.
    baseline_bindings: engine bindings applied on top of the recipe for every run.
    variants: {name: 'scope.param = value'} (one binding), or a list of bindings for a variant
        named in `coupled`; {} runs the baseline alone (a first round).
    seeds: a count N (seeds 0..N-1) or a list of seeds; the same for every variant.
    metric, metric_from, direction: the decision metric, read from summary.json's `final`
        (held-out evaluation at the end) or `final_window` (mean over the last steps).
    guardrails: {metric: {'min': x, 'max': y}} checked on each run's final_window metrics.
    resume_from: a previous study's results dir (its chosen variant's checkpoints start this
        study's runs) or a checkpoint dir `.../checkpoints/step_N`.
    resume_variant: take this variant of `resume_from` instead of its chosen one.
    resume_setting: when resume_from is a study, its chosen variant's bindings join the baseline
        (before study.baseline_bindings, which win), so a round continues the previous round's
        setting and not only its weights; read at planning, when that study has run.
    cpus_per_run, gpus_per_run: Ray resources each run holds.
    retries: extra attempts for a run that crashed or was killed (a divergence or a
        configuration error is deterministic and never retried).
    alpha: significance level of the Holm-corrected Welch tests.
    wandb_project: the W&B project of the study's runs (default: the study's name).
    adaptive_seeds: {'max_seeds': N} (optional 'min_seeds', 'step', 'spend_alpha_over_looks'): start
        with study.seeds and add seeds to variants whose difference from the baseline is undecided.
    """
    return dict(locals())


gin.external_configurable(study, "study", module="experiments")


def _bad(binding: str, value, allowed: str) -> StudyError:
    return StudyError(f"{binding} = {value!r} is invalid: {allowed}")


def split_binding(line: str, where: str) -> Tuple[str, str]:
    """'ppo.kl_coef = 0.1' -> ('ppo.kl_coef', '0.1'); raises naming `where` otherwise."""
    m = BINDING_RE.match(line) if isinstance(line, str) else None
    if not m:
        raise StudyError(f"{where}: {line!r} is not a binding; expected 'scope.parameter = value'")
    return f"{m.group(1)}.{m.group(2)}", m.group(3)


def _engine_binding(line: str, where: str) -> str:
    key, _ = split_binding(line, where)
    scope = key.split(".")[0]
    if scope not in ENGINE_SCOPES:
        raise StudyError(f"{where}: {line!r} binds scope {scope!r}; allowed scopes: {', '.join(ENGINE_SCOPES)}")
    if key in MANAGED_BINDINGS:
        raise StudyError(f"{where}: {key} is set by the manager for each run "
                         f"(use study.seeds for seeds and study.resume_from for a starting checkpoint)")
    return key


def _seeds(value) -> Tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise _bad("study.seeds", value, "a count must be >= 1")
        return tuple(range(value))
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
        if len(set(value)) != len(value):
            raise _bad("study.seeds", value, "seeds must be distinct")
        return tuple(value)
    raise _bad("study.seeds", value, "must be a count >= 1 or a non-empty list of distinct integers >= 0")


def _variants(value, coupled: Sequence[str]) -> Tuple[Variant, ...]:
    if not isinstance(value, Mapping):
        raise _bad("study.variants", value, "must be a dict {name: 'scope.param = value'} ({} runs the "
                                            "baseline alone)")
    unknown = set(coupled) - set(value)
    if unknown:
        raise _bad("study.coupled", list(coupled), f"names {sorted(unknown)} that are not variants")
    out = []
    for name, spec in value.items():
        where = f"study.variants[{name!r}]"
        if not isinstance(name, str) or not NAME_RE.match(name) or name == BASELINE:
            raise StudyError(f"{where}: a variant name must match {NAME_RE.pattern} and not be "
                             f"{BASELINE!r} (it names a results folder)")
        lines = (spec,) if isinstance(spec, str) else tuple(spec) if isinstance(spec, (list, tuple)) else None
        if not lines:
            raise StudyError(f"{where} = {spec!r}: must be a binding string or a list of bindings")
        keys = [_engine_binding(line, where) for line in lines]
        if len(set(keys)) != len(keys):
            raise StudyError(f"{where} binds {keys}: each parameter at most once")
        if len(lines) > 1 and name not in coupled:
            raise StudyError(f"{where} changes {len(lines)} bindings ({', '.join(keys)}); a variant changes "
                             f"one parameter. If the change is deliberately coupled, add {name!r} to study.coupled")
        out.append(Variant(name, lines, coupled=name in coupled))
    return tuple(out)


def _guardrails(value) -> Tuple[Guardrail, ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise _bad("study.guardrails", value, "must be a dict {metric: {'min': x, 'max': y}}")
    out = []
    for metric, bounds in value.items():
        where = f"study.guardrails[{metric!r}]"
        if not isinstance(bounds, Mapping) or not bounds or set(bounds) - {"min", "max"}:
            raise StudyError(f"{where} = {bounds!r}: must be a dict with 'min' and/or 'max'")
        for k, v in bounds.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise StudyError(f"{where}['{k}'] = {v!r}: must be a number")
        out.append(Guardrail(metric, bounds.get("min"), bounds.get("max")))
    return tuple(out)


def find_recipe(recipe: str, study_path: Path) -> Path:
    """Looks for an engine recipe next to the study, under recipes/, then from cwd."""
    for base in (study_path.parent, RECIPES_DIR, Path.cwd()):
        candidate = (base / recipe).resolve()
        if candidate.is_file():
            return candidate
    raise _bad("study.baseline_recipe", recipe,
               f"no such file next to {study_path.name}, under {RECIPES_DIR} or in the current directory")


def _validate(args: dict, path: Path) -> Study:
    name = args["name"]
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise _bad("study.name", name, f"must match {NAME_RE.pattern} (it names the results folder)")
    bindings = args["baseline_bindings"]
    if isinstance(bindings, str) or not isinstance(bindings, (list, tuple)):
        raise _bad("study.baseline_bindings", bindings, "must be a list of 'scope.param = value' strings")
    for line in bindings:
        _engine_binding(line, "study.baseline_bindings")
    coupled = args["coupled"]
    if isinstance(coupled, str) or not isinstance(coupled, (list, tuple)):
        raise _bad("study.coupled", coupled, "must be a list of variant names")
    if args["metric_from"] not in METRIC_SOURCES:
        raise _bad("study.metric_from", args["metric_from"], f"must be one of {METRIC_SOURCES}")
    if args["direction"] not in DIRECTIONS:
        raise _bad("study.direction", args["direction"], f"must be one of {DIRECTIONS}")
    if not isinstance(args["metric"], str) or not args["metric"]:
        raise _bad("study.metric", args["metric"], "must be a metric name such as 'eval/accuracy'")
    cpus, gpus, retries = args["cpus_per_run"], args["gpus_per_run"], args["retries"]
    if not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1:
        raise _bad("study.cpus_per_run", cpus, "must be an integer >= 1")
    if not isinstance(gpus, (int, float)) or isinstance(gpus, bool) or gpus < 0:
        raise _bad("study.gpus_per_run", gpus, "must be a number >= 0 (fractions share a GPU)")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise _bad("study.retries", retries, "must be an integer >= 0")
    if not isinstance(args["alpha"], float) or not 0 < args["alpha"] < 1:
        raise _bad("study.alpha", args["alpha"], "must be a number in (0, 1)")
    for key in ("resume_from", "resume_variant", "description", "wandb_project"):
        if not isinstance(args[key], str):
            raise _bad(f"study.{key}", args[key], "must be a string")
    if not isinstance(args["resume_setting"], bool):
        raise _bad("study.resume_setting", args["resume_setting"], "must be True or False")
    resume_from = args["resume_from"]
    if resume_from:  # may not exist yet (a previous round still to run): planning checks it
        resume_from = str((Path.cwd() / Path(resume_from).expanduser()).resolve())
    return Study(
        name=name, path=str(path), description=args["description"],
        baseline_recipe=str(find_recipe(args["baseline_recipe"], path)),
        baseline_bindings=tuple(bindings), variants=_variants(args["variants"], coupled),
        seeds=_seeds(args["seeds"]), metric=args["metric"], metric_from=args["metric_from"],
        direction=args["direction"], guardrails=_guardrails(args["guardrails"]),
        resume_from=resume_from, resume_variant=args["resume_variant"], cpus_per_run=cpus,
        gpus_per_run=float(gpus), retries=retries, alpha=args["alpha"], wandb_project=args["wandb_project"],
        adaptive_seeds=parse_adaptive_seeds(args["adaptive_seeds"], len(_seeds(args["seeds"]))),
        resume_setting=args["resume_setting"])


def split_cli_bindings(bindings: Sequence[str]) -> Tuple[List[str], List[str]]:
    """`-b` bindings: `study.*` ones configure the study, the rest every run's baseline config."""
    study_level, engine = [], []
    for line in bindings:
        key, _ = split_binding(line, "-b")
        (study_level if key.startswith("study.") else engine).append(line)
    return study_level, engine


def load_study(path: str | Path, bindings: Sequence[str] = ()) -> Study:
    """Parses a study file plus `-b` bindings; returns a validated Study. Raises StudyError.

    `-b` bindings on `study.*` change the study; any other binding is appended to
    `study.baseline_bindings`, so it applies to every run of every variant.
    """
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"study file {str(path)!r} does not exist")
    study_level, engine = split_cli_bindings(bindings)
    for line in engine:
        _engine_binding(line, "-b")
    gin.clear_config()
    search_paths = list(gin.config._LOCATION_PREFIXES)  # gin has no API to remove a search path
    for p in (path.resolve().parent, RECIPES_DIR, Path.cwd()):
        gin.add_config_file_search_path(str(p))
    try:
        gin.parse_config_files_and_bindings([str(path)], study_level, finalize_config=False)
        stray = sorted(f"{sel.rsplit('.', 1)[-1]}.{param}" for (_, sel), params in gin.config._CONFIG.items()
                       if sel.rsplit(".", 1)[-1] != "study" for param in params)
        if stray:
            raise StudyError(f"{path.name} binds {', '.join(stray)}: a study file binds only study.*; "
                             f"put engine bindings in study.baseline_bindings")
        args = gin.get_configurable("study")()
    except StudyError:
        raise
    except (ValueError, SyntaxError, IOError, KeyError, TypeError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StudyError(f"{path.name}: {first}") from None
    finally:
        gin.clear_config()
        gin.config._LOCATION_PREFIXES[:] = search_paths
    args["baseline_bindings"] = list(args["baseline_bindings"]) + engine
    return _validate(args, path.resolve())

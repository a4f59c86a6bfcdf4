"""A study: one tuning round, declared in gin under the name `study`.

A study is a baseline (an engine recipe plus bindings), named variants that each change one
binding (a deliberately coupled multi-binding change must be listed in `study.coupled`), the
same seeds for every variant, a decision metric with its direction, guardrails, an optional
previous round to resume from, and the resources each run needs.

Study files bind only `study.*`; the engine's own bindings live in `study.baseline_bindings`,
so the recipe the engine runs stays an ordinary engine recipe. A study file is read with gin's
own parser (its statements, includes resolved like the engine's), never by registering a
configurable: `study()` lists what may be bound and its defaults, and `Study`, a frozen
dataclass like the engine's configs, validates itself, before any planning or compute, with
errors that name the binding and what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import re
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Tuple, cast

from gin import config_parser

from experiments import stats
from experiments.errors import StudyError
from experiments.results import BASELINE, PAIRED, WELCH  # one definition: the results name them
from experiments.sequential import Waves, parse_waves
from experiments.stats import POWER
from rlhf.configurable import RECIPES_DIR, SCOPES, find_recipe, iter_statements, statements
from rlhf.errors import ConfigError
from rlhf.metrics import EVAL_METRICS, FRACTIONS, METRICS, NAMESPACES, is_known_metric
from rlhf.validation import invalid, positive_int, why_not_a_file

EVAL_PREFIX = "eval/"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=+-]*$")
BINDING_RE = re.compile(r"^\s*([A-Za-z_][\w]*)\.([A-Za-z_]\w*)\s*=\s*(.+?)\s*$", re.S)
ENGINE_SCOPES = tuple(SCOPES)
"""The engine's gin scopes (rlhf/configurable.py): what a study's engine bindings may bind."""
MANAGED_BINDINGS = ("ppo.seed", "ppo.init_from", "ppo.torch_threads")
"""Set by the manager per run; a study may not bind them (seeds come from `study.seeds`)."""
START_GAP_S = 60.0
"""Default `study.start_gap_s`: a vLLM engine's start-up (load, memory profile, CUDA graphs) takes about a minute."""
METRIC_SOURCES = ("final", "final_window")
DIRECTIONS = ("higher", "lower")
AUTO = "auto"
ANALYSES = (AUTO, PAIRED, WELCH)


@dataclasses.dataclass(frozen=True)
class Guardrail:
    """`metric` (read from summary.json's final_window) must stay within [min, max]."""

    metric: str
    min: float | None = None
    max: float | None = None

    def violated_by(self, value: float | None) -> bool:
        """Whether a run's value breaks the bounds: outside [min, max], or missing or not a finite
        number (NaN, +-inf: a KL of -inf is a broken run, not one within `max`)."""
        if value is None or not math.isfinite(value):
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
    """The W&B project named by the study itself; '' leaves it to `wandb_sink.project_for`."""
    campaign: str = ""
    """The tuning campaign this study is a round of: its rounds share one W&B project named after it.
    Study-level: no run's hash depends on it (nor on the W&B project)."""
    sequential: Optional[Waves] = None
    """When set, seeds run in waves with group-sequential boundaries (experiments/sequential.py)."""
    resume_setting: bool = False
    """Also take the resumed variant's bindings into the baseline (planning reads them)."""
    start_gap_s: float = START_GAP_S
    """Runs sharing a GPU (gpus_per_run < 1) start their engines at most this far apart per GPU."""
    target_effect: Optional[float] = None
    """The smallest change of the decision metric worth detecting; when set, planning sizes the seeds
    per variant for it (experiments/seed_plan.py). Study-level: no run's hash depends on it."""
    power: float = POWER
    """The power wanted for a true difference of target_effect."""
    pilot: str = ""
    """A previous study's name (RESULTS/<name>) or results dir (absolute) whose spread sizes this
    round; '' takes resume_from's study."""
    analysis: str = AUTO
    """How a variant's seeds are compared with the baseline's: 'paired', 'welch', or 'auto'
    (chosen from the design by `resolve_analysis`)."""
    equivalence_margin: float = 0.0
    """A difference within +-this (the metric's units) counts as none: TOST equivalence; 0: off."""
    metric_resolution: float = 0.0
    """The decision metric's grid step (1/128 for an accuracy over 128 prompts), below which seeds'
    spread is no spread (`stats.is_flat`); 0: a continuous metric."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise _bad("study.name", self.name, f"must match {NAME_RE.pattern} (it names the results folder)")
        _choice("metric_from", self.metric_from, METRIC_SOURCES)
        _choice("direction", self.direction, DIRECTIONS)
        if not isinstance(self.metric, str) or not self.metric:
            raise _bad("study.metric", self.metric, "must be a metric name such as 'eval/accuracy'")
        if self.metric_from == "final" and not self.metric.startswith(EVAL_PREFIX):
            raise _bad("study.metric", self.metric, f"summary.json's final evaluation holds only held-out "
                                                    f"'{EVAL_PREFIX}...' metrics, e.g. 'eval/accuracy' (or set "
                                                    f"study.metric_from = 'final_window')")
        if not is_known_metric(self.metric):
            raise _bad("study.metric", self.metric, f"no run logs it{_close_metric(self.metric)}; {_KNOWN}")
        for g in self.guardrails:
            if not is_known_metric(g.metric):
                raise StudyError(f"study.guardrails[{g.metric!r}] is invalid: no run logs {g.metric!r}"
                                 f"{_close_metric(g.metric)}; {_KNOWN}")
        positive_int("study", "cpus_per_run", self.cpus_per_run, error=StudyError)
        positive_int("study", "retries", self.retries, minimum=0, error=StudyError)
        if not _is_number(self.gpus_per_run) or self.gpus_per_run < 0:
            raise _bad("study.gpus_per_run", self.gpus_per_run, "must be a number >= 0 (fractions share a GPU)")
        if not isinstance(self.alpha, float) or not 0 < self.alpha < 1:
            raise _bad("study.alpha", self.alpha, "must be a number in (0, 1)")
        for key in ("resume_from", "resume_variant", "description", "wandb_project", "campaign"):
            if not isinstance(getattr(self, key), str):
                raise _bad(f"study.{key}", getattr(self, key), "must be a string")
        for key in ("wandb_project", "campaign"):
            problem = wandb_project_problem(getattr(self, key))
            if problem:
                raise _bad(f"study.{key}", getattr(self, key), f"it names a W&B project, which {problem}")
        if not isinstance(self.resume_setting, bool):
            raise _bad("study.resume_setting", self.resume_setting, "must be True or False")
        if not _is_number(self.start_gap_s) or self.start_gap_s < 0:
            raise _bad("study.start_gap_s", self.start_gap_s, "must be a number of seconds >= 0")
        if self.target_effect is not None and not (_is_number(self.target_effect)
                                                   and 0 < self.target_effect < math.inf):
            raise _bad("study.target_effect", self.target_effect,
                       f"must be a number > 0 in the units of {self.metric} (the smallest change worth detecting), "
                       f"or None for no seed plan")
        if not _is_number(self.power) or not 0 < self.power < 1:
            raise _bad("study.power", self.power, f"must be a number in (0, 1), e.g. {POWER:g} (the chance of "
                                                  f"detecting a true difference of study.target_effect)")
        if not isinstance(self.pilot, str):
            raise _bad("study.pilot", self.pilot, _PILOT)
        _choice("analysis", self.analysis, ANALYSES)
        margin = self.equivalence_margin
        if not _is_number(margin) or margin != margin or margin < 0 or margin == float("inf"):
            raise _bad("study.equivalence_margin", margin, "must be a number >= 0 in the metric's units "
                                                           "(0 turns the equivalence test off)")
        if margin > 0 and self.target_effect is not None and margin > self.target_effect:
            raise StudyError(f"study.equivalence_margin = {margin:g} is invalid with study.target_effect = "
                             f"{self.target_effect:g}: the margin must be at most the target effect (a difference "
                             f"within +-margin counts as none, so a wider margin would call a change worth "
                             f"detecting 'equivalent'); lower study.equivalence_margin to <= {self.target_effect:g} "
                             f"or raise study.target_effect")
        step = self.metric_resolution
        if not _is_number(step) or step != step or step < 0 or step == float("inf"):
            raise _bad("study.metric_resolution", step, "must be a number >= 0 in the metric's units: its grid "
                                                         "step, e.g. 1/128 for an accuracy over 128 prompts "
                                                         "(0: a continuous metric)")
        if self.metric in FRACTIONS:  # a fraction's range bounds both: [0, 1]
            if margin >= 1:
                raise _bad("study.equivalence_margin", margin, f"must be below 1: {self.metric} is a fraction in "
                                                               f"[0, 1], and a margin as wide as its range calls every "
                                                               f"variant 'equivalent' (e.g. 0.02)")
            if step > 1:
                raise _bad("study.metric_resolution", step, f"must be at most 1: {self.metric} is a fraction in [0, 1] "
                                                            f"(its grid step is 1/prompts, e.g. 1/128)")

    @property
    def all_variants(self) -> Tuple[Variant, ...]:
        """The baseline first, then the declared variants."""
        return (Variant(BASELINE, ()),) + self.variants


WANDB_PROJECT_MAX = 128
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"
"""W&B's rule for a project name (wandb.Settings refuses others): at most 128 characters, none of these."""


def wandb_project_problem(name: str) -> str:
    """What makes `name` no W&B project name ('' when it is one, or empty: no choice made)."""
    if name and not name.strip():
        return "may not be blank (leave it '' to let WANDB_PROJECT, study.campaign or the study's name decide)"
    if len(name) > WANDB_PROJECT_MAX:
        return f"may have at most {WANDB_PROJECT_MAX} characters (it has {len(name)})"
    bad = sorted({c for c in name if c in WANDB_PROJECT_FORBIDDEN})
    if bad:
        return f"may not contain {' '.join(WANDB_PROJECT_FORBIDDEN)} (it contains {' '.join(bad)})"
    return ""


_PILOT = ("must be a previous study's name (its results are RESULTS/<name>) or its results dir "
          "(a path with a '/'), or '' for the study study.resume_from names")

_KNOWN = (f"the engine logs {', '.join(METRICS)}, the held-out {', '.join(EVAL_METRICS)} and metrics under "
          f"{', '.join(n + '...' for n in NAMESPACES if n != EVAL_PREFIX)} (rlhf/metrics.py)")


def _close_metric(name) -> str:
    """" (did you mean 'eval/accuracy'?)" for a misspelt metric name, else ''."""
    close = difflib.get_close_matches(str(name), METRICS + EVAL_METRICS, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resolve_analysis(analysis: str, planned_seeds: Mapping[str, Sequence[int]],
                     pilot_correlation: Optional[float] = None, alpha: float = 0.05) -> str:
    """The analysis a study's verdicts use: `analysis` itself unless it is 'auto', which is
    decided before any of the round's values are read, from its design and a previous round:
    'paired' when every variant runs on seeds the baseline also runs (seed s of every variant
    shares its prompt order and sampling streams with seed s of the baseline: the engine seeds
    everything from ppo.seed) and the pilot round's measured correlation between paired seeds
    makes the paired t-test the more sensitive at this round's seeds (a smaller minimum detectable
    effect: pairing halves the degrees of freedom, which a weak correlation does not repay), at the
    level each comparison's power is promised at, alpha over the variants compared
    (`stats.per_test_alpha`, as the verdicts and the seed plan compute it); 'welch' otherwise, and
    when no previous round measured a correlation. Both designs a study declares pair their runs:
    fixed `study.seeds` are every variant's, and seed waves give the baseline every look's
    seeds, so a variant that stopped early ran a prefix of them."""
    if analysis != AUTO:
        return analysis
    base = set(planned_seeds.get(BASELINE, ()))
    others = [set(seeds) for name, seeds in planned_seeds.items() if name != BASELINE]
    shared = bool(base) and all(seeds <= base for seeds in others)
    if not shared or pilot_correlation is None:
        return WELCH
    n = min([len(s) for s in others] or [len(base)])
    level = stats.per_test_alpha(alpha, len(others))
    return PAIRED if stats.paired_is_more_sensitive(n, pilot_correlation, level) else WELCH


def _choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise _bad(f"study.{key}", value, f"must be one of {allowed}")


REQUIRED: Any = object()
"""The default of the parameters a study file must bind; Any, as it stands in for a value of each one's type."""


STUDY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Study) if f.default is not dataclasses.MISSING}
"""{binding: default} of the bindings `Study` holds as bound, each default written once, on its field."""


def study(name: str = REQUIRED, description: str = "", baseline_recipe: str = "tiny.gin",
          baseline_bindings: Sequence[str] = (), variants: Mapping = REQUIRED,
          coupled: Sequence[str] = (), seeds=3, metric: str = "eval/accuracy",
          metric_from: str = "final", direction: str = "higher", guardrails: Optional[Mapping] = None,
          resume_from: str = "", resume_variant: str = "", cpus_per_run: int = 1,
          gpus_per_run: float = 0, retries: int = 1, alpha: float = 0.05, **fields) -> dict:
    """What a study file binds (`study.<parameter> = value`), with its defaults; returns them. The
    parameters listed here are bound in a form `Study` normalises (or holds without a default);
    `fields` are the rest, `STUDY_DEFAULTS`, whose defaults are `Study`'s own.

    name: the study's name; its results live in RESULTS/<name>/. Required.
    baseline_recipe: an engine recipe, found like the engine finds recipes
        (`rlhf.configurable.find_recipe`: the working directory, next to the study file, recipes/).
    baseline_bindings: engine bindings applied on top of the recipe for every run.
    variants: {name: 'scope.param = value'} (one binding), or a list of bindings for a variant
        named in `coupled`; {} runs the baseline alone (a first round). Required.
    seeds: a count N (seeds 0..N-1) or a list of distinct seeds >= 0; the same for every variant;
        at most MAX_SEEDS (10000, the most a seed plan proposes) per variant.
    metric, metric_from, direction: the decision metric, read from summary.json's `final`
        (held-out evaluation at the end: an `eval/...` metric) or `final_window` (mean over the
        last steps: any metric the engine logs, `rlhf.metrics.METRICS`).
    guardrails: {metric: {'min': x, 'max': y}} checked on each run's final_window metrics.
    resume_from: a previous study's results dir (its chosen variant's checkpoints start this
        study's runs) or a checkpoint dir `.../checkpoints/step_N`.
    resume_variant: take this variant of `resume_from` instead of its chosen one.
    resume_setting: when resume_from is a study, its chosen variant's bindings join the baseline
        (before study.baseline_bindings, which win), so a round continues the previous round's
        setting and not only its weights; read at planning, when that study has run.
    cpus_per_run, gpus_per_run: Ray resources each run holds.
    start_gap_s: when runs share a GPU (gpus_per_run < 1), each GPU starts one engine at a time:
        the next waits until the previous has logged its first step, at most this many seconds
        (engines starting together each measure the others' memory as their own, and vLLM then
        finds no memory for its cache); 0 starts them together.
    retries: extra attempts for a run that crashed or was killed (a divergence or a
        configuration error is deterministic and never retried).
    alpha: significance level of the Holm-corrected tests (the difference, and equivalence).
    analysis: 'paired' (the paired t-test of the per-seed differences: seed s of a variant shares
        its prompts and sampling streams with seed s of the baseline, so pairing removes the luck
        they share), 'welch' (Welch's t-test of the two groups of seeds), or 'auto': decided from
        the design and the pilot round before any of this round's values are read: 'paired' when
        every variant runs on the baseline's seeds (true of fixed study.seeds and of seed
        waves) and the pilot's measured correlation between paired seeds makes the paired test the
        more sensitive at this round's seeds and at alpha over the variants compared, 'welch'
        otherwise (`resolve_analysis`). Both are reported; this one decides.
    equivalence_margin: a number >= 0 in the metric's units (0: off). A variant neither better nor
        worse whose difference lies within +-margin by two one-sided tests (TOST, the chosen
        analysis, Holm-corrected) is 'equivalent': a settled question, not a lack of seeds. With
        study.target_effect set, at most target_effect (a change under the margin is no change, one
        of target_effect must not be missed; equal: the margin is the smallest change of interest).
    metric_resolution: the decision metric's grid step in its units, e.g. 1/128 for an accuracy
        over 128 eval prompts (0, the default: a continuous metric). Seeds that spread less than a
        quarter step are tied: the tests have no spread to judge chance by, and the verdict says
        so ('insufficient data') instead of reading a difference of one step as certain; their
        intervals take the grid's rounding error (step / sqrt(12)) as their spread.
    campaign: the tuning campaign this study is a round of (e.g. 'rlhf-demo' in every round of the
        demo): the rounds of one campaign log to one W&B project named after it, each study's runs
        grouped as `<study>/<variant>`. Changes no run, so no run hash.
    wandb_project: the W&B project of the study's runs. The first of: this binding, the
        WANDB_PROJECT environment variable, study.campaign, the study's name
        (experiments/wandb_sink.py `project_for`). Changes no run, so no run hash.
    sequential: seed waves (experiments/sequential.py): True or {'looks': 5, 'first': study.seeds,
        'max_seeds': N, 'spending': 'obrien_fleming' | 'pocock', 'futility': 'pocock' |
        'obrien_fleming' | 'none'}. Every variant and the baseline run each wave's seeds; at each
        look a variant that crosses the efficacy boundary is decided and one below the futility
        boundary stops, both get no more seeds; the boundaries keep the family-wise error at
        alpha. 'max_seeds' (the last wave) defaults to the seed plan's N for study.target_effect.
    target_effect: the smallest change of the decision metric worth detecting, in its units (e.g.
        0.02 = two points of gold accuracy); when set, `plan` sizes the seeds per variant for it from
        the pilot's spread (experiments/seed_plan.py). None (default): no seed plan.
    power: the chance wanted of detecting a true difference of target_effect (default 0.8).
    pilot: a previous study whose per-seed spread sizes this round: its name (RESULTS/<name>) or
        its results dir (a path with a '/'); default: the study resume_from names.
        target_effect, power and pilot change no run, so no run hash.
    """
    unknown = sorted(set(fields) - set(STUDY_DEFAULTS))
    if unknown:
        raise TypeError(f"study() got unexpected keyword arguments {', '.join(unknown)}")
    args = {key: value for key, value in locals().items() if key not in ("fields", "unknown")}
    return {**args, **STUDY_DEFAULTS, **fields}


STUDY_PARAMETERS = tuple(p.name for p in inspect.signature(study).parameters.values()
                         if p.kind is not inspect.Parameter.VAR_KEYWORD) + tuple(STUDY_DEFAULTS)
REPLACED = {"adaptive_seeds": "was replaced by study.sequential, seed waves whose boundaries keep the false-positive "
                              "rate at study.alpha across looks: e.g. study.sequential = {'looks': 5} with "
                              "study.target_effect, or {'looks': 5, 'max_seeds': 12}"}
"""Study bindings that no longer exist: {parameter: what the error says instead}."""


def _sequential(value, seeds: int, target_effect, margin) -> Optional[Waves]:
    """`study.sequential` -> Waves: 'first' defaults to the study's seeds (at least 2); the last
    wave needs 'max_seeds' or study.target_effect (the seed plan's N); equivalence (a TOST at one
    fixed sample) is a fixed design's question."""
    if isinstance(value, Mapping) and "first" not in value:
        value = {**value, "first": max(2, seeds)}
    cfg = parse_waves(value)
    if cfg is None:
        return None
    if cfg.max_seeds is None and target_effect is None:
        raise StudyError("study.sequential has no 'max_seeds' and no study.target_effect to plan it from: set "
                         "study.target_effect (the seed plan sizes the waves) or study.sequential['max_seeds']")
    if _is_number(margin) and margin > 0:
        raise StudyError(f"study.equivalence_margin = {margin:g} with study.sequential: equivalence is tested on a "
                         "fixed design (set study.equivalence_margin = 0, or remove study.sequential); seed waves "
                         "stop a variant that cannot reach the target effect for futility instead")
    return cfg


def _bad(binding: str, value, allowed: str) -> StudyError:
    return cast(StudyError, invalid(binding, value, allowed, StudyError))  # `invalid` builds the class it is given


def split_binding(line: str, where: str) -> Tuple[str, str]:
    """'ppo.kl_coef = 0.1' -> ('ppo.kl_coef', '0.1'); raises naming `where` otherwise."""
    m = BINDING_RE.match(line) if isinstance(line, str) else None
    if not m:
        raise StudyError(f"{where}: {line!r} is not a binding; expected 'scope.parameter = value'")
    return f"{m.group(1)}.{m.group(2)}", m.group(3)


def engine_binding(line: str, where: str) -> str:
    key, _ = split_binding(line, where)
    scope = key.split(".")[0]
    if scope not in ENGINE_SCOPES:
        raise StudyError(f"{where}: {line!r} binds scope {scope!r}; allowed scopes: {', '.join(ENGINE_SCOPES)}")
    if key in MANAGED_BINDINGS:
        raise StudyError(f"{where}: {key} is set by the manager for each run "
                         f"(use study.seeds for seeds and study.resume_from for a starting checkpoint)")
    return key


MAX_SEEDS = stats.MAX_SEEDS
"""The most seeds per variant a study may run (`study.seeds`, a count or a list, and seed waves'
'max_seeds'): the most the seed plan proposes (`stats.seeds_needed`) and the advisor writes as the
next round's `study.seeds`, so a plan is never refused; beyond it a count is a typo (seeds = 100000),
refused before planning: `plan` lists the cap's 10000 seeds x 2 variants in about 10 s."""
_SEEDS_ALLOWED = f"must be a count 1..{MAX_SEEDS} or a non-empty list of at most {MAX_SEEDS} distinct integers >= 0"


def _seeds_shown(value) -> str:
    """`value` as an error quotes it: a long list by its length and ends, so the error stays one short line."""
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{', '.join(map(repr, value[:3]))}, ... {value[-1]!r}] ({len(value)} seeds)"
    return repr(value)


def _seeds(value) -> Tuple[int, ...]:
    def bad(allowed: str) -> StudyError:
        return StudyError(f"study.seeds = {_seeds_shown(value)} is invalid: {allowed}")
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise bad("a count must be >= 1")
        if value > MAX_SEEDS:
            raise bad(f"at most {MAX_SEEDS} seeds per variant (the most a seed plan proposes); {_SEEDS_ALLOWED}")
        return tuple(range(value))
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
        if len(set(value)) != len(value):
            raise bad("seeds must be distinct")
        if len(value) > MAX_SEEDS:
            raise bad(f"at most {MAX_SEEDS} seeds per variant (the most a seed plan proposes); {_SEEDS_ALLOWED}")
        return tuple(value)
    raise bad(_SEEDS_ALLOWED)


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
        keys = [engine_binding(line, where) for line in lines]
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


def _validate(args: dict, path: Path) -> Study:
    """The declared arguments normalised (seeds, variants, guardrails, paths) into a Study, which
    validates the rest itself."""
    for key in ("name", "variants"):
        if args[key] is REQUIRED:
            raise StudyError(f"study.{key} is required: {path.name} does not bind it")
    bindings = args["baseline_bindings"]
    if isinstance(bindings, str) or not isinstance(bindings, (list, tuple)):
        raise _bad("study.baseline_bindings", bindings, "must be a list of 'scope.param = value' strings")
    for line in bindings:
        engine_binding(line, "study.baseline_bindings")
    coupled = args["coupled"]
    if isinstance(coupled, str) or not isinstance(coupled, (list, tuple)):
        raise _bad("study.coupled", coupled, "must be a list of variant names")
    if not isinstance(args["baseline_recipe"], str):
        raise _bad("study.baseline_recipe", args["baseline_recipe"], "must be a recipe file name")
    recipe = find_recipe(args["baseline_recipe"], path)
    if recipe is None:
        raise _bad("study.baseline_recipe", args["baseline_recipe"],
                   f"no such file in the current directory, next to {path.name} or under {RECIPES_DIR}")
    resume_from = args["resume_from"]
    if resume_from and isinstance(resume_from, str):  # may not exist yet (a previous round to run): planning checks it
        resume_from = str((Path.cwd() / Path(resume_from).expanduser()).resolve())
    seeds = _seeds(args["seeds"])
    pilot = args["pilot"]
    if isinstance(pilot, str) and pilot:
        if "/" in pilot or pilot.startswith(("~", ".")):  # a results dir, resolved like resume_from
            pilot = str((Path.cwd() / Path(pilot).expanduser()).resolve())
        elif not NAME_RE.match(pilot):
            raise _bad("study.pilot", pilot, _PILOT)
    return Study(
        name=args["name"], path=str(path), description=args["description"], baseline_recipe=str(recipe),
        baseline_bindings=tuple(bindings), variants=_variants(args["variants"], coupled),
        seeds=seeds, metric=args["metric"], metric_from=args["metric_from"],
        direction=args["direction"], guardrails=_guardrails(args["guardrails"]),
        resume_from=resume_from, resume_variant=args["resume_variant"], cpus_per_run=args["cpus_per_run"],
        gpus_per_run=float(args["gpus_per_run"]) if _is_number(args["gpus_per_run"]) else args["gpus_per_run"],
        retries=args["retries"], alpha=args["alpha"], wandb_project=args["wandb_project"],
        campaign=args["campaign"],
        sequential=_sequential(args["sequential"], len(seeds), args["target_effect"],
                               _as_float(args["equivalence_margin"])),
        resume_setting=args["resume_setting"], start_gap_s=args["start_gap_s"],
        target_effect=args["target_effect"], power=args["power"], pilot=pilot, analysis=args["analysis"],
        equivalence_margin=_as_float(args["equivalence_margin"]),
        metric_resolution=_as_float(args["metric_resolution"]))


def _as_float(value):
    """An integer margin as a float; anything else as written, for `Study` to judge and quote."""
    return float(value) if _is_number(value) and value >= 0 else value


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
    problem = why_not_a_file(path)
    if problem:
        raise StudyError(f"study file {str(path)!r} {problem}; expected a study recipe (.gin), "
                         f"e.g. recipes/studies/smoke.gin")
    study_level, engine = split_cli_bindings(bindings)
    for line in engine:
        engine_binding(line, "-b")
    args = study()
    try:  # a syntax error names its file and line (or -b binding); an include cycle its chain
        parsed = [(file, s) for file, s in iter_statements(path)]
        for line in study_level:
            parsed += [(line, s) for s in statements(line, "-b binding")]
    except ConfigError as err:
        raise StudyError(str(err)) from None
    stray = []
    for source, s in parsed:
        where = source.name if isinstance(source, Path) else "-b"
        if not isinstance(s, config_parser.BindingStatement):
            raise StudyError(f"{where}: a study file holds study.* bindings (and includes), not "
                             f"{type(s).__name__.replace('Statement', '').lower()} statements")
        name = f"{s.selector}.{s.arg_name}"
        if s.selector != "study" or s.scope:
            stray.append(name)
            continue
        if s.arg_name in REPLACED:
            raise StudyError(f"{name} ({where}) {REPLACED[s.arg_name]}")
        if s.arg_name not in STUDY_PARAMETERS:
            close = difflib.get_close_matches(s.arg_name, STUDY_PARAMETERS, n=1)
            hint = f"; did you mean study.{close[0]}?" if close else ""
            raise StudyError(f"{name} ({where}) is not a study binding{hint} Allowed: "
                             f"study.{{{', '.join(STUDY_PARAMETERS)}}}")
        if _has_reference(s.value):
            raise StudyError(f"{name} ({where}) = {s.value!r}: a study binds plain values (no macros or "
                             f"@references)")
        if isinstance(s.value, dict):
            _refuse_repeated_keys(name, source, s.location.line_num)
        args[s.arg_name] = s.value
    if stray:
        raise StudyError(f"{path.name} binds {', '.join(sorted(stray))}: a study file binds only study.*; "
                         f"put engine bindings in study.baseline_bindings")
    args["baseline_bindings"] = list(args["baseline_bindings"]) + engine \
        if isinstance(args["baseline_bindings"], (list, tuple)) else args["baseline_bindings"]
    return _validate(args, path.resolve())


def _refuse_repeated_keys(name: str, source, line_num: int) -> None:
    """A dict literal that lists a key twice keeps only the last entry (in gin as in Python): a
    variant, guardrail or option would vanish without a word. Read from the binding's text, which
    still holds every key; `source` is the study file (a Path) or a `-b` binding."""
    text = source.read_text() if isinstance(source, Path) else source
    lines = text.splitlines(keepends=True)[line_num - 1:] if isinstance(source, Path) else [text]
    value = lines[0].partition("=")[2]
    for more in [*lines[1:], None]:
        try:
            tree = ast.parse(value.strip(), mode="eval")
            break
        except SyntaxError:
            if more is None:
                return  # not Python's syntax: gin parsed it, nothing to compare
            value += more
    for node in ast.walk(tree):
        if not isinstance(node, ast.Dict):
            continue
        seen = set()
        for key_node in (k for k in node.keys if k is not None):
            try:
                key = ast.literal_eval(key_node)
            except (ValueError, TypeError, SyntaxError):
                continue
            if key in seen:
                where = f"{source}, line {line_num + key_node.lineno - 1}" if isinstance(source, Path) else "-b"
                entry = "variant" if name == "study.variants" else "key"
                raise StudyError(f"{name} ({where}) lists the {entry} {key!r} twice: a dict keeps only the last, "
                                 f"so the first would be dropped; give each {entry} its own name")
            seen.add(key)


def _has_reference(value) -> bool:
    if isinstance(value, (list, tuple, set)):
        return any(_has_reference(v) for v in value)
    if isinstance(value, dict):
        return any(_has_reference(k) or _has_reference(v) for k, v in value.items())
    return not isinstance(value, (str, int, float, bool, type(None)))

"""A study's results as typed, frozen data: the one reader and writer of `aggregate.json`.

`aggregate.aggregate()` builds a `StudyAggregate`; everything that reads a finished study
(planning a `resume_from`, the advisor, the report, the DVC exports, W&B) loads it with
`StudyAggregate.load(path)` and reads attributes, never raw keys, so the file's format can only
change here. `to_json()` / `from_json()` go through pydantic's `TypeAdapter` over these stdlib
dataclasses, which also checks the types when a file is read and ignores keys the format no longer
holds (a variant's `robustness` in files written before it was dropped).

The file (`RESULTS/<study>/aggregate.json`), one JSON object:
- `study`, `study_file`, `description`, `metric`, `metric_from` (`final` | `final_window`),
  `direction` (`higher` | `lower`), `alpha`, `seeds`, `guardrails` (their descriptions),
  `analysis` (`paired` | `welch`: the test that decided the verdicts, `study.analysis` with
  'auto' resolved), `equivalence_margin` (in the metric's units; 0: no equivalence test);
- `variants`: {name: variant}, the baseline first. A variant: `bindings` (its change), `coupled`,
  `summary` (n, mean, std, se, median, iqm, ci95 of the per-seed values), `runs` (per seed:
  seed, status, value, error, steps, run_dir relative to the study dir, guardrail values),
  `completed` / `failed` / `incomplete` run counts, `guardrails` ({metric: bound, min, max,
  per-seed values, violated_seeds, ok}), `guardrails_ok`, `comparison` against the baseline
  (null for the baseline): Welch's analysis (difference and its Welch 95% interval, p_value,
  hedges_g, prob_improvement, pooled_std, min_detectable_effect, seeds_needed, equivalence_p),
  `paired`, the paired analysis over the seeds both sides completed (n_pairs, difference and
  its paired t interval, sd_difference, p_value, wilcoxon_p_value, correlation,
  min_detectable_effect, seeds_needed, equivalence_p), `analysis` (which of the two decided),
  and that analysis's p_value_holm and equivalence_p_holm (Holm across the study's variants);
  `verdict`, `underpowered`, `explanation`;
- `decision`: `chosen` (null when nothing could be decided), `reason`, `guardrail_violations`;
- `provenance`: what the results depend on (the engine code's hash, data hashes, start
  checkpoints, recipe, `baseline_bindings`: the engine bindings the baseline's runs got, and
  `overrides`: those of them beyond the study file's and the resumed setting, from `--overrides`
  or `-b`; both absent in files written before they were recorded) and `hardware_mixed` when runs
  came from different machines; the
  machines themselves (git commit, versions, hardware) are in the study's `provenance.json`
  beside it, a machine record (report.MACHINE_PROVENANCE); `plots`: {stem: relative path};
- `sequential`: the seed waves' record (boundaries, each variant's last look, runs used), or null;
- `seed_plan`: the seeds per variant planned before the round for `study.target_effect`
  (experiments/seed_plan.py: target_effect, power, alpha, comparisons, seeds planned, sigma, the
  pilot it came from, its seeds and variants, the paired correlation or null for Welch's design,
  the seeds run and the power they give), or null when no target effect was set. Files written
  before it existed load with null.
- `metric_resolution`: the metric's grid step (study.metric_resolution; 0: continuous);
  `lineages`: {start checkpoint: seeds} when seeds share a start (then tested as lineage means);
- `best_checkpoints`: the checkpoints with the best held-out gold accuracy: `metric`, `runs` (per
  run that has one: variant, seed, step, value, path relative to the study dir) and `best` (the
  study's best of them); null in files written before it was recorded, or when no checkpoint's
  step was evaluated.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Annotated, Any, Dict, List, Optional, Tuple, TypeVar

from pydantic import Field, TypeAdapter, ValidationError

from experiments.errors import StudyError

AGGREGATE = "aggregate.json"
"""A study's aggregate, in its results dir (`aggregate_path`)."""
BASELINE = "baseline"


class RunStatus(str, enum.Enum):
    """A run's state, as its run dir says it (`run_records.state`); the strings the files hold
    (run.json's readers, aggregate.json's `runs`), which the members compare equal to."""

    COMPLETED = "completed"
    """summary.json says so, under the plan's hash."""
    FAILED = "failed"
    """The last attempt exited nonzero and no later attempt started."""
    INTERRUPTED = "interrupted"
    """Stopped with a checkpoint to resume from."""
    PENDING = "pending"
    """Not started, or stopped before its first checkpoint."""
    STALE = "stale"
    """The run dir holds a run of another hash (the config, code, data or start changed)."""
    RUNNING = "running"
    """A manager is running its attempt now (what `status` shows while the study's lock is held)."""

    __str__ = str.__str__  # the string itself, in f-strings and tables alike
    __format__ = str.__format__


# Verdicts. VARIANT_FAILED: no run of the variant completed (the same word as RunStatus.FAILED in files).
BETTER, WORSE, EQUIVALENT, NO_DIFFERENCE, INSUFFICIENT, VARIANT_FAILED, UNDECIDABLE = (
    "better", "worse", "equivalent", "no detectable difference", "insufficient data", "failed", "undecidable")
# Analyses: how a variant's seeds are compared with the baseline's (study.analysis).
WELCH, PAIRED = "welch", "paired"


@dataclasses.dataclass(frozen=True)
class Summary:
    """Statistics of one variant's per-seed values (`stats.summarize`)."""

    n: int = 0
    mean: Optional[float] = None
    std: Optional[float] = None
    se: Optional[float] = None
    median: Optional[float] = None
    iqm: Optional[float] = None
    ci95: Tuple[Optional[float], Optional[float]] = (None, None)
    """The mean's 95% t interval (`stats.mean_ci`); for seeds that tie on the metric's grid, the
    width of the grid's rounding error; null when they tie without a resolution."""


@dataclasses.dataclass(frozen=True)
class PairedComparison:
    """The paired analysis: seed s of the variant against seed s of the baseline, over the seeds
    both completed (`stats.compare_paired`)."""

    n_pairs: int = 0
    difference: Optional[float] = None
    """Mean of the per-seed differences."""
    difference_ci95: Tuple[Optional[float], Optional[float]] = (None, None)
    """Paired t interval (uncorrected)."""
    sd_difference: Optional[float] = None
    p_value: Optional[float] = None
    """Paired t-test (scipy's ttest_rel), before Holm."""
    wilcoxon_p_value: Optional[float] = None
    correlation: Optional[float] = None
    """Pearson's correlation of the pairs (null below 3 pairs)."""
    min_detectable_effect: Optional[float] = None
    seeds_needed: Optional[int] = None
    equivalence_p: Optional[float] = None
    """Paired TOST p-value for the study's equivalence margin, before Holm (null: no margin)."""
    flat: bool = False
    """The differences do not spread at the metric's resolution (`stats.is_flat`): the test is undefined."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A variant against the baseline: Welch's analysis (`stats.compare`) in the top-level fields,
    the paired one (`stats.compare_paired`) in `paired`; `analysis` names the one that decided,
    and the `_holm` fields are its p-values Holm-corrected across the study's variants."""

    difference: Optional[float] = None
    difference_ci95: Tuple[Optional[float], Optional[float]] = (None, None)
    """Welch's t interval (uncorrected)."""
    p_value: Optional[float] = None
    """Welch's t-test, before Holm."""
    p_value_holm: Optional[float] = None
    """The deciding analysis's p-value, Holm-corrected."""
    hedges_g: Optional[float] = None
    prob_improvement: Optional[float] = None
    pooled_std: Optional[float] = None
    min_detectable_effect: Optional[float] = None
    seeds_needed: Optional[int] = None
    equivalence_p: Optional[float] = None
    """Welch TOST p-value for the study's equivalence margin, before Holm (null: no margin)."""
    analysis: str = WELCH
    """Which analysis decided the verdict: 'welch' or 'paired' (files written before the paired
    analysis existed were decided by Welch's)."""
    paired: Optional[PairedComparison] = None
    equivalence_p_holm: Optional[float] = None
    """The deciding analysis's TOST p-value, Holm-corrected (null: no margin)."""
    flat: bool = False
    """Neither group spreads at the metric's resolution (`stats.is_flat`): Welch's test is undefined."""
    alpha_per_test: Optional[float] = None
    """The level the minimum detectable effects and seeds needed are computed at: study.alpha over
    the variants compared (Holm's strictest step, the seed plan's level)."""

    @property
    def decisive(self):
        """The deciding analysis's own record: `paired`, or this comparison for Welch's (both
        have difference, difference_ci95, p_value, min_detectable_effect, seeds_needed,
        equivalence_p)."""
        return self.paired if self.analysis == PAIRED and self.paired is not None else self


T = TypeVar("T")
NotInFile = Annotated[T, Field(exclude=True)]
"""A field aggregate.json does not hold (it loads with the default)."""


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """One seed of one variant: the one run record. `collect.read_run` reads it from the run dir;
    aggregate.json keeps it under its variant, without the fields marked NotInFile (the variant is
    its key there; the final evaluation and the best checkpoint are summarised beside it)."""

    seed: int
    status: RunStatus
    value: Optional[float] = None
    """The decision metric; None when the run did not complete or did not log it."""
    error: Optional[str] = None
    steps: Optional[int] = None
    run_dir: str = ""
    """The run dir as collect reads it; in aggregate.json relative to the study's results dir (so a
    results dir can move)."""
    guardrails: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    """Each guardrail metric's final-window value."""
    variant: NotInFile[str] = ""
    final: NotInFile[Optional[dict]] = None
    """summary.json's final held-out evaluation, when the run completed."""
    best_checkpoint: NotInFile[Optional[Tuple[int, float]]] = None
    """(step, gold accuracy) of the run's best evaluated checkpoint (`run_records.best_checkpoint`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", RunStatus(self.status))  # a status written as its string

    @property
    def key(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    def as_filed(self, run_dir: str) -> "RunOutcome":
        """The record as aggregate.json keeps it: `run_dir` (relative to the study's results dir)
        and the NotInFile fields at their defaults, as reading the file gives it back."""
        return dataclasses.replace(self, run_dir=run_dir, **{f.name: f.default for f in dataclasses.fields(self)
                                                             if str(f.type).startswith("NotInFile")})


@dataclasses.dataclass(frozen=True)
class GuardrailCheck:
    bound: str
    min: Optional[float] = None
    max: Optional[float] = None
    values: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    """{seed (as text): final-window value}."""
    violated_seeds: Tuple[int, ...] = ()
    ok: bool = True


@dataclasses.dataclass(frozen=True)
class VariantResult:
    bindings: Tuple[str, ...] = ()
    coupled: bool = False
    summary: Summary = Summary()
    runs: Tuple[RunOutcome, ...] = ()
    completed: int = 0
    failed: int = 0
    incomplete: int = 0
    guardrails: Dict[str, GuardrailCheck] = dataclasses.field(default_factory=dict)
    guardrails_ok: bool = True
    comparison: Optional[Comparison] = None
    verdict: str = BASELINE
    underpowered: bool = False
    explanation: str = ""
    beside: Dict[str, Summary] = dataclasses.field(default_factory=dict)
    """Final held-out metrics reported beside the decision metric (gold accuracy and the reward
    model's score, `aggregate.BESIDE_METRICS`), over the completed seeds that logged a finite
    value (`completed` - n of them had none: missing, NaN or inf)."""

    @property
    def values(self) -> List[float]:
        """The decision metric of every completed seed that logged it."""
        return [r.value for r in self.runs if r.status == RunStatus.COMPLETED and r.value is not None]


@dataclasses.dataclass(frozen=True)
class Decision:
    chosen: Optional[str]
    """The variant the next round continues from; None when no run completed or the metric
    was never logged (then nothing can be decided)."""
    reason: str
    guardrail_violations: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SequentialRecord:
    """A study run in seed waves (experiments/sequential.py): the design and how each variant ended."""

    waves: Tuple[int, ...]
    """Cumulative seeds per variant at each look."""
    spending: str
    futility: str
    alpha_per_variant: float
    """Each variant's two-sided level: study.alpha over the variants (Bonferroni)."""
    power: float
    """The power the futility boundaries were spent for."""
    boundaries: Tuple[Dict[str, Any], ...]
    """Per look: seeds, information fraction, efficacy and futility z, the efficacy boundary's nominal p."""
    variants: Dict[str, Dict[str, Any]]
    """Per variant, its last look (`sequential.judge`): look, seeds, units, z, t, df, difference, se,
    decision ('better' / 'worse' / 'futile'; 'continue' when its waves did not all run), and for
    a stop the stagewise interval, the design's p-value and the median-unbiased difference."""
    looks: Tuple[Dict[str, Any], ...]
    """Per look: seeds and each judged variant's record."""
    runs_used: int
    runs_max: int
    """Runs the design takes at most: every variant and the baseline at the last wave."""
    runs_fixed: Optional[int] = None
    """Runs the fixed design for the same target, power and alpha takes (with a seed plan)."""
    runs_expected_null: Optional[float] = None
    runs_expected_target: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class SeedPlan:
    """Seeds per variant planned before a round from a previous round's spread
    (experiments/seed_plan.py; `plan_line` says it in one line)."""

    target_effect: float
    """The smallest change worth detecting, in the decision metric's units (study.target_effect)."""
    power: float
    """The power wanted for a true difference of target_effect (study.power)."""
    alpha: float
    """The study's alpha; each comparison is planned at alpha / comparisons (Bonferroni: Holm's
    strictest step)."""
    comparisons: int
    """The variants compared with the baseline (at least 1)."""
    seeds: Optional[int] = None
    """Seeds per variant planned; None when there was no spread to plan from, or more than
    stats.MAX_SEEDS would be needed."""
    sigma: Optional[float] = None
    """The pilot's per-seed std, pooled over its variants (stats.pooled_std)."""
    pilot: str = ""
    """The pilot study's name; '' when there was none (a pilot round is proposed instead)."""
    pilot_seeds: int = 0
    """Completed per-seed values sigma pooled, over `pilot_variants` variants."""
    pilot_variants: int = 0
    correlation: Optional[float] = None
    """The paired design's correlation between paired seeds (the pilot's
    comparison.paired.correlation); None: Welch's two-sample design."""
    seeds_run: int = 0
    """Seeds per variant the study runs (seed waves: the last wave's)."""
    power_at_seeds_run: Optional[float] = None
    """The power those seeds give for a true difference of target_effect."""
    sd_baseline: Optional[float] = None
    """The pilot's spread of the arm this round continues (its chosen variant's seeds), when it has
    two; the plan then sizes each arm by its own spread."""
    sd_variant: Optional[float] = None
    """The spread planned for the variants: the pilot's pooled over its arms (sigma)."""
    sequential: Optional[Dict[str, Any]] = None
    """With seed waves: the planned waves, boundaries, simulated power, and runs at most and
    expected under the null and at the target, beside the fixed design's (`sequential.WavePlan`)."""

    def to_json(self) -> dict:
        return _SEED_PLAN.dump_python(self, mode="json")

    @classmethod
    def from_json(cls, data: dict) -> "SeedPlan":
        return _SEED_PLAN.validate_python(data)


@dataclasses.dataclass(frozen=True)
class CheckpointScore:
    """A saved checkpoint and its held-out gold accuracy (the eval row at the checkpoint's step)."""

    variant: str
    seed: int
    step: int
    value: Optional[float]
    """Null when the eval row held no finite number (the file writes a NaN as null): a missing value."""
    path: str
    """The checkpoint dir, relative to the study's results dir."""

    @property
    def rank(self) -> float:
        """The value to compare checkpoints by: a missing one ranks below every score."""
        return self.value if self.value is not None else -math.inf


@dataclasses.dataclass(frozen=True)
class BestCheckpoints:
    """Where gold accuracy peaked among the checkpoints a study saved: with a reward model that
    can be over-optimised, the best model of a run is often not its last one."""

    metric: str
    runs: Tuple[CheckpointScore, ...] = ()
    """Per run with an evaluated checkpoint: its best one (the earliest on a tie)."""
    best: Optional[CheckpointScore] = None
    """The study's best over every run (the first listed on a tie)."""


@dataclasses.dataclass(frozen=True)
class StudyAggregate:
    study: str
    study_file: str
    description: str
    metric: str
    metric_from: str
    direction: str
    alpha: float
    seeds: Tuple[int, ...]
    guardrails: Tuple[str, ...]
    variants: Dict[str, VariantResult]
    decision: Decision
    provenance: Dict[str, Any] = dataclasses.field(default_factory=dict)
    plots: Dict[str, str] = dataclasses.field(default_factory=dict)
    sequential: Optional[SequentialRecord] = None
    seed_plan: Optional[SeedPlan] = None
    best_checkpoints: Optional[BestCheckpoints] = None
    analysis: str = WELCH
    """The analysis that decided the verdicts ('auto' resolved)."""
    equivalence_margin: float = 0.0
    """study.equivalence_margin, in the metric's units (0: no equivalence test)."""
    metric_resolution: float = 0.0
    """study.metric_resolution: the metric's grid step (0: continuous)."""
    lineages: Dict[str, Tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """{start checkpoint: seeds} when seeds share a start (a round resumed from fewer seeds than it
    runs): the tests then compare lineage means, one unit per start; {} when every seed is its own."""

    # ----------------------------------------------------------------- reading helpers
    @property
    def chosen(self) -> Optional[VariantResult]:
        return self.variants.get(self.decision.chosen) if self.decision.chosen else None

    def variant(self, name: str) -> VariantResult:
        """The named variant; KeyError naming the variants that exist."""
        if name not in self.variants:
            raise KeyError(f"variant {name!r} is not in study {self.study}; allowed: {', '.join(self.variants)}")
        return self.variants[name]

    # ----------------------------------------------------------------- (de)serialisation
    def to_json(self) -> dict:
        return _ADAPTER.dump_python(self, mode="json")

    @classmethod
    def from_json(cls, data: dict) -> "StudyAggregate":
        """An aggregate as `to_json` writes it: every field present (a file without one was not
        written by this manager; `python -m experiments report` writes it anew). Keys the format
        no longer holds are ignored (pydantic's default for dataclasses), so a file written before
        a field was dropped still loads: a variant's `robustness`, for one."""
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.name not in ADDED_LATER] if isinstance(data, dict) else []
        if missing:
            raise ValueError(f"no {', '.join(missing)} (`python -m experiments report` writes the aggregate anew)")
        try:
            return _ADAPTER.validate_python(data)
        except ValidationError as err:  # the first wrong field by its path, as a reader finds it in the file
            raise ValueError(field_error(err)) from None

    def save(self, path: str | Path) -> None:
        from rlhf.atomic import write_json
        write_json(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "StudyAggregate":
        """Reads an aggregate.json; raises FileNotFoundError, or ValueError naming the file."""
        path = Path(path)
        text = path.read_text()
        try:
            return cls.from_json(json.loads(text))
        except ValueError as err:  # json's and pydantic's errors are both ValueErrors
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"{path}: not a study aggregate ({first})") from None

    def replace(self, **changes) -> "StudyAggregate":
        return dataclasses.replace(self, **changes)


def field_error(err: ValidationError) -> str:
    """Pydantic's first error as 'best_checkpoints.runs[3].value: Input should be a valid number (got
    null)': the field's path in the JSON file, and what it holds."""
    first = err.errors()[0]
    path = ""
    for part in first["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f"{'.' if path else ''}{part}"
    got = json.dumps(first.get("input"), default=str)
    return f"{path or 'the file'}: {first['msg']} (got {got[:60]})"


ADDED_LATER = ("sequential",)
"""Aggregate fields a file written before they existed lacks (it loads with the default); keys a
file holds that no field names any more (`adaptive`, the seed rule seed waves replaced) are ignored."""
_ADAPTER = TypeAdapter(StudyAggregate)
_SEED_PLAN = TypeAdapter(SeedPlan)


def aggregate_path(study_dir: str | Path) -> Path:
    return Path(study_dir) / AGGREGATE


def load_aggregate(study_dir: str | Path) -> Optional[StudyAggregate]:
    """The study dir's aggregate, or None when it has none yet."""
    path = aggregate_path(study_dir)
    return StudyAggregate.load(path) if path.is_file() else None


def read_aggregate(study_dir: str | Path, missing: str, error: type = StudyError, where: str = "") -> StudyAggregate:
    """The aggregate of the finished study in `study_dir`; else `error` (StudyError or a subclass)
    in one line: `missing` when the study has no aggregate yet (each caller says what to do, which
    depends on why it reads the study), or what is wrong with the file when it is not a study
    aggregate (after `where: `, when given)."""
    try:
        agg = load_aggregate(study_dir)
    except ValueError as err:
        raise error(f"{where}: {err}" if where else str(err)) from None
    if agg is None:
        raise error(missing)
    return agg

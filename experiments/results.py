"""A study's results as typed, frozen data: the one reader and writer of `aggregate.json`.

`aggregate.aggregate()` builds a `StudyAggregate`; everything that reads a finished study
(planning a `resume_from`, the advisor, the report, the DVC exports, W&B) loads it with
`StudyAggregate.load(path)` and reads attributes, never raw keys, so the file's format can only
change here. `to_json()` / `from_json()` go through pydantic's `TypeAdapter` over these stdlib
dataclasses, which also checks the types when a file is read.

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
  `verdict`, `underpowered`, `explanation`, `robustness` (the verdict with each seed left out,
  and `fragile` when one of them differs);
- `decision`: `chosen` (null when nothing could be decided), `reason`, `guardrail_violations`;
- `provenance`: what the runs ran on (code version, data hashes, versions, hardware, and
  `hardware_mixed` when runs came from different machines); `plots`: {stem: relative path};
- `adaptive`: the adaptive-seeds record (seeds per variant, looks, runs used), or null.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from pydantic import TypeAdapter

BASELINE = "baseline"
# Verdicts.
BETTER, WORSE, EQUIVALENT, NO_DIFFERENCE, INSUFFICIENT, FAILED, UNDECIDABLE = (
    "better", "worse", "equivalent", "no detectable difference", "insufficient data", "failed", "undecidable")
DECIDED = (BETTER, WORSE, EQUIVALENT)
"""The verdicts that settle a comparison (leave-one-seed-out checks that they survive)."""
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

    @property
    def decisive(self):
        """The deciding analysis's own record: `paired`, or this comparison for Welch's (both
        have difference, difference_ci95, p_value, min_detectable_effect, seeds_needed,
        equivalence_p)."""
        return self.paired if self.analysis == PAIRED and self.paired is not None else self


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """One seed of one variant."""

    seed: int
    status: str
    """completed | failed | interrupted | pending | stale."""
    value: Optional[float] = None
    """The decision metric; None when the run did not complete or did not log it."""
    error: Optional[str] = None
    steps: Optional[int] = None
    run_dir: str = ""
    """Relative to the study's results dir (so a results dir can move)."""
    guardrails: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)


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
class Robustness:
    """Leave-one-seed-out: the verdict recomputed with each seed left out of every variant."""

    leave_one_out: Dict[str, str] = dataclasses.field(default_factory=dict)
    """{seed left out (as text): verdict}."""
    fragile: bool = False
    """True when a verdict of better/worse/equivalent does not survive leaving out some seed, or
    when leaving out one seed turns 'no detectable difference' into one of them."""
    fragile_seeds: Tuple[int, ...] = ()


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
    robustness: Optional[Robustness] = None
    beside: Dict[str, Summary] = dataclasses.field(default_factory=dict)
    """Final held-out metrics reported beside the decision metric (gold accuracy and the reward
    model's score, `aggregate.BESIDE_METRICS`), over the completed seeds that logged them."""

    @property
    def values(self) -> List[float]:
        """The decision metric of every completed seed that logged it."""
        return [r.value for r in self.runs if r.status == "completed" and r.value is not None]

    @property
    def fragile(self) -> bool:
        return bool(self.robustness and self.robustness.fragile)


@dataclasses.dataclass(frozen=True)
class Decision:
    chosen: Optional[str]
    """The variant the next round continues from; None when no run completed or the metric
    was never logged (then nothing can be decided)."""
    reason: str
    guardrail_violations: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class AdaptiveVariant:
    """How adaptive seeding ended for one variant."""

    n: int
    """Seeds it ran."""
    decided: bool
    interval: Tuple[Optional[float], Optional[float]]
    """Welch interval of the difference at the study's adaptive confidence (null: unbounded)."""
    look: int
    stopped: str
    """'decided' (the interval excludes zero) or 'max_seeds'."""


@dataclasses.dataclass(frozen=True)
class AdaptiveRecord:
    """The adaptive-seeds run of a study (experiments/adaptive.py)."""

    max_seeds: int
    min_seeds: int
    step: int
    confidence: float
    spend_alpha_over_looks: bool
    variants: Dict[str, AdaptiveVariant]
    looks: Tuple[Dict[str, Any], ...]
    """Per look: seeds, the variants still active, their intervals."""
    runs_used: int
    runs_fixed: int
    """Runs a fixed design at max_seeds would have taken."""


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
    adaptive: Optional[AdaptiveRecord] = None
    analysis: str = WELCH
    """The analysis that decided the verdicts ('auto' resolved); older files: Welch's."""
    equivalence_margin: float = 0.0
    """study.equivalence_margin, in the metric's units (0: no equivalence test)."""

    # ----------------------------------------------------------------- reading helpers
    @property
    def chosen(self) -> Optional[VariantResult]:
        return self.variants.get(self.decision.chosen) if self.decision.chosen else None

    def variant(self, name: str) -> VariantResult:
        """The named variant; KeyError naming the variants that exist."""
        if name not in self.variants:
            raise KeyError(f"variant {name!r} is not in study {self.study}; allowed: {', '.join(self.variants)}")
        return self.variants[name]

    @property
    def fragile_variants(self) -> List[str]:
        return [n for n, v in self.variants.items() if v.fragile]

    # ----------------------------------------------------------------- (de)serialisation
    def to_json(self) -> dict:
        return _ADAPTER.dump_python(self, mode="json")

    @classmethod
    def from_json(cls, data: dict) -> "StudyAggregate":
        return _ADAPTER.validate_python(data)

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


_ADAPTER = TypeAdapter(StudyAggregate)


def aggregate_path(study_dir: str | Path) -> Path:
    return Path(study_dir) / "aggregate.json"


def load_aggregate(study_dir: str | Path) -> Optional[StudyAggregate]:
    """The study dir's aggregate, or None when it has none yet."""
    path = aggregate_path(study_dir)
    return StudyAggregate.load(path) if path.is_file() else None

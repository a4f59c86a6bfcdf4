"""The evidence a rule reads: one variant's metrics over the last steps, every seed, plus its config.

The guide's rules are judgements on curves ("KL oscillating in 0.03-0.08", "reward rising then
crashing"), so a rule needs more than the final-window means of summary.json: it needs the
per-step values of every seed. A `Window` holds them as (seeds x steps) arrays, NaN where a seed
did not log a metric at a step, together with the parameter values the variant ran with (rules
propose a change relative to them), the device's memory when it is known, and the changes the
study already settled: a variant found `equivalent` (or `worse`) answered its question, so the
advisor does not propose that change again.

Held-out evaluations (`eval/...`) come apart, over the whole run: a run evaluates only every
`ppo.eval_every` steps, so a window holds two or three of them, and over-optimisation is read from
the change between a run's initial evaluation (step 0, before any update) and its last one.

`load_window` reads a study's results dir (`RESULTS/<study>/`, via its aggregate.json and run dirs).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from experiments.errors import StudyError
from experiments.results import EQUIVALENT, WORSE, RunStatus, StudyAggregate, aggregate_path, read_aggregate
from experiments.run_records import iter_metrics, read_json, scalar
from experiments.study import split_binding

DEFAULT_WINDOW = 50
"""Steps read by default: the guide judges trends "for long", more than summary.json's window."""

_GIN_LINE = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)\s*=\s*(.+?)\s*$")


class AdviceError(StudyError):
    """The advisor cannot read its input; the message names what is missing and how to get it.
    (A StudyError, so the CLI reports it in one line with the configuration exit code.)"""


@dataclasses.dataclass(frozen=True)
class Window:
    """One variant's metrics over a window of steps, every seed.

    values: {metric: array (seeds x steps)}, NaN where missing; steps: the step numbers (columns).
    config: {'ppo.kl_coef': 0.05, ...}, the operative parameters of the variant.
    device_memory_gb: the accelerator's total memory, when known (rules on memory need it).
    evals: {eval metric: array (seeds x eval_steps)} over the whole run, NaN where missing.
    """

    variant: str
    steps: np.ndarray
    values: Mapping[str, np.ndarray]
    config: Mapping[str, object]
    device_memory_gb: Optional[float] = None
    seeds: Sequence[int] = ()
    eval_steps: np.ndarray = dataclasses.field(default_factory=lambda: np.array([], int))
    evals: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    settled: Mapping[Tuple[str, object], str] = dataclasses.field(default_factory=dict)
    """{(parameter, value): why} for the changes the study settled (`settled_changes`)."""

    def has(self, metric: str) -> bool:
        a = self.values.get(metric)
        return a is not None and bool(np.isfinite(a).any())

    def mean(self, metric: str) -> Optional[float]:
        """Mean over seeds and steps; None when the metric was never logged."""
        if not self.has(metric):
            return None
        return float(np.nanmean(self.values[metric]))

    def max(self, metric: str) -> Optional[float]:
        return float(np.nanmax(self.values[metric])) if self.has(metric) else None

    def seed_curves(self, metric: str) -> list:
        """Each seed's curve over the window with its missing steps dropped."""
        if metric not in self.values:
            return []
        return [row[np.isfinite(row)] for row in self.values[metric] if np.isfinite(row).any()]

    def curve(self, metric: str) -> np.ndarray:
        """Mean over seeds at each step (NaN-aware)."""
        if metric not in self.values:
            return np.array([])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(self.values[metric], axis=0)

    def param(self, name: str, default=None) -> Any:
        """The variant's value of `name` (a number, string or bool as the config holds it; Any because rules
        do arithmetic on the numeric ones), `default` when the config does not set it."""
        return self.config.get(name, default)

    def eval_ends(self, metric: str) -> np.ndarray:
        """(seeds x 2): each seed's first and last evaluation of `metric` over the run; NaN rows for
        seeds that evaluated it fewer than twice (no change to read)."""
        rows = self.evals.get(metric, np.empty((0, 0)))
        out = np.full((len(rows), 2), np.nan)
        for i, row in enumerate(rows):
            finite = row[np.isfinite(row)]
            if len(finite) >= 2:
                out[i] = finite[0], finite[-1]
        return out


def parse_operative_config(text: str) -> Dict[str, object]:
    """{'ppo.kl_coef': 0.05, ...} from gin's operative config (one-line Python literals only)."""
    out = {}
    for line in text.splitlines():
        m = _GIN_LINE.match(line)
        if not m:
            continue
        try:
            out[f"{m.group(1)}.{m.group(2)}"] = ast.literal_eval(m.group(3))
        except (ValueError, SyntaxError):
            continue
    return out


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text.strip()


def change_key(binding: str) -> Tuple[str, object]:
    """'ppo.kl_coef = 0.06' -> ('ppo.kl_coef', 0.06): a binding as its parameter and value, so a
    suggestion and a variant that set the same value match however the value was written."""
    key, value = split_binding(binding, "binding")
    return key, _literal(value)


SETTLING_VERDICTS = (EQUIVALENT, WORSE)
"""Verdicts that answer a change's question: no gain within the margin, or a loss."""


def settled_changes(agg: StudyAggregate) -> Dict[Tuple[str, object], str]:
    """{(parameter, value): why} for every single-binding variant of the study whose verdict is
    equivalent or worse."""
    out = {}
    for name, v in agg.variants.items():
        if v.verdict in SETTLING_VERDICTS and len(v.bindings) == 1:
            out[change_key(v.bindings[0])] = f"{agg.study}/{name} found it {v.verdict}"
    return out


def _device_memory_gb(run_dir: Path) -> Optional[float]:
    """Total accelerator memory from the run's provenance, when the engine recorded it."""
    prov = read_json(run_dir / "provenance.json") or {}
    for holder in (prov, prov.get("hardware") or {}):
        for key in ("gpu_memory_gb", "gpu_total_memory_gb"):
            v = scalar(holder.get(key)) if isinstance(holder, dict) else None
            if v:
                return v
    return None


def load_window(study_dir: str | Path, variant: Optional[str] = None, window: int = DEFAULT_WINDOW,
                device_memory_gb: Optional[float] = None) -> Window:
    """The last `window` steps of `variant` (default: the study's chosen one), every completed seed."""
    study_dir = Path(study_dir)
    agg = read_aggregate(study_dir, f"{aggregate_path(study_dir)} not found: run `python -m experiments run` (or "
                                    f"`report`) on the study first", AdviceError)
    variant = variant or agg.decision.chosen
    if variant is None:
        raise AdviceError(f"{study_dir}: the study decided nothing ({agg.decision.reason}); name a variant "
                          f"with --variant")
    if variant not in agg.variants:
        raise AdviceError(f"variant {variant!r} is not in {study_dir}; allowed: {', '.join(agg.variants)}")
    if not isinstance(window, int) or window < 2:
        raise AdviceError(f"window = {window!r} is invalid: must be an integer >= 2 (steps)")
    runs = [r for r in agg.variants[variant].runs if r.status == RunStatus.COMPLETED]
    if not runs:
        raise AdviceError(f"variant {variant!r} of {study_dir} has no completed run to read")
    rows_by_seed, evals_by_seed = {}, {}
    for run in runs:
        rows = list(iter_metrics(study_dir / run.run_dir))
        rows_by_seed[run.seed] = [row for row in rows if "reward_mean" in row][-window:]
        evals_by_seed[run.seed] = [{k: v for k, v in row.items() if k == "step" or k.startswith("eval/")}
                                   for row in rows if any(k.startswith("eval/") for k in row)]
    steps, values = _grid(rows_by_seed)
    eval_steps, evals = _grid(evals_by_seed)
    first = study_dir / runs[0].run_dir
    config_path = first / "config.gin"
    if not config_path.is_file():
        raise AdviceError(f"{config_path} not found: the advisor needs the operative config of the run")
    return Window(variant=variant, steps=steps, values=values,
                  config=parse_operative_config(config_path.read_text()),
                  device_memory_gb=device_memory_gb or _device_memory_gb(first), seeds=tuple(rows_by_seed),
                  eval_steps=eval_steps, evals=evals, settled=settled_changes(agg))


def _grid(rows_by_seed: Mapping[int, Sequence[dict]]) -> tuple:
    """(steps, {metric: array (seeds x steps)}) of metrics.jsonl rows, NaN where a seed did not log
    a metric at a step; non-scalar metrics (histograms) left out."""
    steps = sorted({int(r["step"]) for rows in rows_by_seed.values() for r in rows})
    col = {s: i for i, s in enumerate(steps)}
    names = sorted({k for rows in rows_by_seed.values() for r in rows for k, v in r.items()
                    if scalar(v) is not None and k != "step"})
    values = {name: np.full((len(rows_by_seed), len(steps)), np.nan) for name in names}
    for i, rows in enumerate(rows_by_seed.values()):
        for r in rows:
            for name in names:
                v = scalar(r.get(name))
                if v is not None:
                    values[name][i, col[int(r["step"])]] = v
    return np.asarray(steps, int), values

"""Metric records and their sinks. The trainer emits one record (a flat dict with `step`) per
step; sinks write it somewhere: a JSONL file, a live console line. Other sinks (W&B) plug in
from outside the engine through the same two-method interface.

A step's record lands in two files of the run dir. `metrics.jsonl` holds what the run computed,
a function of its config, code, data and seed, the same on every machine. `perf.jsonl` holds
what the machine measured about it (`MACHINE_NAMESPACES`: `timing_s/...`, `perf/...`), which
differs run to run. A versioned result (a DVC output) is then the same wherever it is
reproduced, while the measurements stay beside it. `read_metrics` joins them again by step, so
every reader sees one record per step with every name.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Protocol

METRICS = ("reward_mean", "reward_std", "accuracy", "kl_divergence", "kl_coef", "clip_fraction",
           "clip_fraction_lower", "clip_fraction_upper", "policy_ratio_hist", "response_length_mean",
           "response_clip_ratio", "rollout_success_rate")
"""The top-level names of a step's record (the tuning guide's signals under its own names);
everything else the engine logs is under one of `NAMESPACES`."""
NAMESPACES = ("actor/", "critic/", "eval/", "timing_s/", "perf/", "rollout/")
"""Prefixes of the namespaced extras; `eval/` metrics are also the held-out evaluation that
summary.json's `initial` and `final` hold."""
SIGNALS = ("reward_mean", "kl_divergence", "clip_fraction", "clip_fraction_lower", "clip_fraction_upper",
           "response_length_mean", "rollout_success_rate", "eval/accuracy")
"""The tuning guide's signals a step logs, and the held-out accuracy: what the reports chart, in their
order. The W&B report draws each (experiments/wandb_report.py); the plots (experiments/plots.py) and
the DVC curves (experiments/stages.py) draw a selection, each saying what it leaves out and why."""


EVAL_METRICS = ("eval/accuracy", "eval/rm_score", "eval/reward_mean", "eval/response_length_mean",
                "eval/rollout_success_rate", "eval/greedy_accuracy", "eval/greedy_rm_score",
                "eval/greedy_reward_mean")
"""Every `eval/` name a PPO run logs (`PPOTrainer.evaluate`; `rm_score` with a reward model,
`greedy_` ones when ppo.eval_temperature > 0)."""


FRACTIONS = ("accuracy", "clip_fraction", "clip_fraction_lower", "clip_fraction_upper", "response_clip_ratio",
             "rollout_success_rate", "eval/accuracy", "eval/rollout_success_rate", "eval/greedy_accuracy")
"""Metrics that are fractions, in [0, 1]: a margin or a grid step in their units is bounded by that range."""


MACHINE_NAMESPACES = ("timing_s/", "perf/")
"""Names the machine measures (wall times, throughput, memory, utilisation): they go to
`PERF_FILE`, the rest of a record to `METRICS_FILE`."""
PHASE_KEYS = ("perf/memory_gb/", "perf/memory_reserved_gb/")
"""The keys of a phase's peak memory, allocated and reserved (GiB): prefix + phase name (`step_record`)."""
HOST_BUSY_KEY = "perf/host_busy/"
"""+ phase name: the CPU time of the thread that ran the phase over its wall time, 0-1 (`step_record`;
on Ray the ranks', rlhf/profiling.py `PhaseClock`)."""
RANK_TIME_KEY = "perf/rank_s/"
"""+ phase name, on Ray: the seconds the phase's calls ran on the slowest rank (rlhf/profiling.py
`PhaseClock`); `timing_s/<phase>` less this is what passing the calls between processes took."""
METRICS_FILE, PERF_FILE, PERF_SUMMARY = "metrics.jsonl", "perf.jsonl", "perf.json"
"""PERF_SUMMARY: the run's wall time and the final-window means of its machine measurements."""


def host_busy(cpu_s: float, wall_s: float) -> float:
    """How busy a thread kept its host through `wall_s` seconds in which it used `cpu_s` of CPU: 0-1
    (the clocks' granularity can put the CPU time a little above the wall time)."""
    return min(1.0, cpu_s / wall_s)


def is_machine_metric(name: str) -> bool:
    return name.startswith(MACHINE_NAMESPACES)


def is_known_metric(name: str) -> bool:
    """True for a name the engine logs or may log: a known name, one of `EVAL_METRICS`, or one
    under another known namespace."""
    if not isinstance(name, str):
        return False
    if name.startswith("eval/"):
        return name in EVAL_METRICS
    return name in METRICS or (name.startswith(NAMESPACES) and len(name) > name.index("/") + 1)



def step_record(batch, *, advantages: Dict, critic: Dict, actor: Dict, entropy_old, logprob_gap: float | None,
                prompt_truncated_fraction: float | None, phase_times: Dict[str, float],
                phase_memory_gb: Dict[str, float], step_s: float, generate_ahead_s: float, max_rss_gb: float,
                device_report: Dict[str, float], phase_reserved_gb: Dict[str, float] | None = None,
                phase_host_cpu_s: Dict[str, float] | None = None) -> Dict:
    """One PPO step's record (without `step`), from what its phases returned: the advantage phase's
    statistics (`advantages`), the critic's and the actor's update statistics, and the rollout
    `batch` (scores, masks, `finished`, ...) with `entropy_old` [B, R], the old policy's entropy.
    The machine's measurements come in as numbers: each phase's wall time, the CPU time of the thread
    that ran it (`perf/host_busy/<phase>`: that over the wall time) and peak memory, allocated and
    reserved (`PhaseTimer`), the step's wall time, the part of this rollout that ran during the previous
    step (`generate_ahead_s`, 0: none), the process's peak RSS and `device_report` (memory and
    utilisation of every process holding a role). The order of the names is the order of
    metrics.jsonl's columns."""
    from rlhf import algos  # torch: the experiment manager reads the names above without it

    record = dict(advantages)
    if logprob_gap is not None:  # ppo.rollout_logprobs
        record["rollout/logprob_gap"] = logprob_gap
    record.update(critic)
    record.update(actor)
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    finished = batch["finished"]
    record.update({
        "reward_mean": float(batch["scores"].mean()),
        "reward_std": float(batch["scores"].std()) if len(batch) > 1 else 0.0,
        "accuracy": float(batch["correct"].float().mean()),
        **({"rollout/rm_score_mean": float(batch["rm_scores"].mean())} if "rm_scores" in batch else {}),
        "clip_fraction": record.get("actor/clip_fraction"),
        "clip_fraction_lower": record.get("actor/clip_fraction_lower"),
        "clip_fraction_upper": record.get("actor/clip_fraction_upper"),
        "response_length_mean": float(lengths.mean()),
        "response_clip_ratio": float((~finished).float().mean()),
        "rollout_success_rate": float((finished & batch["well_formed"]).float().mean()),
        "actor/entropy_old": float(algos.masked_mean(entropy_old, mask)),
    })
    if prompt_truncated_fraction is not None:  # ppo.prompt_truncation allows cutting
        record["rollout/prompt_truncated_fraction"] = prompt_truncated_fraction
    tokens = int(batch["prompt_mask"].sum() + mask.sum())
    record.update({f"timing_s/{k}": v for k, v in phase_times.items()})
    record.update({f"{PHASE_KEYS[0]}{k}": v for k, v in phase_memory_gb.items()})
    record.update({f"{PHASE_KEYS[1]}{k}": v for k, v in (phase_reserved_gb or {}).items()})
    record.update({f"{HOST_BUSY_KEY}{k}": host_busy(v, phase_times[k])
                   for k, v in (phase_host_cpu_s or {}).items() if phase_times.get(k, 0.0) > 0})
    record["timing_s/step"] = step_s
    record["perf/tokens_per_s"] = tokens / step_s
    if generate_ahead_s:  # the part of this rollout's generation that ran during the previous iteration
        record["timing_s/generate_ahead"] = generate_ahead_s
    record["perf/generated_tokens_per_s"] = float(mask.sum()) / max(phase_times["generate"] + generate_ahead_s, 1e-9)
    record["perf/max_rss_gb"] = max_rss_gb
    record.update(device_report)
    if phase_memory_gb:  # the peak is reset at each phase: this step's is the largest phase's
        record["perf/max_memory_allocated_gb"] = max(record.get("perf/max_memory_allocated_gb", 0.0),
                                                     *phase_memory_gb.values())
    return record

class MetricSink(Protocol):
    def write(self, record: Dict) -> None: ...

    def close(self) -> None: ...


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class JsonlSink:
    """Appends one JSON object per step: the record's names that `keep` accepts, and `step` (all
    names without a `keep`). On resume, records after the checkpoint are dropped so the file
    equals an uninterrupted run's."""

    def __init__(self, path: str | Path, truncate_after_step: int | None = None, keep=None):
        self.path = Path(path)
        self.keep = keep
        if truncate_after_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= truncate_after_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif truncate_after_step is None:
            self.path.write_text("")
        self.file = open(self.path, "a")

    def write(self, record: Dict) -> None:
        kept = {k: _clean(v) for k, v in record.items() if self.keep is None or k == "step" or self.keep(k)}
        self.file.write(json.dumps(kept) + "\n")
        self.file.flush()

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as err:  # a full disk: the write that failed has raised already
            from rlhf.errors import is_disk_full
            if not is_disk_full(err):
                raise


def _shown(value, spec: str) -> str:
    """A number of the live line, or '–' for one not measured yet (never 'nan')."""
    if isinstance(value, (int, float)) and math.isfinite(value):
        return format(value, spec)
    return "–"


class ConsoleProgress:
    """A live line (step, reward, KL, accuracy, ETA): redrawn in place on a terminal, printed
    every `every` steps when the output is a file or pipe."""

    def __init__(self, total_steps: int, start_step: int = 0, stream=None):
        self.total = total_steps
        self.start_step = start_step
        self.start_time = time.time()
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total_steps // 20)
        self.last_acc = None

    def write(self, record: Dict) -> None:
        step = record["step"]
        if "eval/accuracy" in record:
            self.last_acc = record["eval/accuracy"]
        done = step - self.start_step
        elapsed = time.time() - self.start_time
        eta = elapsed / done * (self.total - step) if done > 0 else None
        acc = f" | eval acc {_shown(self.last_acc, '.3f')}" if self.last_acc is not None else ""
        # The initial evaluation's row (step 0) has no reward or KL yet, and no step time to project.
        line = (f"step {step}/{self.total} | reward {_shown(record.get('reward_mean'), '.3f')} | "
                f"KL {_shown(record.get('kl_divergence'), '.4f')}{acc} | ETA {_shown(eta, '5.0f')}s")
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            self.stream.flush()
        elif step % self.every == 0 or step == self.total or "eval/accuracy" in record:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


class MetricLogger:
    def __init__(self, sinks: List[MetricSink]):
        self.sinks = sinks
        self.history: List[Dict] = []

    def log(self, record: Dict) -> None:
        self.history.append(record)
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def run_dir_sinks(out: str | Path, truncate_after_step: int | None = None) -> List[JsonlSink]:
    """The run dir's two files (`PERF_FILE` first: a reader that sees a step in `METRICS_FILE`
    finds its measurements already written)."""
    out = Path(out)
    return [JsonlSink(out / PERF_FILE, truncate_after_step, keep=is_machine_metric),
            JsonlSink(out / METRICS_FILE, truncate_after_step, keep=lambda k: not is_machine_metric(k))]


def _rows(path: Path) -> List[Dict]:
    """A JSONL file's records; a torn last line (a run killed mid-write) is skipped."""
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def read_metrics(path: str | Path) -> List[Dict]:
    """A run's per-step records, `path` being its metrics.jsonl (or its run dir): each joined with
    the same step's machine measurements from the `PERF_FILE` beside it, when there is one."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows = _rows(path)
    perf = {r["step"]: r for r in _rows(path.with_name(PERF_FILE))}
    return [{**perf.get(r["step"], {}), **r} for r in rows] if perf else rows


def last_record(run_dir: str | Path, max_bytes: int = 65536) -> Dict:
    """The last complete record of a run dir, read from the files' ends only (a live view of a
    long run), joined with its step's machine measurements; {} when there is none yet."""
    run_dir = Path(run_dir)
    rows = {}
    for name in (METRICS_FILE, PERF_FILE):
        try:
            with open(run_dir / name, "rb") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - max_bytes))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows[name] = row
                break
    record = rows.get(METRICS_FILE)
    if record is None:
        return {}
    perf = rows.get(PERF_FILE, {})
    return {**perf, **record} if perf.get("step") == record["step"] else record


def window_means(records: List[Dict], window: int) -> Dict[str, float]:
    """Means of every scalar metric over the last `window` records that have it."""
    out: Dict[str, float] = {}
    keys = {k for r in records for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
    for key in sorted(keys):
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))][-window:]
        if values:
            out[key] = float(sum(values) / len(values))
    return out

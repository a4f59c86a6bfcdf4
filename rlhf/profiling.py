"""Where an iteration's time goes: one iteration of a run under torch.profiler, and the summary of
its trace by phase (`python -m rlhf.train ... --profile STEP`; `bench/profile_phases.py` summarises a
trace written elsewhere).

`profiled_iteration` runs one iteration under `torch.profiler` (host activity, and the GPU's where
there is one) with each trainer phase as a named range (`PhaseTimer.annotate`) and the whole as
'iteration', then writes the Chrome trace (`step_N.trace.json.gz`) and its summary (`step_N.json`).
For every phase (the trainer's own names: generate, reference, old_logprobs, values, update_critic,
update_actor, ...) the summary reports, on the one clock the trace shares:

- `wall_s`: the phase's host range;
- `gpu_busy_s`: the union of the GPU's kernel and copy intervals inside that range (two kernels
  running at once count once), and `gpu_idle_s` = wall - busy: the time the GPU had nothing to do;
- `idle_gaps`: the GPU's idle stretches inside the phase by length (< 0.1 ms, 0.1-1 ms, 1-10 ms,
  >= 10 ms): many short gaps are launch overhead, a few long ones the host at work;
- `kernel_s` by kind (matmul, attention, fused = Triton/compiled, copy, other elementwise);
- `host_waits`: the CUDA runtime calls that block the host until the GPU catches up
  (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, cudaMemcpy without
  Async) with their count and total host time, by call and by the operator that made them
  (`by_op`: the outermost CPU op around each on its thread, such as aten::item for a value read
  on the host, aten::to for a copy from pageable memory, aten::nonzero; "(no op)" for a wait
  outside any, such as a library's own event synchronisation), and, for the iteration profiled in
  the run itself, by the code that made them (`sites`, from torch's sync debug mode: see `sync_sites`);
- `top_kernels`: the ten kernels with the most GPU time.

The whole iteration's figures are under `iteration`. Everything is computed from the trace's
events alone, so a trace written on a GPU machine can be summarised anywhere. Only the profiling
process's own work is in the trace: a run whose roles live in Ray actors is profiled in one process
(`ppo.placement = 'local'`).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import functools
import gzip
import json
import math
import re
import shutil
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from rlhf.metrics import HOST_BUSY_KEY, RANK_TIME_KEY, host_busy

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
GAP_EDGES_US = (100.0, 1_000.0, 10_000.0)
GAP_LABELS = ("<0.1ms", "0.1-1ms", "1-10ms", ">=10ms")
KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|mha", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(tn|nt|nn|tt)|matmul|wgmma", re.I)),
    ("fused", re.compile(r"^triton|triton_", re.I)),
)


def kernel_kind(name: str, category: str) -> str:
    if category != "kernel":
        return "copy"
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def union_length(intervals: Iterable[Tuple[float, float]]) -> Tuple[float, List[Tuple[float, float]]]:
    """Total length of the union of [start, end) intervals and the merged intervals, in order."""
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(e - s for s, e in merged), [(s, e) for s, e in merged]


def clip(intervals: Iterable[Tuple[float, float]], lo: float, hi: float) -> List[Tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def gap_histogram(busy: Sequence[Tuple[float, float]], lo: float, hi: float) -> Dict[str, dict]:
    """The idle stretches of [lo, hi) between the merged busy intervals, binned by length (us)."""
    gaps, cursor = [], lo
    for s, e in busy:
        if s > cursor:
            gaps.append(s - cursor)
        cursor = max(cursor, e)
    if hi > cursor:
        gaps.append(hi - cursor)
    out = {label: {"count": 0, "total_s": 0.0} for label in GAP_LABELS}
    for g in gaps:
        i = sum(g >= edge for edge in GAP_EDGES_US)
        out[GAP_LABELS[i]]["count"] += 1
        out[GAP_LABELS[i]]["total_s"] += g / 1e6
    return out


def load_trace(path: str | Path) -> List[dict]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def wait_sites(events: Sequence[dict], waits: Sequence[dict]) -> Dict[str, int]:
    """How many of `waits` each operator made: the outermost `cpu_op` event enclosing a wait on its
    thread (most first)."""
    if not waits:
        return {}
    threads = {(w.get("pid"), w.get("tid")) for w in waits}
    ops = sorted((e for e in events
                  if e.get("cat") == "cpu_op" and e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in threads),
                 key=lambda e: (e["ts"], -e.get("dur", 0)))
    outermost: Dict[tuple, List[Tuple[float, float, str]]] = {}
    for e in ops:  # by start, the longer first: an op inside the previous outermost one is skipped
        spans = outermost.setdefault((e.get("pid"), e.get("tid")), [])
        if not spans or e["ts"] >= spans[-1][1]:
            spans.append((e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "?")))
    counts: Counter = Counter()
    for w in waits:
        spans = outermost.get((w.get("pid"), w.get("tid")), [])
        i = bisect.bisect_right(spans, (w["ts"], math.inf, "")) - 1
        counts[spans[i][2] if i >= 0 and spans[i][1] >= w["ts"] + w.get("dur", 0) else "(no op)"] += 1
    return dict(counts.most_common())


def summarize_window(events: Sequence[dict], lo: float, hi: float) -> dict:
    """The GPU and host-wait figures of the time window [lo, hi) (microseconds)."""
    gpu = [(e["ts"], e["ts"] + e.get("dur", 0), e) for e in events
           if e.get("cat") in GPU_CATEGORIES and e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo]
    busy_us, merged = union_length(clip([(s, t) for s, t, _ in gpu], lo, hi))
    kinds: Dict[str, float] = {}
    kernels: Dict[str, List[float]] = {}
    for s, t, e in gpu:
        d = min(t, hi) - max(s, lo)
        kind = kernel_kind(e.get("name", ""), e.get("cat", ""))
        kinds[kind] = kinds.get(kind, 0.0) + d / 1e6
        entry = kernels.setdefault(e.get("name", "?")[:120], [0, 0.0])
        entry[0] += 1
        entry[1] += d / 1e6
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in HOST_WAITS
             and lo <= e["ts"] < hi]
    wall_us = hi - lo
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:10]
    return {
        "wall_s": wall_us / 1e6,
        "gpu_busy_s": busy_us / 1e6,
        "gpu_idle_s": (wall_us - busy_us) / 1e6,
        "gpu_busy_fraction": busy_us / wall_us if wall_us > 0 else 0.0,
        "gpu_events": len(gpu),
        "kernel_s": {k: round(v, 6) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "idle_gaps": gap_histogram(merged, lo, hi),
        "host_waits": {"count": len(waits), "total_s": sum(e.get("dur", 0) for e in waits) / 1e6,
                       "by_call": {name: sum(1 for e in waits if e["name"] == name)
                                   for name in HOST_WAITS if any(e["name"] == name for e in waits)},
                       "by_op": wait_sites(events, waits)},
        "top_kernels": [{"name": n, "count": c, "s": round(s, 6)} for n, (c, s) in top],
    }


def summarize(events: Sequence[dict], phases: Sequence[str], iteration: str = "iteration") -> dict:
    """Per-phase figures for the ranges named `phases` (user annotations; a name seen several
    times in the trace is summed), and the whole `iteration` range if the trace has one."""
    ranges: Dict[str, List[Tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("ph") == "X" and \
                (e.get("name") in phases or e.get("name") == iteration):
            ranges.setdefault(e["name"], []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    out: Dict[str, dict] = {}
    for name, spans in ranges.items():
        parts = [summarize_window(events, lo, hi) for lo, hi in spans]
        out[name] = parts[0] if len(parts) == 1 else merge_summaries(parts)
    result = {"phases": {n: out[n] for n in phases if n in out}}
    if iteration in out:
        result["iteration"] = out[iteration]
        result["iteration"]["unattributed_s"] = out[iteration]["wall_s"] - sum(
            v["wall_s"] for v in result["phases"].values())
    return result


def merge_summaries(parts: Sequence[dict]) -> dict:
    total: Dict[str, Any] = {k: sum(p[k] for p in parts) for k in ("wall_s", "gpu_busy_s", "gpu_idle_s", "gpu_events")}
    total["gpu_busy_fraction"] = total["gpu_busy_s"] / total["wall_s"] if total["wall_s"] else 0.0
    total["kernel_s"] = {}
    for p in parts:
        for k, v in p["kernel_s"].items():
            total["kernel_s"][k] = total["kernel_s"].get(k, 0.0) + v
    total["idle_gaps"] = {label: {"count": sum(p["idle_gaps"][label]["count"] for p in parts),
                                  "total_s": sum(p["idle_gaps"][label]["total_s"] for p in parts)}
                          for label in GAP_LABELS}
    waits: Dict[str, Any] = {"count": sum(p["host_waits"]["count"] for p in parts),
                             "total_s": sum(p["host_waits"]["total_s"] for p in parts)}
    for key in ("by_call", "by_op"):
        waits[key] = dict(sum((Counter(p["host_waits"].get(key, {})) for p in parts), Counter()).most_common())
    total["host_waits"] = waits
    total["top_kernels"] = parts[0]["top_kernels"]
    return total


def format_table(summary: dict) -> str:
    rows: List[Tuple[str, ...]] = [("phase", "wall s", "GPU busy s", "busy", "idle s", "host waits", "matmul s",
                                    "attn s", "fused s", "other s", "copy s")]
    items = list(summary["phases"].items()) + ([("iteration", summary["iteration"])] if "iteration" in summary else [])
    for name, s in items:
        k = s["kernel_s"]
        rows.append((name, f"{s['wall_s']:.3f}", f"{s['gpu_busy_s']:.3f}", f"{s['gpu_busy_fraction']:.0%}",
                     f"{s['gpu_idle_s']:.3f}", str(s["host_waits"]["count"]),
                     *(f"{k.get(kind, 0.0):.3f}" for kind in ("matmul", "attention", "fused", "other", "copy"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


PHASES = ("generate", "rollout_release", "reward_model", "reward", "reference", "old_logprobs", "values",
          "advantages", "update_critic", "update_actor", "sync_weights")
"""The trainer's phase names (rlhf/trainer.py `train_step`), in the order they run."""


def trace_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step_{step}.trace.json.gz"


def summary_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / f"step_{step}.json"


_phase: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("phase", default=None)


@contextlib.contextmanager
def in_phase(name: str) -> Iterator[None]:
    """The code inside runs as the trainer phase `name` (rlhf/trainer.py `PhaseTimer` opens each): what
    `sync_sites` files this thread's host waits under, and the name a placement sends with each call
    to a rank's process, which measures the phase's memory there (rlhf/placement/proxy.py `ray_proxy`)."""
    token = _phase.set(name)
    try:
        yield
    finally:
        _phase.reset(token)


@contextlib.contextmanager
def phase_range(name: str) -> Iterator[None]:
    """A trainer phase while one iteration is profiled: `in_phase`, and a named range of torch.profiler."""
    from torch.profiler import record_function
    with in_phase(name), record_function(name):
        yield


class PhaseClock:
    """The wall time and the host CPU time (`time.thread_time`: of the thread that ran it) of each
    phase, summed over the code measured under its name: the trainer's phases in its own process
    (rlhf/trainer.py `PhaseTimer`) and, on Ray, the calls each rank's host runs under a phase's name
    (rlhf/placement/host.py), so a step shows how long a phase kept its ranks busy beside how long the
    controller waited for it (the difference: Ray's transfers and scheduling between the processes)."""

    def __init__(self):
        self.times: Dict[str, float] = {}
        self.host_cpu: Dict[str, float] = {}

    @contextlib.contextmanager
    def measure(self, name: Optional[str]) -> Iterator[None]:
        """Times the code inside as the phase `name` (None: not timed)."""
        if name is None:
            yield
            return
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
            self.host_cpu[name] = self.host_cpu.get(name, 0.0) + time.thread_time() - start_cpu

    def take(self) -> Dict[str, float]:
        """The phases timed since the last call as step-record keys, and forgets them:
        `perf/rank_s/<phase>` (wall seconds) and `perf/host_busy/<phase>` (CPU over wall, 0-1)."""
        out = {f"{RANK_TIME_KEY}{k}": v for k, v in self.times.items()}
        out.update({f"{HOST_BUSY_KEY}{k}": host_busy(self.host_cpu[k], v) for k, v in self.times.items() if v > 0})
        self.times, self.host_cpu = {}, {}
        return out


def open_phase() -> Optional[str]:
    """The innermost phase open in this thread's context (`in_phase`), or None."""
    return _phase.get()


def current_phase() -> str:
    """The innermost phase open in this thread's context (`in_phase`), else "(no phase)"."""
    return open_phase() or "(no phase)"


SYNC_WARNING = "called a synchronizing CUDA operation"
"""What torch's sync debug mode ('warn') says at every call that makes the host wait for the GPU."""

PACKAGE_DIR = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def source_file(filename: str) -> tuple[str, bool]:
    """(a file's name from its package down: after site-packages/, or from the engine's checkout;
    whether it is the engine's own). Cached: every host wait's stack is read through it."""
    path = Path(filename).resolve()
    if path.is_relative_to(PACKAGE_DIR.parent):
        return path.relative_to(PACKAGE_DIR.parent).as_posix(), path.is_relative_to(PACKAGE_DIR)
    parts = path.parts
    return "/".join(parts[parts.index("site-packages") + 1:] if "site-packages" in parts else parts[-2:]), False


def frame_name(frame: traceback.FrameSummary) -> str:
    """'rlhf/roles/forward.py:127 response_logprobs': a frame's file (`source_file`), line and function."""
    return f"{source_file(frame.filename)[0]}:{frame.lineno} {frame.name}"


def sync_site(stack: Sequence[traceback.FrameSummary]) -> str:
    """Where a host wait came from, given the Python stack at the synchronising call (outermost
    first): the innermost frame of the engine's own code, then, if the call itself was elsewhere (a
    library's), the innermost frame: 'rlhf/roles/forward.py:127 response_logprobs <-
    transformers/masking_utils.py:761 find_packed_sequence_indices'."""
    if not stack:
        return "(no Python frame)"
    inner = stack[-1]
    own = next((f for f in reversed(stack) if source_file(f.filename)[1]), None)
    if own is None or own is inner:
        return frame_name(inner)
    return f"{frame_name(own)} <- {frame_name(inner)}"


@contextlib.contextmanager
def sync_sites() -> Iterator[Dict[str, Counter]]:
    """Counts, by phase (`current_phase`) and site (`sync_site`), the calls inside the block that
    make the host wait for the GPU: a value read on the host (item, bool, tolist), a copy to or from
    pageable memory, nonzero and boolean selection. torch's sync debug mode reports each one as a
    warning ('warn'), which is counted here instead of shown; any other warning goes on as before.
    Without CUDA there is nothing to report and the counts stay empty. Waits inside libraries that
    synchronise in native code (vLLM's event waits) are not torch calls: the trace's `by_call`
    counts those."""
    counts: Dict[str, Counter] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=SYNC_WARNING)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                stack = traceback.extract_stack()[:-1]  # without this handler
                while stack and Path(stack[-1].filename).name == "warnings.py":
                    stack.pop()
                counts.setdefault(current_phase(), Counter())[sync_site(stack)] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        import torch
        cuda = torch.cuda.is_available()
        before = torch.cuda.get_sync_debug_mode() if cuda else 0
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(before)


def add_sync_sites(summary: dict, counts: Dict[str, Counter]) -> None:
    """Puts `sync_sites`' counts into a summary: each phase's under its `host_waits.sites`, and all of
    them (waits outside any phase included) under the iteration's."""
    for name, phase in summary["phases"].items():
        phase["host_waits"]["sites"] = dict(counts.get(name, Counter()).most_common())
    if "iteration" in summary:
        total = sum(counts.values(), Counter())
        summary["iteration"]["host_waits"]["sites"] = dict(total.most_common())


def format_sites(summary: dict, top: int = 5) -> str:
    """The most frequent sites of each phase's host waits, one line each ('' if none was recorded)."""
    lines = []
    for name, phase in summary["phases"].items():
        for site, count in list(phase["host_waits"].get("sites", {}).items())[:top]:
            lines.append(f"  {name}: {count} x {site}")
    return ("host waits by site:\n" + "\n".join(lines)) if lines else ""


@contextlib.contextmanager
def profiled_iteration(out_dir: Path, step: int, log: Callable[[str], None] = print) -> Iterator[dict]:
    """Profiles what runs inside the block as the iteration `step`. The block puts the step's record
    in the yielded dict under "record" (its `timing_s/<phase>` keys name the phases to summarise);
    on leaving, the trace and the summary are written under `out_dir` and the summary is added to
    the dict under "summary", and its table is logged."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    holder: dict = {}
    with profile(activities=activities) as prof, sync_sites() as sites:
        with record_function("iteration"):
            yield holder
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    raw = out_dir / f"step_{step}.trace.json"
    prof.export_chrome_trace(str(raw))
    record = holder.get("record", {})
    phases = [k.split("/", 1)[1] for k in record if k.startswith("timing_s/") and k != "timing_s/step"] or list(PHASES)
    summary = summarize(load_trace(raw), phases)
    add_sync_sites(summary, sites)
    summary["step"] = step
    with open(raw, "rb") as src, gzip.open(trace_path(out_dir, step), "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    summary_path(out_dir, step).write_text(json.dumps(summary, indent=1))
    holder["summary"] = summary
    sites_text = format_sites(summary)
    log(f"profile of step {step} (trace {trace_path(out_dir, step)}):\n{format_table(summary)}"
        + (f"\n{sites_text}" if sites_text else ""))

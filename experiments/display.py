"""The live view of a running study: runs done / running / failed, ETA, each run's latest reward.

Reads only run dirs (the last line of each metrics.jsonl), so it shows the same thing whoever
wrote them. On a terminal it redraws a rich table; elsewhere (CI, pipes) it prints one line
per change of a run's state, which keeps logs readable.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from experiments.plan import RunSpec
from experiments.results import RunStatus
from experiments.run_records import scalar, tail_metrics

QUEUED, RETRYING, DONE = "queued", "retrying", "done"
"""A run's status in the view besides its RunStatus (running, failed, interrupted): waiting for
its resources, submitted again after a crash, completed in this launch."""
DONE_BEFORE = "already done"  # finished by an earlier invocation (same hash): not run again
FINISHED = (DONE, RunStatus.FAILED, DONE_BEFORE)
STYLES = {DONE: "green", DONE_BEFORE: "green", RunStatus.RUNNING: "yellow", QUEUED: "dim",
          RunStatus.FAILED: "red", RETRYING: "magenta", RunStatus.INTERRUPTED: "magenta"}


def _fmt_seconds(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class StudyDisplay:
    """Tracks per-run status set by the scheduler and renders it with live metrics."""

    def __init__(self, study_name: str, specs: List[RunSpec], console: Optional[Console] = None):
        self.study_name = study_name
        self.specs = {s.key: s for s in specs}
        self.status: Dict[str, str] = {s.key: QUEUED for s in specs}
        self.note: Dict[str, str] = {}
        self.started: Dict[str, float] = {}
        self.finished: Dict[str, float] = {}
        self.console = console or Console(stderr=True)
        self.live: Optional[Live] = None
        self.t0 = time.monotonic()
        self.first_step: Dict[str, int] = {}

    def __enter__(self) -> "StudyDisplay":
        if self.console.is_terminal:
            self.live = Live(self.render(), console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.update(self.render())
            self.live.__exit__(*exc)

    def set(self, key: str, status: str, note: str = "") -> None:
        if status == RunStatus.RUNNING and key not in self.started:
            self.started[key] = time.monotonic()
        if status in FINISHED:
            self.finished[key] = time.monotonic()
        changed = self.status.get(key) != status
        self.status[key] = status
        if note:
            self.note[key] = note
        if changed and self.live is None:
            row = tail_metrics(self.specs[key].run_dir)
            reward = scalar(row.get("reward_mean"))
            extra = f" reward_mean={reward:.3f}" if reward is not None else ""
            self.console.print(f"[{self.study_name}] {key}: {status}{extra}{(' - ' + note) if note else ''} "
                               f"({self.counts_line()})", highlight=False, markup=False, soft_wrap=True)

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.render())

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for status in self.status.values():
            out[status] = out.get(status, 0) + 1
        return out

    def counts_line(self) -> str:
        c = self.counts()
        done = c.get(DONE, 0) + c.get(DONE_BEFORE, 0)
        return (f"{done}/{len(self.status)} done, {c.get(RunStatus.RUNNING, 0)} running, "
                f"{c.get(RunStatus.FAILED, 0)} failed, {c.get(QUEUED, 0) + c.get(RETRYING, 0)} queued, "
                f"ETA {_fmt_seconds(self.eta())}")

    def _progress(self, key: str) -> tuple[int, int]:
        row = tail_metrics(self.specs[key].run_dir)
        step = int(row["step"]) + 1 if "step" in row else 0
        return step, self.specs[key].total_steps

    def eta(self) -> Optional[float]:
        """Remaining steps x observed seconds per step / runs in parallel; None before any data."""
        rates, remaining, running = [], 0, 0
        for key, status in self.status.items():
            step, total = self._progress(key)
            if status in FINISHED:
                if key in self.started and key in self.finished:
                    done_steps = max(1, total - self.first_step.get(key, 0))
                    rates.append((self.finished[key] - self.started[key]) / done_steps)
                continue
            remaining += max(0, total - step)
            if status == RunStatus.RUNNING:
                running += 1
                self.first_step.setdefault(key, step)
                progressed = step - self.first_step[key]
                if progressed > 0:
                    rates.append((time.monotonic() - self.started[key]) / progressed)
        if remaining == 0:
            return 0.0
        if not rates:
            return None
        # Slots: the most runs seen in parallel (a moment between one run's end and the next
        # one's start must not double the estimate).
        self.slots = max(getattr(self, "slots", 1), running)
        return remaining * (sum(rates) / len(rates)) / self.slots

    def render(self) -> Group:
        table = Table(title=f"study {self.study_name}", expand=False)
        for col in ("run", "status", "step", "reward_mean", "kl_divergence", "elapsed", "note"):
            table.add_column(col)
        for key, status in self.status.items():
            row = tail_metrics(self.specs[key].run_dir)
            step, total = self._progress(key)
            reward, kl = scalar(row.get("reward_mean")), scalar(row.get("kl_divergence"))
            elapsed = None
            if key in self.started:
                elapsed = self.finished.get(key, time.monotonic()) - self.started[key]
            table.add_row(key, Text(status, style=STYLES.get(status, "")), f"{step}/{total}",
                          f"{reward:.3f}" if reward is not None else "-", f"{kl:.4f}" if kl is not None else "-",
                          _fmt_seconds(elapsed) if elapsed is not None else "-", self.note.get(key, "")[:60])
        return Group(table, Text(self.counts_line()))

"""W&B as a sink of the experiment manager (the engine never imports wandb).

One W&B run per (variant, seed): project from the study, group `study/variant`, job_type the
parameter change, config the flat operative config plus seed and provenance, history the
per-step metrics streamed from the run's `metrics.jsonl`, summary the final metrics. The W&B run
id comes from the run's content hash, and the last step sent is kept in the run dir
(`wandb.json`), so a resumed run continues the same W&B run without repeating steps.

Mode: `WANDB_MODE` wins (`offline`, `online`, `disabled`); otherwise online when an API key is
configured, else offline. `WANDB_DIR` is honoured; without it, files go under the study's
results directory. Any W&B failure is reported once and then ignored: it never kills a run.
"""

from __future__ import annotations

import json
import netrc
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from experiments.results import StudyAggregate, aggregate_path
from rlhf.atomic import write_json
from rlhf.metrics import METRICS_FILE, PERF_SUMMARY, read_metrics

STATE_FILE = "wandb.json"


def wandb_mode() -> str:
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "online", "disabled", "dryrun", "run"):
        return {"dryrun": "offline", "run": "online"}.get(mode, mode)
    return "online" if logged_in() else "offline"


def logged_in() -> bool:
    """An API key is configured: WANDB_API_KEY, or a W&B host in ~/.netrc (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return any("wandb" in host for host in netrc.netrc().hosts)
    except (OSError, netrc.NetrcParseError):
        return False


def files_root(directory: Optional[str]) -> Optional[str]:
    """Where W&B writes its run files (under `<root>/wandb/`): WANDB_DIR when set, else `directory`."""
    return os.environ.get("WANDB_DIR") or directory


def _warn(message: str) -> None:
    print(f"warning: W&B: {message} (continuing without it)", file=sys.stderr)


def _flat(prefix: str, value, out: Dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def to_wandb_record(record: Dict) -> Dict:
    """A metrics.jsonl record as W&B values: the ratio histogram becomes a wandb.Histogram."""
    import wandb

    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict) and {"bin_edges", "counts"} <= set(value):
            out[key] = wandb.Histogram(np_histogram=(value["counts"], value["bin_edges"]))
        elif isinstance(value, (int, float)) or value is None:
            out[key] = value
    return out


class WandbRun:
    """One W&B run fed from a run directory's files."""

    def __init__(self, *, project: str, group: str, job_type: str, name: str, run_id: str, config: Dict,
                 directory: Optional[str], tags: Iterable[str] = ()):
        self.run = None
        self.mode = wandb_mode()
        if self.mode == "disabled":
            return
        try:
            import wandb

            if directory:
                Path(directory).mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(project=project, group=group, job_type=job_type, name=name, id=run_id,
                                  config=config, dir=files_root(directory), mode=self.mode,
                                  resume="allow", tags=list(tags), reinit="create_new",
                                  settings=wandb.Settings(silent=True, console="off"))
        except Exception as err:  # noqa: BLE001 - W&B must never take a run down
            _warn(f"init failed: {err}")
            self.run = None

    @property
    def active(self) -> bool:
        return self.run is not None

    def log(self, payload: Dict, step: Optional[int] = None) -> None:
        if self.run is None:
            return
        try:
            self.run.log(payload, step=step)
        except Exception as err:  # noqa: BLE001
            _warn(f"log failed: {err}")
            self.run = None

    def update_config(self, values: Dict) -> None:
        if self.run is None:
            return
        try:
            self.run.config.update(values, allow_val_change=True)
        except Exception as err:  # noqa: BLE001
            _warn(f"config update failed: {err}")

    def set_summary(self, values: Dict) -> None:
        if self.run is None:
            return
        try:
            for k, v in values.items():
                self.run.summary[k] = v
        except Exception as err:  # noqa: BLE001
            _warn(f"summary failed: {err}")

    def finish(self, exit_code: int = 0) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as err:  # noqa: BLE001
            _warn(f"finish failed: {err}")
        self.run = None


class RunDirStreamer:
    """Tails a run dir's metrics.jsonl into a WandbRun, remembering the last step sent."""

    def __init__(self, run_dir: str | Path, wandb_run: WandbRun):
        self.run_dir = Path(run_dir)
        self.wandb_run = wandb_run
        state = self._read_state()
        self.last_step = state.get("last_step", -1) if state.get("run_id") == self._run_id() else -1
        self.provenance_sent = False

    def _run_id(self) -> Optional[str]:
        run = self.wandb_run.run
        return getattr(run, "id", None)

    def _read_state(self) -> Dict:
        try:
            return json.loads((self.run_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def poll(self) -> int:
        """Sends records newer than the last step sent; returns how many were sent."""
        if not self.wandb_run.active:
            return 0
        if not self.provenance_sent and (self.run_dir / "provenance.json").exists():
            # The engine writes provenance.json once it has resolved its inputs, after this W&B
            # run was opened: send it as config when it appears.
            prov = provenance_config(self.run_dir)
            if prov.get("data_sha256"):
                self.wandb_run.update_config({f"provenance.{k}": v for k, v in prov.items()})
                self.provenance_sent = True
        if not (self.run_dir / METRICS_FILE).exists():
            return 0
        sent = 0
        # Each step with its machine measurements (perf.jsonl, written before the step's metrics).
        for record in read_metrics(self.run_dir):
            if record.get("step", -1) <= self.last_step:
                continue
            self.wandb_run.log(to_wandb_record(record), step=int(record["step"]))
            self.last_step = int(record["step"])
            sent += 1
        if sent:
            try:
                write_json(self.run_dir / STATE_FILE, {"run_id": self._run_id(), "last_step": self.last_step})
            except OSError as err:  # e.g. a full disk: the run goes on; a resume may resend these steps
                _warn(f"cannot record the last step sent ({err})")
        return sent

    def close(self, exit_code: int) -> None:
        self.poll()
        summary_path = self.run_dir / "summary.json"
        if summary_path.exists():
            try:
                summary = json.loads(summary_path.read_text())
            except ValueError:
                summary = {}
            flat: Dict = {}
            for part in ("final", "final_window"):
                _flat(part, summary.get(part, {}), flat)
            try:  # the machine's measurements over the same window (rlhf/metrics.py)
                perf = json.loads((self.run_dir / PERF_SUMMARY).read_text())
            except (OSError, ValueError):
                perf = {}
            _flat("final_window", perf.get("final_window", {}), flat)
            if "wall_time_s" in perf:
                flat["wall_time_s"] = perf["wall_time_s"]
            flat["status"] = summary.get("status")
            self.wandb_run.set_summary(flat)
        self.wandb_run.finish(exit_code=exit_code)


def provenance_config(run_dir: str | Path) -> Dict:
    """The provenance fields worth filtering on in W&B (no diffs)."""
    try:
        prov = json.loads((Path(run_dir) / "provenance.json").read_text())
    except (OSError, ValueError):
        return {}
    git = prov.get("git", {})
    return {"git_sha": git.get("sha"), "git_dirty": git.get("dirty"), "data_sha256": prov.get("data_sha256"),
            "start_checkpoint_sha256": prov.get("start_checkpoint_sha256"),
            **{f"version.{k}": v for k, v in prov.get("versions", {}).items()},
            "hostname": prov.get("hardware", {}).get("hostname")}


def job_type_for(changes: Dict) -> str:
    """The parameter change as W&B's job_type: 'baseline' or 'ppo.kl_coef=0.1[,+...]'."""
    if not changes:
        return "baseline"
    text = ",".join(f"{k}={v}" for k, v in sorted(changes.items()))
    return text[:64]


def run_for_spec(spec: Dict, flat_config: Dict, directory: Optional[str], project: str) -> WandbRun:
    config = {**flat_config, "seed": spec["seed"], "variant": spec["variant"], "study": spec["study"],
              "run_hash": spec["run_hash"], **{f"provenance.{k}": v for k, v in provenance_config(spec["run_dir"]).items()}}
    return WandbRun(project=project, group=f"{spec['study']}/{spec['variant']}", job_type=job_type_for(spec["changes"]),
                    name=f"{spec['variant']}-seed{spec['seed']}", run_id=f"{spec['study']}-{spec['run_hash'][:12]}",
                    config=config, directory=directory, tags=[spec["study"], spec["variant"]])


def log_study_aggregate(*, project: str, study: str, study_hash: str, columns: List[str], rows: List[List],
                        summary: Dict, images: Iterable[Path], directory: Optional[str]) -> None:
    """One aggregate run per study: the per-variant statistics table, verdicts and plots."""
    run = WandbRun(project=project, group=study, job_type="aggregate", name=f"{study}-aggregate",
                   run_id=f"{study}-aggregate-{study_hash[:12]}", config={"study": study}, directory=directory,
                   tags=[study, "aggregate"])
    if not run.active:
        return
    try:
        import wandb

        payload = {"variants": wandb.Table(columns=columns, data=rows)}
        for image in images:
            payload[f"plots/{Path(image).stem}"] = wandb.Image(str(image))
        run.log(payload)
        run.set_summary(summary)
    except Exception as err:  # noqa: BLE001
        _warn(f"aggregate failed: {err}")
    run.finish()


AGGREGATE_COLUMNS = ["variant", "change", "n", "mean", "std", "se", "ci95_low", "ci95_high", "difference",
                     "difference_ci95_low", "difference_ci95_high", "analysis", "p_value_holm", "hedges_g",
                     "prob_improvement", "verdict", "underpowered", "fragile", "guardrails_ok"]
"""The difference's interval and the Holm p are the deciding analysis's (`analysis`)."""


def aggregate_rows(aggregate: StudyAggregate) -> List[List]:
    """One table row per variant."""
    rows = []
    for name, v in aggregate.variants.items():
        s, c = v.summary, v.comparison
        own = c.decisive if c else None
        rows.append([name, "; ".join(v.bindings) or "baseline", s.n, s.mean, s.std, s.se, s.ci95[0], s.ci95[1],
                     c.difference if c else None, own.difference_ci95[0] if c else None,
                     own.difference_ci95[1] if c else None, c.analysis if c else None,
                     c.p_value_holm if c else None, c.hedges_g if c else None,
                     c.prob_improvement if c else None, v.verdict if c else "reference", v.underpowered,
                     v.fragile, v.guardrails_ok])
    return rows


def log_aggregate_dir(study_dir: str | Path, project: str, run_hashes: Iterable[str]) -> None:
    """Sends a finished study's aggregate.json and plots as its W&B aggregate run."""
    import hashlib

    study_dir = Path(study_dir)
    aggregate = StudyAggregate.load(aggregate_path(study_dir))
    study_hash = hashlib.sha256("".join(sorted(run_hashes)).encode()).hexdigest()
    summary = {f"{name}.mean": v.summary.mean for name, v in aggregate.variants.items()}
    summary.update({f"{name}.verdict": v.verdict for name, v in aggregate.variants.items() if v.comparison})
    summary["chosen"] = aggregate.decision.chosen
    log_study_aggregate(project=project, study=aggregate.study, study_hash=study_hash, columns=AGGREGATE_COLUMNS,
                        rows=aggregate_rows(aggregate), summary=summary,
                        images=sorted((study_dir / "plots").glob("*.png")),
                        directory=str(study_dir.parent / "wandb"))

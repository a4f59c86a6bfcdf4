"""W&B as a sink of the experiment manager (the engine never imports wandb).

Project: one per tuning campaign (`project_for`): the study's `study.wandb_project`, else
WANDB_PROJECT, else `study.campaign`, else the study's name. Within it, one W&B run per run
configuration, i.e. per run hash (experiments/plan.py: config, seed, code, data, start): group
`study/variant`, job_type the parameter change, tags study and variant, config the operative
config nested by gin scope (`{'ppo': {'kl_coef': ...}}`, the form W&B's panels address as
`ppo.kl_coef`) plus seed, variant, study, `run_hash`, `revision` (the DVC experiment and git commit
that made it) and provenance, history the per-step metrics streamed from the run's
`metrics.jsonl`, summary the final metrics. The W&B run id is `<study>-<run hash>`: another
configuration (`dvc exp run -S ...`) is another W&B run, the same one is the same run.

A resumed run keeps its id. Online, W&B continues it from the last step sent (kept in the run dir,
`wandb.json`). Offline, W&B would write a second folder with the same id, which `wandb sync`
uploads in place of the first rather than after it; so the new attempt replaces the id's earlier
folder and sends the whole history again from `metrics.jsonl` (`replace_offline_folders`): one
folder per id, each complete.

One aggregate run per version of a study's aggregate (group `study`, job_type `aggregate`, id
`<study>-aggregate-<content hash>`): the per-variant table, the same statistics in its summary,
the plots, and aggregate.json with the report as a W&B Artifact `<study>-aggregate` (type
`aggregate`), whose versions are the aggregate's. What was last logged is recorded under the W&B
files (`aggregate_state_path`), so a rerun that changes nothing logs nothing.

Mode: `WANDB_MODE` wins (`offline`, `online`, `disabled`); otherwise online when an API key is
configured, else offline. `WANDB_DIR` is honoured; without it, files go under the results
directory (`files_dir`). Any W&B failure is reported once and then ignored: it never kills a run.
"""

from __future__ import annotations

import hashlib
import json
import netrc
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Literal, Optional, cast

from experiments.errors import StudyError
from experiments.plan import git_commit
from experiments.results import StudyAggregate, aggregate_path
from experiments.study import Study, wandb_project_problem
from rlhf.atomic import write_json
from rlhf.configurable import nested_dict
from rlhf.metrics import METRICS_FILE, PERF_SUMMARY, read_metrics

STATE_FILE = "wandb.json"


WandbMode = Literal["online", "offline", "disabled"]
"""The modes `wandb_mode` answers, as `wandb.init(mode=...)` takes them."""


def wandb_mode() -> WandbMode:
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "online", "disabled", "dryrun", "run"):
        return cast(WandbMode, {"dryrun": "offline", "run": "online"}.get(mode, mode))
    return "online" if logged_in() else "offline"


def logged_in() -> bool:
    """An API key is configured: WANDB_API_KEY, or a W&B host in ~/.netrc (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return any("wandb" in host for host in netrc.netrc().hosts)
    except (OSError, netrc.NetrcParseError):
        return False


def project_for(study: Study) -> str:
    """The W&B project of a study's runs, its aggregate run and its Report; the one place that
    decides it: `study.wandb_project` (the study's own choice), else the WANDB_PROJECT environment
    variable, else `study.campaign` (the rounds of a tuning campaign share one project), else the
    study's name. Raises StudyError when WANDB_PROJECT is no W&B project name."""
    from_env = os.environ.get("WANDB_PROJECT", "").strip()
    problem = wandb_project_problem(from_env)
    if problem and not study.wandb_project:
        raise StudyError(f"WANDB_PROJECT = {from_env!r} is invalid: it names a W&B project, which {problem}")
    return study.wandb_project or from_env or study.campaign or study.name


def files_root(directory: Optional[str]) -> Optional[str]:
    """Where W&B writes its run files (under `<root>/wandb/`): WANDB_DIR when set, else `directory`."""
    return os.environ.get("WANDB_DIR") or directory


def files_dir(results_dir: str | Path) -> str:
    """The directory of a results dir's W&B files (`files_root` of it): `<results>/wandb`. A DVC
    experiment run in a temporary copy of the repository (`dvc exp run --temp`, queued ones: DVC
    makes it inside the repository's own `.dvc/`) would lose them with the copy: there, the same
    path in the repository the experiment was started from (DVC_ROOT, which DVC sets to it for
    every experiment), so they outlive the copy."""
    wandb_dir = Path(results_dir).resolve() / "wandb"
    dvc_root = os.environ.get("DVC_ROOT")
    if not dvc_root:
        return str(wandb_dir)
    from dvc.repo import Repo  # DVC runs this command, so it is installed

    start = next(p for p in wandb_dir.parents if p.is_dir())  # the results dir may not exist yet
    try:
        copy = Path(Repo.find_root(str(start))).resolve()
    except Exception:  # noqa: BLE001 - results outside any DVC repository stay where they are
        return str(wandb_dir)
    origin = Path(dvc_root).resolve()
    if copy == origin or not copy.is_relative_to(origin):  # the workspace itself, or another repository
        return str(wandb_dir)
    return str(origin / wandb_dir.relative_to(copy))


def revision() -> Dict[str, Optional[str]]:
    """What made this launch's runs: the DVC experiment (`dvc exp run` sets DVC_EXP_NAME, in the
    workspace, a temporary copy or the queue) and the git commit, the experiment's baseline
    (DVC_EXP_BASELINE_REV) or HEAD; None where there is none."""
    return {"dvc_experiment": os.environ.get("DVC_EXP_NAME") or None,
            "git_commit": os.environ.get("DVC_EXP_BASELINE_REV") or git_commit()}


_OFFLINE_FOLDER = re.compile(r"offline-run-\d{8}_\d{6}-(.+)")
"""An offline run's folder, as W&B names it: `offline-run-<date>_<time>-<run id>`."""


def offline_folders(root: str | Path, run_id: str) -> List[Path]:
    """The offline folders of run `run_id` under a W&B files root (`<root>/wandb/`)."""
    found = (_OFFLINE_FOLDER.fullmatch(p.name) for p in (Path(root) / "wandb").glob("offline-run-*"))
    return sorted(Path(root) / "wandb" / m.group(0) for m in found if m and m.group(1) == run_id)


def replace_offline_folders(root: str | Path, run_id: str) -> int:
    """Removes run `run_id`'s offline folders before it is written again from the start: `wandb
    sync` uploads a second folder of an id in place of the first, not after it. Returns how many."""
    folders = offline_folders(root, run_id)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return len(folders)


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
            root = files_root(directory)
            if self.mode == "offline" and root:
                replace_offline_folders(root, run_id)
            self.run = wandb.init(project=project, group=group, job_type=job_type, name=name, id=run_id,
                                  config=config, dir=root, mode=self.mode,
                                  resume="allow", tags=list(tags), reinit="create_new",
                                  settings=wandb.Settings(silent=True, console="off"))
        except Exception as err:  # noqa: BLE001 - W&B must never take a run down
            _warn(f"init failed: {err}")
            self.run = None

    @property
    def active(self) -> bool:
        return self.run is not None

    @property
    def continues(self) -> bool:
        """Whether it continues what was sent before under its id (online), rather than being
        written anew from the start (offline: `replace_offline_folders`)."""
        return self.mode == "online"

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
        continues = wandb_run.continues and state.get("run_id") == self._run_id()
        self.last_step = state.get("last_step", -1) if continues else -1
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
                self.wandb_run.update_config({"provenance": prov})
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
            "start_checkpoint_sha256": prov.get("start_checkpoint_sha256"), "versions": prov.get("versions", {}),
            "hostname": prov.get("hardware", {}).get("hostname")}


def job_type_for(changes: Dict) -> str:
    """The parameter change as W&B's job_type: 'baseline' or 'ppo.kl_coef=0.1[,+...]'."""
    if not changes:
        return "baseline"
    text = ",".join(f"{k}={v}" for k, v in sorted(changes.items()))
    return text[:64]


def run_id_for(spec: Dict) -> str:
    """A run's W&B id: its study and run hash, so one W&B run per configuration."""
    return f"{spec['study']}-{spec['run_hash'][:12]}"


def run_for_spec(spec: Dict, flat_config: Dict, directory: Optional[str], project: str,
                 made_by: Optional[Dict] = None) -> WandbRun:
    """The W&B run of a run spec; `made_by` is the launch's `revision()`."""
    config = {**nested_dict(flat_config), "seed": spec["seed"], "variant": spec["variant"], "study": spec["study"],
              "run_hash": spec["run_hash"], "revision": made_by or revision(),
              "provenance": provenance_config(spec["run_dir"])}
    return WandbRun(project=project, group=f"{spec['study']}/{spec['variant']}", job_type=job_type_for(spec["changes"]),
                    name=f"{spec['variant']}-seed{spec['seed']}", run_id=run_id_for(spec),
                    config=config, directory=directory, tags=[spec["study"], spec["variant"]])


AGGREGATE_COLUMNS = ["variant", "change", "n", "mean", "std", "se", "ci95_low", "ci95_high", "difference",
                     "difference_ci95_low", "difference_ci95_high", "analysis", "p_value_holm", "hedges_g",
                     "prob_improvement", "verdict", "underpowered", "guardrails_ok"]
"""The difference's interval and the Holm p are the deciding analysis's (`analysis`)."""
AGGREGATE_TABLE = "variants"
"""The aggregate run's table of AGGREGATE_COLUMNS, one row per variant (the Report shows it)."""
AGGREGATE_JOB_TYPE = "aggregate"


def aggregate_rows(aggregate: StudyAggregate) -> List[List]:
    """One table row per variant."""
    rows = []
    for name, v in aggregate.variants.items():
        s, c = v.summary, v.comparison
        own = c.decisive if c else None
        rows.append([name, "; ".join(v.bindings) or "baseline", s.n, s.mean, s.std, s.se, s.ci95[0], s.ci95[1],
                     c.difference if c else None, own.difference_ci95[0] if own else None,
                     own.difference_ci95[1] if own else None, c.analysis if c else None,
                     c.p_value_holm if c else None, c.hedges_g if c else None, c.prob_improvement if c else None,
                     v.verdict if c else "reference", v.underpowered, v.guardrails_ok])
    return rows


def decision_key(aggregate: StudyAggregate) -> str:
    """The decision metric's key in each run's W&B summary: summary.json's part and the metric, as
    `RunDirStreamer.close` flattens them (`final.eval/accuracy`)."""
    return f"{aggregate.metric_from}.{aggregate.metric}"


def aggregate_summary(aggregate: StudyAggregate, rows: List[List]) -> Dict:
    """The table's values as the aggregate run's summary, `<variant>.<column>` (`baseline.std`,
    `good.ci95_low`, ...), with the decision (`chosen`) and the metric it was taken on."""
    summary = {f"{row[0]}.{column}": value for row in rows for column, value in zip(AGGREGATE_COLUMNS[1:], row[1:])}
    summary.update(chosen=aggregate.decision.chosen, metric=decision_key(aggregate))
    return summary


AGGREGATE_ARTIFACT_TYPE = "aggregate"


def aggregate_artifact_name(study: str) -> str:
    """The W&B Artifact of a study's aggregate: one name per study, a version per aggregate."""
    return f"{study}-aggregate"


def aggregate_sha256(study_dir: str | Path) -> str:
    """The aggregate's identity as its runs and the Report record it (`aggregate_sha256` in the
    aggregate run's config): the hash of the study's aggregate.json."""
    return hashlib.sha256(aggregate_path(study_dir).read_bytes()).hexdigest()


def aggregate_state_path(directory: str | Path, project: str, study: str) -> Path:
    """What a study's aggregate run last logged (its content hash, run id and mode), kept with the
    W&B run files (under WANDB_DIR when set), not in the study's results: it records what those files hold."""
    return Path(cast(str, files_root(str(directory)))) / "wandb" / "aggregates" / project / f"{study}.json"


def log_aggregate_dir(study_dir: str | Path, project: str, run_hashes: Iterable[str],
                      files: Iterable[str | Path] = ()) -> bool:
    """Sends a finished study's aggregate.json, plots and `files` (the report) as a W&B aggregate
    run beside its runs' (`files_dir` of the results), with aggregate.json and `files`
    as a version of the study's aggregate Artifact, unless this very content was the last sent in
    this mode (a rerun that changed nothing): then it opens no W&B run and writes no file. Each
    content is its own run (its id from the content hash). Returns whether it logged."""
    study_dir = Path(study_dir)
    aggregate = StudyAggregate.load(aggregate_path(study_dir))
    rows = aggregate_rows(aggregate)
    summary = aggregate_summary(aggregate, rows)
    images = sorted((study_dir / "plots").glob("*.png"))
    files = [aggregate_path(study_dir), *(Path(f) for f in files if Path(f).is_file())]
    config = {"study": aggregate.study, "aggregate_sha256": aggregate_sha256(study_dir),
              "runs_sha256": hashlib.sha256("".join(sorted(run_hashes)).encode()).hexdigest()}
    mode = wandb_mode()
    content = hashlib.sha256(json.dumps(
        {"project": project, "config": config, "columns": AGGREGATE_COLUMNS, "rows": rows, "summary": summary,
         "images": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in images},
         "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}},
        sort_keys=True, default=str).encode()).hexdigest()
    directory = files_dir(study_dir.parent)
    state_path = aggregate_state_path(directory, project, aggregate.study)
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        state = {}
    if state.get("content_sha256") == content and state.get("mode") == mode:
        return False
    run_id = f"{aggregate_artifact_name(aggregate.study)}-{content[:12]}"
    run = WandbRun(project=project, group=aggregate.study, job_type=AGGREGATE_JOB_TYPE,
                   name=f"{aggregate.study}-aggregate", run_id=run_id, config={**config, "revision": revision()},
                   directory=directory, tags=[aggregate.study, AGGREGATE_JOB_TYPE])
    if not run.active:
        return False
    try:
        import wandb

        table = wandb.Table(columns=AGGREGATE_COLUMNS, data=rows)  # pyright: ignore[reportArgumentType] (invariant lists)
        payload: Dict[str, object] = {AGGREGATE_TABLE: table}
        for image in images:
            payload[f"plots/{image.stem}"] = wandb.Image(str(image))
        run.log(payload)
        run.set_summary(summary)
        _log_artifact(run, aggregate.study, files, config)
    except Exception as err:  # noqa: BLE001
        _warn(f"aggregate failed: {err}")
        run.finish(exit_code=1)
        return False
    logged = run.active
    run.finish()
    if logged:
        try:
            state_path.parent.mkdir(parents=True, exist_ok=True)
            write_json(state_path, {"run_id": run_id, "project": project, "mode": mode, "content_sha256": content})
        except OSError as err:  # the next rerun logs it again
            _warn(f"cannot record the aggregate sent ({err})")
    return logged


def _log_artifact(run: WandbRun, study: str, files: List[Path], metadata: Dict) -> None:
    """`files` as a version of the study's aggregate Artifact. Their copies go into the run's own
    folder, which then holds everything `wandb sync` uploads (W&B would otherwise stage them under
    the user's home), and which no later aggregate changes."""
    import wandb

    assert run.run is not None
    artifact = wandb.Artifact(name=aggregate_artifact_name(study), type=AGGREGATE_ARTIFACT_TYPE, metadata=metadata)
    kept = Path(run.run.dir).parent / AGGREGATE_ARTIFACT_TYPE
    kept.mkdir(exist_ok=True)
    for path in files:
        copy = kept / path.name
        shutil.copyfile(path, copy)
        artifact.add_file(str(copy), name=path.name, policy="immutable", skip_cache=True)
    run.run.log_artifact(artifact)

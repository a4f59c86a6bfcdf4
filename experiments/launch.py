"""Launch: decide what each run needs, then run them as Ray tasks, as many as resources allow.

Each run is one Ray task holding the study's declared CPUs/GPUs; the task runs the engine in a
subprocess (`execute.py`). The driver holds no resources: it only submits, waits and records.
On rerun, the run dirs decide: a finished run with the same hash is skipped, an interrupted
one resumes from its latest checkpoint, a run whose hash changed starts over (the old dir is
moved under `superseded/`; once the plan has run, `prune_superseded` removes the runs the plan no
longer has). A failing run is recorded and the others go on; crashes and kills
are retried up to `study.retries` times, divergences and configuration errors are not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, cast

from experiments import storage
from experiments.display import DONE, DONE_BEFORE, QUEUED, RETRYING, StudyDisplay
from experiments.errors import DETERMINISTIC_FAILURES, StudyError
from experiments.execute import execute, now
from experiments.paths import portable
from experiments.plan import REPO_ROOT, RunSpec, plan_path
from experiments.results import RunStatus, SeedPlan
from experiments.run_records import (
    clear_engine_outputs,
    last_attempt,
    latest_checkpoint,
    prune,
    read_record,
    state,
    supersede,
    write_record,
)
from experiments.study import Study
from rlhf.atomic import write_json
from rlhf.errors import is_disk_full
from rlhf.run_dir import DirLock, LockBusy
from rlhf.run_dir import is_locked as lock_is_held

LOCK = ".lock"


class StudyBusy(RuntimeError):
    """Another manager process is running this study's results dir."""


@dataclass
class LaunchResult:
    completed: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    failed: Dict[str, str] = field(default_factory=dict)
    interrupted: bool = False


def decide(spec: RunSpec, rerun_failed: bool = False) -> str:
    """'skip', 'resume' or 'start' for one run, from what its run dir holds."""
    st = state(spec)
    if st == RunStatus.COMPLETED:
        return "skip"
    if st == RunStatus.FAILED:
        exit_code = last_attempt(spec.run_dir).get("exit_code")
        if exit_code in DETERMINISTIC_FAILURES:  # resuming would repeat it: skip, or start over
            return "start" if rerun_failed else "skip"
    if st in (RunStatus.INTERRUPTED, RunStatus.FAILED) and latest_checkpoint(spec.run_dir) is not None:
        return "resume"
    return "start"


def prepare(spec: RunSpec, action: str) -> None:
    """Makes the run dir ready for `action`: stale runs moved aside, partial outputs cleared."""
    if action != "start":
        return
    if state(spec) == RunStatus.STALE:
        supersede(spec.run_dir)
    clear_engine_outputs(spec.run_dir)


class StudyLock(DirLock):
    """An exclusive lock on RESULTS/<study>/: two managers never write the same run dirs."""

    def __init__(self, study_dir: Path):
        study_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(study_dir / LOCK)

    def __enter__(self) -> "StudyLock":
        try:
            return cast(StudyLock, super().__enter__())  # DirLock.__enter__ returns self
        except LockBusy:
            raise StudyBusy(f"{self.path.parent} is in use by another `experiments run` "
                            f"(lock {self.path}); wait for it or stop it first") from None


def prune_superseded(study_path: Path, specs: List[RunSpec]) -> Optional[int]:
    """Removes the study's runs that are not in its current plan (`run_records.prune`), under the
    study's lock; None (and nothing removed) when another manager holds the lock."""
    try:
        with StudyLock(study_path):
            return prune(study_path, [s.run_dir for s in specs])
    except StudyBusy:
        return None


def is_locked(study_dir: Path) -> bool:
    return lock_is_held(study_dir / LOCK)


def _init_ray(address: Optional[str], num_cpus: Optional[int], num_gpus: Optional[float]) -> Optional[object]:
    """Joins `address` (or RAY_ADDRESS) or starts a local instance. Returns None when it joined
    (or Ray was already up), else the watchdog process that ties the local instance's daemons to
    this process's life (experiments/watchdog.py): stop it with `_stop_ray`."""
    from rlhf.placement.cluster import connect
    if not connect(address, num_cpus=num_cpus, num_gpus=num_gpus, private=True):
        return None
    return subprocess.Popen([sys.executable, "-m", "experiments.watchdog", str(os.getpid())],
                            cwd=str(REPO_ROOT), start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_ray(watchdog) -> None:
    import ray
    ray.shutdown()
    if watchdog is not None:
        watchdog.terminate()
        watchdog.wait()


def check_writable(study_path: Path, specs: List[RunSpec]) -> None:
    """The study's results dir (and every existing run dir) can be written, or a StudyError
    naming the path: found before Ray starts, not as a PermissionError inside a Ray task."""
    try:
        study_path.mkdir(parents=True, exist_ok=True)
        probe = study_path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        if is_disk_full(err):  # a full disk: the one line of a full disk (cli.py), naming the dir
            err.filename = err.filename or str(study_path)
            raise
        raise StudyError(f"--results: cannot write {err.filename or study_path} ({err.strerror or err}); "
                         f"give a writable results directory") from None
    for spec in specs:
        run_dir = Path(spec.run_dir)
        if run_dir.exists() and not os.access(run_dir, os.W_OK | os.X_OK):
            raise StudyError(f"run dir {run_dir} is not writable; fix its permissions or move it away")


def wandb_fallback(display: StudyDisplay, wandb_dir: str) -> Optional[str]:
    """The W&B mode the runs use, said in one line with the directory of the run files
    (`wandb_dir`, or WANDB_DIR when set). `WANDB_MODE=online` without a W&B login would drop
    every run's data: say so once, here, and log offline instead (uploadable later with `wandb sync`)."""
    from experiments.wandb_sink import files_root, logged_in, wandb_mode
    mode, root = wandb_mode(), files_root(wandb_dir)
    if mode == "online" and not logged_in():
        display.console.print(f"warning: W&B: WANDB_MODE=online but this machine is not logged in to W&B (no "
                              f"WANDB_API_KEY, no `wandb login`): the runs log offline instead; after `wandb login`, "
                              f"upload them with `wandb sync {root}/wandb/offline-run-*`",
                              highlight=False, markup=False, soft_wrap=True)
        mode = "offline"
    if mode != "disabled":
        display.console.print(f"W&B {mode} run files: {root}", highlight=False, markup=False, soft_wrap=True)
    return mode


def _check_resources(study: Study) -> None:
    import ray
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    if study.cpus_per_run > cpus:
        raise StudyError(f"study.cpus_per_run = {study.cpus_per_run} exceeds the cluster's {cpus:g} CPUs")
    if study.gpus_per_run > gpus:
        raise StudyError(f"study.gpus_per_run = {study.gpus_per_run:g} exceeds the cluster's {gpus:g} GPUs")


def check_nodes_see(study_path: Path, specs: List[RunSpec]) -> None:
    """Every other node of the cluster that could run work sees, at the paths this process sees them, what
    the runs need: this code, their recipes, the working directory their engines start in, and the study's
    results dir (a file written here now: a shared filesystem). A StudyError naming the node, the path and
    what a cluster of several nodes needs otherwise; nothing to check on one node."""
    from rlhf.placement.cluster import paths_missing_on_nodes
    shared = storage.location_of(study_path.parent) is None  # a storage location's runs sync their own dirs
    probe = study_path / f".node-check-{os.getpid()}"
    needs = {**({str(probe): "the study's results dir, written here"} if shared else {}),
             str(Path(__file__).resolve()): "this code", os.getcwd(): "the working directory",
             **{s.recipe: "a recipe" for s in specs}}
    probe.write_text("")
    try:
        missing = paths_missing_on_nodes(list(needs))
    finally:
        probe.unlink(missing_ok=True)
    if missing:
        node, paths = next(iter(missing.items()))
        raise StudyError(f"the Ray node {node} does not see {paths[0]} ({needs[paths[0]]}); every node that runs "
                         f"work needs this checkout ({REPO_ROOT}), the recipes, data and working directory at the same "
                         f"absolute paths as here (or a `ray job submit --working-dir` on a cluster with one temp "
                         f"dir path), and the results dir ({study_path.parent}) on a shared filesystem or "
                         f"--results in a storage location (docs/scaling.md)")


def manager_fields(results_dir: Path, argv: Optional[List[str]]) -> dict:
    """The study-level provenance every run records; with results in a storage location (experiments/storage.py)
    `results_dir` is its URI, and the runs get the URI and the local copy they sync."""
    uri = storage.location_of(results_dir)
    return {"manager_command": [sys.executable, "-m", "experiments", *(argv or sys.argv[1:])],
            "manager_host": os.uname().nodename, "cwd": os.getcwd(), "results_dir": uri or str(results_dir),
            "launched_at": now(), **({"results_uri": uri, "staging_dir": str(results_dir)} if uri else {})}


def launch(study: Study, specs: List[RunSpec], results_dir: Path, *, ray_address: Optional[str] = None,
           num_cpus: Optional[int] = None, num_gpus: Optional[float] = None, cache_dir: Optional[str] = None,
           rerun_failed: bool = False, argv: Optional[List[str]] = None,
           display: Optional[StudyDisplay] = None, recorded: Optional[List[RunSpec]] = None,
           seed_plan: Optional[SeedPlan] = None) -> LaunchResult:
    """Runs every run the plan needs; returns which completed, were skipped or failed.

    `plan.json` records `recorded` (default: `specs`): an adaptive study records every look's runs;
    and `seed_plan`, the seeds planned for study.target_effect (experiments/seed_plan.py), or null.

    Ctrl-C (or SIGTERM turned into KeyboardInterrupt by the CLI) cancels the Ray tasks, whose
    children are stopped and recorded as interrupted; the next `run` resumes them.
    """
    study_path = Path(results_dir).resolve() / study.name
    cache_dir = cache_dir or os.environ.get("RLHF_CACHE") or str(REPO_ROOT / ".cache" / "rlhf")
    result = LaunchResult()
    display = display or StudyDisplay(study.name, specs)
    check_writable(study_path, specs)
    with StudyLock(study_path):
        write_plan(study_path, study, recorded or specs, seed_plan)
        actions = {s.key: decide(s, rerun_failed) for s in specs}
        todo = [s for s in specs if actions[s.key] != "skip"]
        for s in specs:
            if actions[s.key] == "skip":
                _skip(s, display, result)
        if not todo:
            return result
        from rlhf.placement.cluster import check_address
        check_address(ray_address)  # a cluster that cannot be joined: one line before anything else is said
        from experiments.wandb_sink import files_dir, project_for, revision
        wandb_dir = files_dir(results_dir)
        wandb_mode = _runs_wandb_mode(display, wandb_dir)
        wandb_project = project_for(study) if wandb_mode != "disabled" else ""
        with ray_cluster(ray_address, num_cpus, num_gpus) as gcs_address:
            _check_resources(study)
            check_nodes_see(study_path, todo)
            manager = {**manager_fields(study_path.parent, argv), "ray_address": gcs_address,
                       "wandb_project": wandb_project, "wandb_dir": wandb_dir, "wandb_revision": revision(),
                       "wandb_mode": wandb_mode, "start_gap_s": study.start_gap_s}
            runs = RayRuns(study.name, manager, cache_dir, todo)
            for s in todo:
                prepare(s, actions[s.key])
                runs.pushed(s)
                runs.submit(s, actions[s.key] == "resume")
                display.set(s.key, QUEUED, "resume" if actions[s.key] == "resume" else "")
            _wait_for(runs, display, result, study.retries)
    return result


def write_plan(study_path: Path, study: Study, specs: List[RunSpec], seed_plan: Optional[SeedPlan]) -> None:
    """plan.json: the study, its file and campaign, its runs (as files record a spec) and the seed plan, or null."""
    write_json(plan_path(study_path), {"study": study.name, "study_file": portable(study.path),
                                       "campaign": study.campaign or None, "runs": [s.record() for s in specs],
                                       "seed_plan": seed_plan.to_json() if seed_plan else None})


def _skip(spec: RunSpec, display: StudyDisplay, result: LaunchResult) -> None:
    """A run not run again: done before (same hash), or failed for good (a divergence or a
    configuration error, which a rerun would only repeat, without --rerun-failed)."""
    st = state(spec)
    display.set(spec.key, DONE_BEFORE if st == RunStatus.COMPLETED else RunStatus.FAILED,
                "" if st == RunStatus.COMPLETED else f"not rerun: {last_attempt(spec.run_dir).get('error')}")
    if st == RunStatus.COMPLETED:
        result.skipped.append(spec.key)
    else:
        result.failed[spec.key] = last_attempt(spec.run_dir).get("error") or "failed"


def _runs_wandb_mode(display: StudyDisplay, wandb_dir: str) -> Optional[str]:
    """The W&B mode of this launch's runs (`wandb_fallback`), offline also set for a local Ray's
    workers, which inherit this process's environment (remote ones get it per task)."""
    mode = wandb_fallback(display, wandb_dir)
    if mode == "offline":
        os.environ["WANDB_MODE"] = "offline"
    return mode


@contextlib.contextmanager
def ray_cluster(address: Optional[str], num_cpus: Optional[int], num_gpus: Optional[float]):
    """Ray for one launch: joins `address` (or RAY_ADDRESS) or starts a local instance
    (`_init_ray`); yields the cluster's address; afterwards stops what this launch started (Ray
    already up stays up)."""
    import ray
    ray_was_up = ray.is_initialized()
    watchdog = _init_ray(address, num_cpus, num_gpus)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        if not ray_was_up:
            _stop_ray(watchdog)


class RayRuns:
    """A launch's runs as Ray tasks (`execute` in a task): each submitted with the resources its
    placement holds and its attempt number; `refs` maps every task in flight to its run."""

    def __init__(self, study_name: str, manager: dict, cache_dir: str, todo: List[RunSpec]):
        import ray

        from rlhf.placement.cluster import forwarded_env
        self.study_name, self.manager, self.cache_dir = study_name, manager, cache_dir
        self.task = ray.remote(execute)
        self.env = forwarded_env()
        self.attempts = {s.key: 0 for s in todo}
        self.refs: Dict[object, RunSpec] = {}

    def pushed(self, spec: RunSpec) -> None:
        """With results in a storage location: the run dir as `prepare` left it is what the run pulls."""
        if self.manager.get("results_uri"):
            storage.push(Path(self.manager["staging_dir"]), self.manager["results_uri"], self._sub(spec))

    def pulled(self, spec: RunSpec) -> None:
        """With results in a storage location: the run dir as its task (on any node) last pushed it."""
        if self.manager.get("results_uri"):
            storage.pull(self.manager["results_uri"], Path(self.manager["staging_dir"]), self._sub(spec))

    def _sub(self, spec: RunSpec) -> str:
        return Path(spec.run_dir).relative_to(self.manager["staging_dir"]).as_posix()

    def submit(self, spec: RunSpec, resume: bool) -> None:
        self.attempts[spec.key] += 1
        # A one-process run holds its resources in its task; a distributed run's task holds
        # none: the engine reserves a placement group for its ranks on the same cluster.
        local = spec.placement == "local"
        options: Dict[str, Any] = dict(num_cpus=spec.cpus if local else 0, num_gpus=spec.gpus if local else 0,
                                       max_retries=0, name=f"{self.study_name}:{spec.key}")
        if self.env:  # the user's CPU numerics, caches and offline settings reach workers on any node
            options["runtime_env"] = {"env_vars": self.env}
        ref = self.task.options(**options).remote(spec.to_json(), resume, self.attempts[spec.key],
                                                  self.manager, self.cache_dir)
        self.refs[ref] = spec


@contextlib.contextmanager
def _interrupts_remembered():
    """Ctrl-C raises KeyboardInterrupt as usual and is also remembered (the yielded Event): a blocking
    call that runs Python's signal handler in C code (Ray's wait and get) can return without passing
    the exception on, and a stop the user asked for must still stop the study. The main thread only,
    where Python delivers signals; the previous handler comes back after."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        stop.set()
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for(runs: RayRuns, display: StudyDisplay, result: LaunchResult, retries: int) -> None:
    """Waits for every task in flight, settling each as it ends (`_settle`). Ctrl-C cancels the
    tasks, whose engines stop and record it; a full disk cancels them too, then is raised."""
    import ray
    with display, _interrupts_remembered() as stop:
        try:
            while runs.refs:
                if stop.is_set():  # a Ctrl-C whose KeyboardInterrupt a blocking call did not pass on
                    raise KeyboardInterrupt("Ctrl-C")
                ready, _ = ray.wait(list(runs.refs), num_returns=1, timeout=1.0)
                _mark_running(runs.refs, runs.attempts, display)
                for ref in ready:
                    _settle(runs, ref, display, result, retries)
                display.refresh()
        except KeyboardInterrupt:
            result.interrupted = True
            _cancel(runs.refs, display)
        except OSError as err:  # a full disk: the running engines stop in order, then one line
            if is_disk_full(err):
                _cancel(runs.refs, display)
            raise


def _settle(runs: RayRuns, ref, display: StudyDisplay, result: LaunchResult, retries: int) -> None:
    """A finished task's run: completed; or submitted again when it crashed or was killed and has
    retries left (resumed from its latest checkpoint, else started over); or failed."""
    spec = runs.refs.pop(ref)
    runs.pulled(spec)
    outcome = _outcome(ref, spec)
    if outcome["status"] == RunStatus.COMPLETED:
        result.completed.append(spec.key)
        display.set(spec.key, DONE)
    elif outcome["retriable"] and runs.attempts[spec.key] <= retries:
        display.set(spec.key, RETRYING, outcome["error"] or "")
        resume = latest_checkpoint(spec.run_dir) is not None
        if not resume:
            clear_engine_outputs(spec.run_dir)
        runs.pushed(spec)
        runs.submit(spec, resume)
    else:
        result.failed[spec.key] = outcome["error"] or "failed"
        display.set(spec.key, RunStatus.FAILED, outcome["error"] or "")


def _mark_running(refs: Dict, attempts: Dict[str, int], display: StudyDisplay) -> None:
    for spec in refs.values():
        if display.status.get(spec.key) in (QUEUED, RETRYING):
            entry = last_attempt(spec.run_dir)
            if entry.get("attempt") == attempts[spec.key] and entry.get("end") is None:
                display.set(spec.key, RunStatus.RUNNING)


def _outcome(ref, spec: RunSpec) -> dict:
    """The task's outcome; a task that died (worker crash, Ray's memory monitor) is recorded here."""
    import ray
    import ray.exceptions
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as err:
        cause = getattr(err, "cause", None)  # what the task raised (RayTaskError), else how it died
        if is_disk_full(cause):  # the task could not write the run dir: stop the study
            assert cause is not None  # is_disk_full(None) is False
            raise cause from None
        if isinstance(cause, BaseException):
            error = f"{type(cause).__name__}: {_first_line(cause)}"
        else:
            error = f"{type(err).__name__}: {_first_line(err)}"
        record = read_record(spec.run_dir)
        if record and record.get("attempts") and record["attempts"][-1].get("end") is None:
            record["attempts"][-1].update(end=now(), exit_code=-1, error=error)
            write_record(spec.run_dir, {**record, "spec": spec.to_json()})
        return {"key": spec.key, "exit_code": -1, "error": error, "status": RunStatus.FAILED, "retriable": True}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _cancel(refs: Dict, display: StudyDisplay, grace_s: float = 20.0) -> None:
    """Cancels the remaining tasks and waits for running ones to stop their engine and record it."""
    import ray
    for ref in refs:
        ray.cancel(ref, force=False)
    deadline = time.monotonic() + grace_s
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
    for ref in pending:
        ray.cancel(ref, force=True)
    for spec in refs.values():
        display.set(spec.key, RunStatus.INTERRUPTED)

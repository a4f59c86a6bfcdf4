"""Shared test set-up: runs are subprocesses of the real engine; the tiny default's SFT warm
start is built once (cached under RLHF_CACHE) and reused by every test."""

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("RLHF_CACHE", str(REPO / ".cache" / "rlhf"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A user's own vLLM placement or model-runner switch (verl users often export the first) is refused by
# the engine unless the recipe asks for the same (rlhf/rollout/vllm.py `environment_conflict`): the tests
# say theirs by binding (ppo.vllm_own_process, ppo.vllm_model_runner), and the tests of the refusal set
# the variables themselves.
os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
# Under pytest-xdist (the README's test command) each worker's local Ray instances and the clusters
# its tests start keep their files, and the address `ray.init()` looks up, in a directory of the
# worker's own: a Ray started by one worker's test is never joined by the other worker's runs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RAY_TMPDIR"] = f"/tmp/ray-{os.getppid()}-{os.environ['PYTEST_XDIST_WORKER']}"
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
# The engine's CPU numerics profile, before any test imports torch (rlhf/numerics.py): in-process
# engine code then takes the same kernels as the `python -m rlhf.train` subprocesses.
sys.path.insert(0, str(REPO))
from rlhf import numerics  # noqa: E402

numerics.apply()


def run_train(args, timeout=900, check=True, cwd=REPO, env=None):
    """Runs `python -m rlhf.train ARGS` and returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "rlhf.train", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlhf.train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def side_by_side(*calls):
    """Calls each function (no arguments) at once, each in a thread; their results in order, the first
    failure raised. For independent engine runs: the tiny default's engine computes on one thread
    (ppo.torch_threads = 1), so runs one after another leave every other core idle."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def run_trains(*arg_lists, **kw):
    """`run_train` of several independent runs at once (`side_by_side`); their CompletedProcesses in order."""
    return side_by_side(*(functools.partial(run_train, args, **kw) for args in arg_lists))


@contextlib.contextmanager
def meanwhile(*arg_lists, **kw):
    """`run_train` of each ARGS in the background while the with-block runs (a reference run beside the
    run the block interrupts or damages, say), on the cores the block leaves idle; the block's end waits
    for them and raises their failure. Yields their futures (`.result()`: the CompletedProcess)."""
    with ThreadPoolExecutor(max_workers=len(arg_lists)) as pool:
        futures = [pool.submit(run_train, args, **kw) for args in arg_lists]
        yield futures
        for future in futures:
            future.result()


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def kill_when(args, out, checkpoint: str, timeout=300) -> None:
    """Starts `python -m rlhf.train ARGS --out OUT` and kills it (SIGKILL) as soon as `OUT/checkpoints/
    CHECKPOINT` exists: a crash right after a checkpoint, for the resume tests."""
    out = Path(out)
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.train", *map(str, args), "--out", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while not (out / "checkpoints" / checkpoint).exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


VOLATILE = ("timing_s/", "perf/")
"""Metrics that measure the machine, not the run."""
EXACT = ("reward_mean", "reward_std", "accuracy", "response_length_mean", "response_clip_ratio",
         "rollout_success_rate", "eval/")
FRACTIONS = ("clip_fraction", "actor/clip_fraction", "actor/pg_clipfrac", "critic/value_clip_fraction")


def merge_bins_at_one(hist):
    """The ratio histogram's counts with the two bins either side of ratio 1 merged."""
    i = hist["bin_edges"].index(1.0)
    counts = hist["counts"]
    return counts[:i - 1] + [counts[i - 1] + counts[i]] + counts[i + 1:]


def assert_same_metrics(a, b):
    """Two runs that compute the same thing in another order (ranks, packing): sampled tokens, rewards and
    evaluations exactly; losses to float32 summation order; fractions of tokens may flip one token across
    a clip boundary, and ratios of 1 up to rounding fall either side of the histogram's edge at 1."""
    import pytest
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith(VOLATILE)}
        assert keys == {k for k in rb if not k.startswith(VOLATILE)}, ra["step"]
        for k in keys:
            where = f"step {ra['step']}: {k}"
            if k == "policy_ratio_hist":
                ca, cb = (merge_bins_at_one(r[k]) for r in (ra, rb))
                assert sum(ca) == sum(cb), where
                assert sum(abs(x - y) for x, y in zip(ca, cb)) <= 2, where
            elif k.startswith(EXACT) or k == "step":
                assert ra[k] == rb[k], where
            elif k.startswith(FRACTIONS):
                assert ra[k] == pytest.approx(rb[k], abs=1e-2), where
            else:
                assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), where

"""Shared helpers: write small study files next to the test's tmp dir."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


WANDB_TEST_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
"""The only W&B variables the manager's tests run with; the user's own (WANDB_DIR, WANDB_PROJECT,
WANDB_ENTITY, WANDB_RUN_ID, WANDB_RESUME, WANDB_API_KEY, WANDB_BASE_URL, ...) are cleared."""


@pytest.fixture(scope="session", autouse=True)
def own_wandb_environment():
    """Tests never depend on the user's W&B set-up (where files go, which project, a login); a
    test that needs a variable sets it itself."""
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("WANDB_")]:
            mp.delenv(key)
        for key, value in WANDB_TEST_ENV.items():
            mp.setenv(key, value)
        yield


@pytest.fixture
def write_study(tmp_path):
    """write_study(text, name='s.gin') -> path of a study file in tmp_path."""
    def write(text: str, name: str = "s.gin") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path
    return write


@pytest.fixture
def workdir():
    """A private temporary directory for slow tests: pytest's numbered tmp dirs are pruned by any
    other pytest session on the machine, which could delete a study's results mid-test."""
    path = Path(tempfile.mkdtemp(prefix="experiments-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def fake_run(spec, accuracy, kl=0.05, success=1.0, diverged=False):
    """A finished run dir of `spec` as the engine and the manager would leave it (no engine needed)."""
    from experiments.run_records import write_record
    from rlhf.atomic import write_json
    d = Path(spec.run_dir)
    d.mkdir(parents=True)
    rows = [{"step": s, "reward_mean": 0.1 * s + accuracy, "kl_divergence": kl, "clip_fraction": 0.1,
             "clip_fraction_lower": 0.05, "clip_fraction_upper": 0.05, "response_length_mean": 3.0,
             "rollout_success_rate": success, "policy_ratio_hist": {"bin_edges": [0, 1], "counts": [3]},
             **({"eval/accuracy": accuracy} if s in (0, 5) else {})} for s in range(6)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "rew')
    attempt = {"attempt": 1, "exit_code": 3 if diverged else 0, "start": "t0", "end": "t1",
               "error": "diverged (exit 3): training diverged: non-finite actor/pg_loss" if diverged else None}
    write_record(d, {"run_hash": spec.run_hash, "attempts": [attempt]})
    if not diverged:
        write_json(d / "summary.json", {"status": "completed", "steps": 5, "initial": {"eval/accuracy": 0.3},
                                        "final": {"eval/accuracy": accuracy},
                                        "final_window": {"kl_divergence": kl, "rollout_success_rate": success}})
    write_json(d / "provenance.json", {"versions": {"torch": "x"}, "hardware": {"hostname": "h"}})


def fake_checkpoint(path: Path, content: bytes = b"weights") -> Path:
    """A checkpoint dir as the engine writes it (actor/ as an HF checkpoint, state.json)."""
    (path / "actor").mkdir(parents=True)
    (path / "actor" / "config.json").write_text("{}")
    (path / "actor" / "model.safetensors").write_bytes(content)
    (path / "state.json").write_text('{"step": %s}' % path.name.rsplit("_", 1)[-1])
    from rlhf import checkpoint
    if hasattr(checkpoint, "write_manifest"):  # the engine verifies a checkpoint against it
        checkpoint.write_manifest(path)
    return path


def previous_study_aggregate(name: str, chosen: str, runs_by_variant: dict, seeds=(0, 1)):
    """A finished study's aggregate: {variant: [(seed, status, run_dir)]} -> StudyAggregate."""
    from experiments.results import Decision, RunOutcome, StudyAggregate, VariantResult

    variants = {v: VariantResult(bindings=() if v == "baseline" else (f"ppo.kl_coef = 0.{len(v)}",),
                                 verdict="baseline" if v == "baseline" else "better",
                                 runs=tuple(RunOutcome(seed=s, status=st, run_dir=d) for s, st, d in runs))
                for v, runs in runs_by_variant.items()}
    return StudyAggregate(study=name, study_file="", description="", metric="eval/accuracy", metric_from="final",
                          direction="higher", alpha=0.05, seeds=tuple(seeds), guardrails=(), variants=variants,
                          decision=Decision(chosen, "test"))

"""bench/profile_phases.py: where a phase's time goes, from a profiler trace's events."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import profile_phases  # noqa: E402


def annotation(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_of_kernels_inside_the_phase():
    events = [
        annotation("iteration", 0, 10_000),
        annotation("update_actor", 0, 4_000),
        annotation("generate", 4_000, 6_000),
        kernel("sm90_xmma_gemm_bf16", 100, 900),        # matmul, 0.1-1.0 ms
        kernel("triton_poi_fused_add", 500, 1_000),      # overlaps it: the union is 0.1-1.5 ms
        kernel("Memcpy HtoD", 3_500, 1_000, cat="gpu_memcpy"),  # crosses into generate: split at 4 ms
        kernel("flash_fwd_kernel", 9_000, 50),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1_600, "dur": 1_900},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 100, "dur": 5},
    ]
    s = profile_phases.summarize(events, ["update_actor", "generate"])
    actor, gen = s["phases"]["update_actor"], s["phases"]["generate"]
    assert actor["gpu_busy_s"] == pytest.approx(0.0019)  # 1.4 ms of kernels + 0.5 ms of the copy
    assert actor["gpu_idle_s"] == pytest.approx(0.0021)
    assert actor["kernel_s"]["matmul"] == pytest.approx(0.0009) and actor["kernel_s"]["fused"] == pytest.approx(0.001)
    assert actor["host_waits"] == {"count": 1, "total_s": pytest.approx(0.0019),
                                   "by_call": {"cudaStreamSynchronize": 1}}
    # Idle stretches of update_actor: 0-0.1 ms, 1.5-3.5 ms.
    assert actor["idle_gaps"]["0.1-1ms"]["count"] == 1 and actor["idle_gaps"]["1-10ms"]["count"] == 1
    assert gen["gpu_busy_s"] == pytest.approx(0.00055) and gen["kernel_s"]["attention"] == pytest.approx(0.00005)
    assert gen["idle_gaps"][">=10ms"]["count"] == 0
    assert s["iteration"]["gpu_busy_s"] == pytest.approx(0.00245)
    assert s["iteration"]["unattributed_s"] == pytest.approx(0.0)
    assert "update_actor" in profile_phases.format_table(s)


def test_cpu_profile_of_real_iterations(tmp_path):
    """ppo_step --profile on the tiny default (CPU): the trace, its summary, every phase named."""
    out = tmp_path / "prof"
    subprocess.run([sys.executable, str(REPO / "bench" / "ppo_step.py"), "--recipe", str(REPO / "recipes" / "tiny.gin"),
                    "--steps", "1", "--no-eval", "--json", str(tmp_path / "r.json"), "--profile", str(out),
                    "-b", "task.eval_size = 16"], check=True, cwd=REPO, capture_output=True, timeout=600)
    summary = json.loads((out / "profile.json").read_text())
    for phase in ("generate", "reference", "old_logprobs", "values", "update_critic", "update_actor"):
        assert summary["phases"][phase]["wall_s"] > 0
    assert summary["iteration"]["wall_s"] >= sum(p["wall_s"] for p in summary["phases"].values()) * 0.99
    with gzip.open(out / "trace.json.gz", "rt") as f:
        assert any(e.get("name") == "update_actor" for e in json.load(f)["traceEvents"])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["profile"]["phases"].keys() == summary["phases"].keys()
    assert result["step_results"][0]["step"] == 2 and "reward_mean" in result["step_results"][0]

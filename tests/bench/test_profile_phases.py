"""Where a phase's time goes, from a profiler trace's events (rlhf/profiling.py), and the iterations
that write the traces: `python -m rlhf.train --profile STEP` and `bench/ppo_step.py --profile DIR`."""

import gzip
import json
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path

import pytest

from rlhf import profiling
from rlhf.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


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
    s = profiling.summarize(events, ["update_actor", "generate"])
    actor, gen = s["phases"]["update_actor"], s["phases"]["generate"]
    assert actor["gpu_busy_s"] == pytest.approx(0.0019)  # 1.4 ms of kernels + 0.5 ms of the copy
    assert actor["gpu_idle_s"] == pytest.approx(0.0021)
    assert actor["kernel_s"]["matmul"] == pytest.approx(0.0009) and actor["kernel_s"]["fused"] == pytest.approx(0.001)
    assert actor["host_waits"] == {"count": 1, "total_s": pytest.approx(0.0019),
                                   "by_call": {"cudaStreamSynchronize": 1}, "by_op": {"(no op)": 1}}
    # Idle stretches of update_actor: 0-0.1 ms, 1.5-3.5 ms.
    assert actor["idle_gaps"]["0.1-1ms"]["count"] == 1 and actor["idle_gaps"]["1-10ms"]["count"] == 1
    assert gen["gpu_busy_s"] == pytest.approx(0.00055) and gen["kernel_s"]["attention"] == pytest.approx(0.00005)
    assert gen["idle_gaps"][">=10ms"]["count"] == 0
    assert s["iteration"]["gpu_busy_s"] == pytest.approx(0.00245)
    assert s["iteration"]["unattributed_s"] == pytest.approx(0.0)
    assert "update_actor" in profiling.format_table(s)


def cpu_op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def wait(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_each_host_wait_is_put_down_to_the_outermost_op_of_its_thread():
    events = [
        annotation("update_critic", 0, 10_000), annotation("values", 10_000, 5_000),
        cpu_op("aten::item", 100, 500), cpu_op("aten::_local_scalar_dense", 110, 480),
        wait("cudaStreamSynchronize", 120, 400),                     # a value read on the host
        cpu_op("aten::to", 1_000, 300), cpu_op("aten::copy_", 1_010, 280),
        wait("cudaStreamSynchronize", 1_050, 200),                   # a copy from pageable memory
        cpu_op("aten::to", 2_000, 300), wait("cudaStreamSynchronize", 2_100, 100),
        cpu_op("aten::mm", 3_000, 100, tid=2), wait("cudaStreamSynchronize", 3_010, 50),  # another thread's op
        wait("cudaEventSynchronize", 5_000, 100),                    # no op around it
        cpu_op("aten::nonzero", 11_000, 200), wait("cudaMemcpy", 11_050, 100),
        cpu_op("aten::add", 12_000, 10), cpu_op("aten::add", 12_000, 10),  # two alike at one time sort
    ]
    s = profiling.summarize(events, ["update_critic", "values"])
    assert s["phases"]["update_critic"]["host_waits"]["by_op"] == {"aten::to": 2, "aten::item": 1, "(no op)": 2}
    assert s["phases"]["values"]["host_waits"]["by_op"] == {"aten::nonzero": 1}
    merged = profiling.merge_summaries([s["phases"]["update_critic"], s["phases"]["values"]])
    assert merged["host_waits"]["by_op"] == {"aten::to": 2, "(no op)": 2, "aten::item": 1, "aten::nonzero": 1}
    assert merged["host_waits"]["by_call"] == {"cudaStreamSynchronize": 4, "cudaEventSynchronize": 1,
                                               "cudaMemcpy": 1}


def test_a_sync_site_names_the_engine_s_frame_and_the_library_call_under_it():
    own = str(profiling.PACKAGE_DIR / "roles" / "forward.py")
    stack = [traceback.FrameSummary(str(profiling.PACKAGE_DIR / "trainer.py"), 300, "train_step"),
             traceback.FrameSummary(own, 127, "response_logprobs"),
             traceback.FrameSummary("/usr/lib/python3/site-packages/transformers/masking_utils.py", 761,
                                    "find_packed_sequence_indices")]
    assert profiling.sync_site(stack) == ("rlhf/roles/forward.py:127 response_logprobs <- "
                                          "transformers/masking_utils.py:761 find_packed_sequence_indices")
    assert profiling.sync_site(stack[:2]) == "rlhf/roles/forward.py:127 response_logprobs"  # the call is ours
    assert profiling.sync_site(stack[2:]) == "transformers/masking_utils.py:761 find_packed_sequence_indices"
    assert profiling.sync_site([]) == "(no Python frame)"


def _reads_a_value_on_the_host():
    # what torch's sync debug mode says, with the suffix its warnings carry
    warnings.warn(f"{profiling.SYNC_WARNING} (Triggered internally at c10/cuda/CUDAFunctions.cpp:160.)")


def test_sync_sites_counts_every_host_wait_by_phase_and_site_and_lets_other_warnings_through():
    """Each report of torch's sync debug mode is counted under the open phase (the innermost, on this
    thread) and its site, every time, not once per place; any other warning is shown as before; the
    warning filters are as they were after the block."""
    filters = list(warnings.filters)
    with pytest.warns(UserWarning, match="something else"), profiling.sync_sites() as counts:
        with profiling.phase_range("update_actor"):
            for _ in range(3):
                _reads_a_value_on_the_host()
            with profiling.phase_range("values"):
                _reads_a_value_on_the_host()
            warnings.warn("something else")
        _reads_a_value_on_the_host()
        seen_elsewhere = []
        thread = threading.Thread(target=lambda: seen_elsewhere.append(profiling.current_phase()))
        with profiling.phase_range("generate"):
            thread.start()
            thread.join()
    site = f"tests/bench/test_profile_phases.py:{_reads_a_value_on_the_host.__code__.co_firstlineno + 2} " \
           "_reads_a_value_on_the_host"
    assert counts == {"update_actor": {site: 3}, "values": {site: 1}, "(no phase)": {site: 1}}
    assert seen_elsewhere == ["(no phase)"]  # phases are per thread
    assert warnings.filters == filters and profiling.current_phase() == "(no phase)"

    summary = {"phases": {"update_actor": {"host_waits": {}}, "reference": {"host_waits": {}}},
               "iteration": {"host_waits": {}}}
    profiling.add_sync_sites(summary, counts)
    assert summary["phases"]["update_actor"]["host_waits"]["sites"] == {site: 3}
    assert summary["phases"]["reference"]["host_waits"]["sites"] == {}
    assert summary["iteration"]["host_waits"]["sites"] == {site: 5}
    assert profiling.format_sites(summary) == f"host waits by site:\n  update_actor: 3 x {site}"


def test_cpu_profile_of_real_iterations(tmp_path):
    """ppo_step --profile on the tiny default (CPU): the trace, its summary, every phase named."""
    out = tmp_path / "prof"
    subprocess.run([sys.executable, str(REPO / "bench" / "ppo_step.py"), "--recipe", str(REPO / "recipes" / "tiny.gin"),
                    "--steps", "1", "--no-eval", "--json", str(tmp_path / "r.json"), "--profile", str(out),
                    "-b", "task.eval_size = 16"], check=True, cwd=REPO, capture_output=True, timeout=600)
    summary = json.loads((out / "step_3.json").read_text())  # after a warm-up and one timed step
    for phase in ("generate", "reference", "old_logprobs", "values", "update_critic", "update_actor"):
        assert summary["phases"][phase]["wall_s"] > 0
    assert summary["iteration"]["wall_s"] >= sum(p["wall_s"] for p in summary["phases"].values()) * 0.99
    with gzip.open(out / "step_3.trace.json.gz", "rt") as f:
        assert any(e.get("name") == "update_actor" for e in json.load(f)["traceEvents"])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["profile"]["phases"].keys() == summary["phases"].keys()
    assert result["step_results"][0]["step"] == 2 and "reward_mean" in result["step_results"][0]


def test_the_trace_summarises_anywhere_with_the_bench_command(tmp_path):
    """bench/profile_phases.py prints the same summary for a trace file."""
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": [annotation("iteration", 0, 2_000), annotation("reward", 0, 1_000),
                                   kernel("sm90_xmma_gemm_bf16", 100, 500)]}, f)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "profile_phases.py"), str(trace), "--json",
                           str(tmp_path / "s.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["phases"]["reward"]["kernel_s"]["matmul"] == pytest.approx(5e-4)
    assert "reward" in done.stdout


def test_train_profile_writes_the_step_s_trace_and_summary_and_marks_its_record(tmp_path):
    """`python -m rlhf.train --profile 2` on the tiny default: iteration 2 runs under the profiler, its
    trace and summary land in the run's profile/ folder, every phase named, and only its record says so."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "rlhf.train", "recipes/tiny.gin", "--out", str(out), "--quiet",
                           "--profile", "2", "-b", "ppo.total_steps = 2", "-b", "task.eval_size = 16"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "profile" / "step_2.json").read_text())
    assert summary["step"] == 2
    for phase in ("generate", "reward", "reference", "old_logprobs", "values", "advantages", "update_critic",
                  "update_actor"):
        assert summary["phases"][phase]["wall_s"] > 0, phase
    assert summary["iteration"]["wall_s"] >= sum(p["wall_s"] for p in summary["phases"].values()) * 0.99
    assert summary["phases"]["update_actor"]["host_waits"]["sites"] == {}  # no GPU: nothing waits
    with gzip.open(out / "profile" / "step_2.trace.json.gz", "rt") as f:
        assert any(e.get("name") == "update_actor" for e in json.load(f)["traceEvents"])
    assert "profile of step 2" in done.stderr and "update_actor" in done.stderr  # the table, as it ends
    records = read_metrics(out)  # the step's machine record (perf.jsonl) joined to its metrics
    assert [r.get("perf/profiled") for r in records if r["step"] > 0] == [None, 1.0]


@pytest.mark.parametrize("flag, message", [
    ("3", "--profile 3 is invalid: must be an iteration of this run, 1 to ppo.total_steps = 2"),
    ("-1", "--profile -1 is invalid"),
])
def test_train_profile_outside_the_run_is_exit_2_before_compute(tmp_path, flag, message):
    done = subprocess.run([sys.executable, "-m", "rlhf.train", "recipes/tiny.gin", "--out", str(tmp_path / "run"),
                           "--profile", flag, "-b", "ppo.total_steps = 2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_profile_of_a_ray_placement_names_the_binding():
    from rlhf import configurable
    from rlhf.errors import ConfigError
    from rlhf.train import check_profile
    cfg, _ = configurable.resolve(REPO / "recipes" / "tiny.gin", ["ppo.placement = 'colocated'"])
    with pytest.raises(ConfigError, match="ppo.placement = 'local'"):
        check_profile(1, cfg)
    check_profile(0, cfg)  # not asked: nothing to check

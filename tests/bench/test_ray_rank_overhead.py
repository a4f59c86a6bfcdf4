"""bench/ray_rank_overhead.py on the CPU: the same training step timed in this process and in Ray
actors made as the engine's rank hosts are (one call at a time, and two: a thread of the actor's
pool), at the niceness Ray gives its workers (15 above the controller's; `--niceness` sets it through
Ray's own `RAY_worker_niceness`)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytest.importorskip("ray")


def test_the_step_is_timed_in_each_placement_at_the_workers_niceness(tmp_path):
    out = tmp_path / "overhead.json"
    args = [sys.executable, str(REPO / "bench" / "ray_rank_overhead.py"), "--tiny", "--steps", "3", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    own = result["this_process"]
    assert own["thread"] == "MainThread" and own["ratio"] == 1.0 and len(own["step_s"]) == 3
    assert result["ray_actor"]["thread"] == "MainThread"
    assert result["ray_actor_threaded"]["thread"] != "MainThread"  # the engine's hosts take two calls at once
    for name in ("ray_actor", "ray_actor_threaded"):
        r = result[name]
        assert r["niceness"] == min(19, own["niceness"] + 15) and r["torch_threads"] == 1
        assert r["step_s_median"] > 0 and r["ratio"] == pytest.approx(r["step_s_median"] / own["step_s_median"])
        assert name in proc.stdout


@pytest.mark.parametrize("args", [["--json", "."], ["--json", "missing/out.json"], ["--json", "o.json", "--steps", "0"],
                                  ["--json", "o.json", "--niceness", "20"]])
def test_bad_arguments_get_one_line_and_exit_2_before_any_compute(tmp_path, args):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "ray_rank_overhead.py"), *args], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ray_rank_overhead.py: error: --")
    assert not (tmp_path / "o.json").exists()

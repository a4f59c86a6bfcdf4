"""bench/overlap_processes.py on the CPU: an update and a decoding loop timed alone, then together with the
decoding on a thread of this process and in a process of its own, each against the two in turn."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "bench" / "overlap_processes.py"


def test_both_loads_are_timed_alone_and_together_in_each_placement(tmp_path):
    out = tmp_path / "overlap.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--train-steps", "3", "--decode-steps", "5",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    alone = result["alone"]
    assert len(alone["update"]["step_s"]) == 3 and len(alone["decode"]["step_s"]) == 5
    assert result["in_turn_s"] == pytest.approx(alone["update"]["wall_s"] + alone["decode"]["wall_s"])
    for where in ("thread", "process"):
        r = result[where]
        assert len(r["update"]["step_s"]) == 3 and len(r["decode"]["step_s"]) == 5
        # the wall spans both loads: at least the longer of the two, at most both in turn plus start-up skew
        assert r["wall_s"] >= max(r["update"]["wall_s"], r["decode"]["wall_s"]) - 1e-6
        assert r["wall_over_in_turn"] == pytest.approx(r["wall_s"] / result["in_turn_s"])
        assert r["decode_slowdown"] == pytest.approx(r["decode"]["median_s"] / alone["decode"]["median_s"])
        assert f"decoding on a {where}" in proc.stdout


@pytest.mark.parametrize("args", [["--json", "."], ["--json", "missing/out.json"],
                                  ["--json", "o.json", "--train-steps", "0"],
                                  ["--json", "o.json", "--decode-steps", "-1"]])
def test_bad_arguments_get_one_line_and_exit_2_before_any_compute(tmp_path, args):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("overlap_processes.py: error: --")
    assert not (tmp_path / "o.json").exists()

"""bench/gc_pauses.py on the tiny recipe: both modes run, and only the frozen one leaves a full pass
almost nothing to walk after its first iteration."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gc_pauses_runs_both_modes(tmp_path):
    out = tmp_path / "gc.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "gc_pauses.py"), "--steps", "2", "-b", "task.eval_size = 8",
                    "--json", str(out)], check=True, cwd=REPO, capture_output=True, timeout=600)
    results = json.loads(out.read_text())["results"]
    unfrozen, frozen = results["unfrozen"]["tracked_objects_by_step"], results["frozen"]["tracked_objects_by_step"]
    assert len(unfrozen) == len(frozen) == 2
    assert frozen[1] < 1_000 < unfrozen[1]  # after the first iteration the frozen heap is out of the passes
    assert results["frozen"]["collections"]["gen2"]["count"] >= 1  # the freeze's own collection

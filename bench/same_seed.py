"""Two runs of one seed and configuration, compared metric by metric: the same-seed repeat of
bench/results/determinism_h200.md. Reads each run's `metrics.jsonl` (a run dir or the file), compares
every numeric metric of the steps both ran (timings and `perf/` figures left out: they measure the
machine), prints how many are equal and the largest difference of each that is not, and writes JSON.

    python bench/same_seed.py RUN_A RUN_B [--json OUT.json]

Exit 0 when every compared metric is equal, 1 otherwise, 2 for a run that has no metrics.jsonl."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf.metrics import is_machine_metric, read_metrics  # noqa: E402


def compare(a: list, b: list) -> dict:
    """{"steps": [...], "compared": n, "equal": n, "differing": {metric: {"steps": [...], "max_abs": x}}}."""
    by_step = {r["step"]: r for r in b if "step" in r}
    steps, compared, equal, differing = [], 0, 0, {}
    for ra in a:
        rb = by_step.get(ra.get("step"))
        if rb is None:
            continue
        steps.append(ra["step"])
        for key in sorted(set(ra) & set(rb)):
            va, vb = ra[key], rb[key]
            if key == "step" or is_machine_metric(key) or isinstance(va, bool) or \
                    not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
                continue
            compared += 1
            if va == vb:
                equal += 1
                continue
            entry = differing.setdefault(key, {"steps": [], "max_abs": 0.0})
            entry["steps"].append(ra["step"])
            entry["max_abs"] = max(entry["max_abs"], abs(va - vb))
    return {"steps": steps, "compared": compared, "equal": equal, "differing": differing}


def metrics_file(path: Path) -> Path | None:
    """A run dir's metrics.jsonl, or the file itself; None where there is none."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    return path if path.is_file() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    files = [metrics_file(run) for run in (args.run_a, args.run_b)]
    for run, found in zip((args.run_a, args.run_b), files):
        if found is None:
            p.error(f"{run}: neither a run dir holding metrics.jsonl nor a metrics.jsonl file")
    result = compare(*(read_metrics(f) for f in files if f is not None))
    print(f"steps {result['steps']}: {result['equal']} of {result['compared']} metrics equal")
    for key, d in result["differing"].items():
        print(f"  {key}: differs at steps {d['steps']}, by up to {d['max_abs']:.3g}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not result["differing"] and result["compared"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

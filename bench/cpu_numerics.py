"""Benchmark: do CPU runs of the tiny recipe give the same numbers on another machine, and at what cost?

    python bench/cpu_numerics.py [--steps 30] [--settings portable,native,...] [--json PATH]
    python bench/cpu_numerics.py compare A.json B.json

For each named setting of the CPU numerics (rlhf/numerics.py), runs `python -m rlhf.train
recipes/tiny.gin -b 'ppo.total_steps = N'` on the CPU with a fresh cache (so the SFT warm start is
built under the same setting) and records: the sha256 of metrics.jsonl without its timing and
perf fields (the numeric path of the whole run), the SFT warm start's and the final checkpoint's
hashes, the seconds per PPO step (median) and of the SFT build, the settings in force and the
machine's fingerprint (rlhf.provenance). `compare` lines up two such files (two machines) and says,
setting by setting, whether the numbers agree. Not a test: figures go to stdout and the JSON.

On the lent GPU machine's CPU (Python 3.12, torch 2.11, transformers 5.17, no gin): carry the
gin-config wheel (pure Python, importable from the zip) and hide the GPU:
    echo '/.carry/' >> .git/info/exclude; pip download --no-deps gin-config==0.5.0 -d .carry
    device run, carry [".carry"]: export PYTHONPATH=$PWD/.carry/gin_config-0.5.0-py3-none-any.whl;
        python3 bench/cpu_numerics.py --steps 30 --settings portable,avx2,native --json $OUT/cpu_numerics_h200host.json
    python bench/cpu_numerics.py compare bench/results/cpu_numerics_epyc_torch211.json FILES_AT/cpu_numerics_h200host.json
(bench/results/cpu_numerics_epyc_torch211.json: this machine with the same torch 2.11 and transformers 5.17.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# name -> environment; every setting starts from an environment without numerics variables.
SETTINGS = {
    "portable": {},  # the engine's default profile
    "avx2": {"RLHF_NUMERICS": "avx2"},  # MKL's AVX2 branch: free, reproducible across Intel CPUs
    "native": {"RLHF_NUMERICS": "native"},
    "native_aten_avx2": {"RLHF_NUMERICS": "native", "ATEN_CPU_CAPABILITY": "avx2"},
    "native_mkl_compatible": {"RLHF_NUMERICS": "native", "MKL_CBWR": "COMPATIBLE"},
    "aten_avx2_mkl_avx2": {"RLHF_NUMERICS": "native", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"},
    "portable_mkl_nonstrict": {"MKL_CBWR": "COMPATIBLE"},
    "portable_threads2": {"RLHF_CPU_THREADS": "2", "@bindings": ["ppo.torch_threads = 2"]},
    "aten_default_mkl_compatible": {"RLHF_NUMERICS": "native", "ATEN_CPU_CAPABILITY": "default",
                                    "MKL_CBWR": "COMPATIBLE"},
}
DEFAULT_SETTINGS = "portable,avx2,native,native_aten_avx2,native_mkl_compatible"


def _children_cpu() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def weights_sha256(model_dir: Path) -> str:
    """sha256 over a checkpoint's tensors (names, dtypes, shapes, bytes): unlike the directory hash,
    blind to the library versions written into config.json and the safetensors header."""
    from safetensors.numpy import load_file
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{name}:{t.dtype}:{t.shape}".encode() + t.tobytes())
    return h.hexdigest()


def metrics_sha256(path: Path) -> str:
    """sha256 of metrics.jsonl with timing_s/ and perf/ fields dropped (they vary run to run)."""
    h = hashlib.sha256()
    for line in path.read_text().splitlines():
        if line.strip():
            rec = {k: v for k, v in json.loads(line).items() if not k.startswith(("timing_s/", "perf/"))}
            h.update(json.dumps(rec, sort_keys=True).encode() + b"\n")
    return h.hexdigest()


def run_setting(name: str, steps: int, recipe: str, extra_bindings: list) -> dict:
    from rlhf.numerics import NUMERIC_ENV
    from rlhf.provenance import hash_directory
    spec = dict(SETTINGS[name])
    bindings = spec.pop("@bindings", [])
    env = {k: v for k, v in os.environ.items() if k not in NUMERIC_ENV}
    env.update(spec)
    env.update(CUDA_VISIBLE_DEVICES="", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0")
    with tempfile.TemporaryDirectory(prefix=f"cpu_numerics_{name}_") as tmp:
        env["RLHF_CACHE"] = str(Path(tmp) / "cache")
        out = Path(tmp) / "run"
        argv = [sys.executable, "-m", "rlhf.train", recipe, "--quiet", "--out", str(out),
                "-b", f"ppo.total_steps = {steps}", "-b", f"ppo.save_every = {steps}",
                *[x for b in bindings + extra_bindings for x in ("-b", b)]]
        start, cpu_start = time.perf_counter(), _children_cpu()
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - start, _children_cpu() - cpu_start
        if proc.returncode != 0:
            return {"setting": name, "error": proc.stderr.strip().splitlines()[-1:], "exit_code": proc.returncode}
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        sft_root = next(Path(env["RLHF_CACHE"]).glob("tiny-*/sft_info.json")).parent
        prov = json.loads((out / "provenance.json").read_text())
        summary = json.loads((out / "summary.json").read_text())
        step_times = [r["timing_s/step"] for r in records if "timing_s/step" in r]
        return {
            "setting": name, "env": spec, "bindings": bindings + extra_bindings, "steps": steps,
            "metrics_sha256": metrics_sha256(out / "metrics.jsonl"),
            "sft_sha256": hash_directory(sft_root / "sft_model"),
            "sft_weights_sha256": weights_sha256(sft_root / "sft_model"),
            "final_actor_weights_sha256": weights_sha256(out / "checkpoints" / f"step_{steps}" / "actor"),
            "final_checkpoint_sha256": hash_directory(out / "checkpoints" / f"step_{steps}"),
            "seconds_per_step_median": statistics.median(step_times),
            "seconds_per_step_mean": statistics.fmean(step_times),
            "sft_seconds": json.loads((sft_root / "sft_info.json").read_text())["seconds"],
            "wall_s": wall,
            "cpu_s": cpu,  # user + system CPU seconds of the whole run: steadier than wall time on a busy machine
            "initial": summary["initial"], "final": summary["final"],
            "numerics": prov.get("numerics"),
            "fingerprint": prov.get("hardware", {}).get("fingerprint"),
        }


def machine() -> dict:
    from rlhf.provenance import hardware, hardware_fingerprint, package_versions
    info = hardware()
    return {"hardware": info, "fingerprint": hardware_fingerprint({"hardware": info}),
            "versions": package_versions()}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    print(f"A: {a['machine']['fingerprint']}  torch {a['machine']['versions'].get('torch')}")
    print(f"B: {b['machine']['fingerprint']}  torch {b['machine']['versions'].get('torch')}")
    by_name = {r["setting"]: r for r in b["results"]}
    same_all = True
    for ra in a["results"]:
        rb = by_name.get(ra["setting"])
        if rb is None or "error" in ra or "error" in rb:
            print(f"{ra['setting']:30s} not comparable")
            continue
        # Weights where both files have them (library versions change config.json, not the numbers).
        sft = "sft_weights_sha256" if "sft_weights_sha256" in ra and "sft_weights_sha256" in rb else "sft_sha256"
        final = ("final_actor_weights_sha256" if "final_actor_weights_sha256" in ra and "final_actor_weights_sha256" in rb
                 else "final_checkpoint_sha256")
        same = {k: ra[k] == rb[k] for k in (sft, "metrics_sha256", final)}
        same_all &= all(same.values())
        print(f"{ra['setting']:30s} sft {'same' if same[sft] else 'DIFFERS'}, metrics "
              f"{'same' if same['metrics_sha256'] else 'DIFFER'}, final weights "
              f"{'same' if same[final] else 'DIFFER'}; s/step A {ra['seconds_per_step_median']:.3f} "
              f"B {rb['seconds_per_step_median']:.3f}, cpu s A {ra.get('cpu_s', float('nan')):.1f} "
              f"B {rb.get('cpu_s', float('nan')):.1f}")
    return 0 if same_all else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        return compare(*argv[1:3])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--recipe", default="recipes/tiny.gin")
    p.add_argument("-b", "--binding", action="append", default=[])
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "cpu_numerics.json"))
    args = p.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"error: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    report = {"machine": machine(), "recipe": args.recipe, "steps": args.steps, "results": []}
    print(f"machine: {report['machine']['fingerprint']}")
    for name in names:
        r = run_setting(name, args.steps, args.recipe, args.binding)
        report["results"].append(r)
        if "error" in r:
            print(f"{name:30s} failed: {r['error']}")
        else:
            print(f"{name:30s} sft {r['sft_sha256'][:12]} metrics {r['metrics_sha256'][:12]} "
                  f"{r['seconds_per_step_median']:.3f} s/step (mean {r['seconds_per_step_mean']:.3f}), "
                  f"sft {r['sft_seconds']:.1f} s, cpu {r['cpu_s']:.1f} s, eval/accuracy {r['initial']['eval/accuracy']:.4f} -> "
                  f"{r['final']['eval/accuracy']:.4f}")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

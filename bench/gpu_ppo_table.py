"""Markdown tables of bench/gpu_ppo.py results: each phase's median time and peak memory, one
column per variant (not a test).

    python bench/gpu_ppo_table.py FILE.json... [--out PATH]

Times are the medians over the timed iterations (s); memory is `--phase-memory`'s per-phase
maximum over them (GB): the torch allocator's peak in the benchmark process, and the device's
peak in use (every allocator, vLLM's own pool included). A run cut by its time limit says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ORDER = ["generate", "rollout_release", "reward_model", "reward", "reference", "old_logprobs", "values", "advantages",
         "update_critic", "update_actor", "sync_weights"]


def fmt(x, nd=2):
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{nd}f}"


def tables(results: list[dict]) -> list[str]:
    names = [r.get("variant", "?") + (" (partial)" if r.get("partial") or r.get("stopped") else "")
             + (" (warm-up only)" if r.get("warmup_only") else "") for r in results]
    head = "| phase | " + " | ".join(names) + " |"
    rule = "| --- |" + " ---: |" * len(results)
    phases = [p for p in ORDER if any(p in r.get("median_s", {}) for r in results)]
    phases += sorted({p for r in results for p in r.get("median_s", {})} - set(phases) - {"step"})
    out = ["Median time per phase (s):", "", head, rule]
    for p in phases:
        out.append(f"| {p} | " + " | ".join(fmt(r.get("median_s", {}).get(p)) for r in results) + " |")
    out.append("| **iteration** | "
               + " | ".join(f"**{fmt(r.get('median_s', {}).get('step'))}**" for r in results) + " |")
    out.append("| timed iterations | " + " | ".join(str(r.get("timed_steps", 0)) for r in results) + " |")
    out.append("| tokens/s (whole iteration) | " + " | ".join(fmt(r.get("tokens_per_s")) for r in results) + " |")
    out.append("| generated tokens/s | " + " | ".join(fmt(r.get("generated_tokens_per_s")) for r in results) + " |")
    out.append("| setup s (models + vLLM start) | " + " | ".join(fmt(r.get("setup_s"), 0) for r in results) + " |")
    if any(r.get("phase_memory_gb") for r in results):
        out += ["", "Peak memory per phase (GB): allocator peak in the process / device in use:", "", head, rule]
        for p in phases:
            cells = []
            for r in results:
                m = (r.get("phase_memory_gb") or {}).get(p)
                cells.append(f"{m['allocated_peak_gb']:.1f} / {m['device_used_peak_gb']:.1f}" if m else "-")
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        out.append("| **iteration** | " + " | ".join(
            f"**{fmt(r.get('max_memory_allocated_gb'), 1)} / {fmt(r.get('device_memory_used_peak_gb'), 1)}**"
            for r in results) + " |")
    errors = [f"- {r.get('variant')}: {r['error'][:300]}" for r in results if r.get("error")]
    if errors:
        out += [""] + errors
    out += ["", "Commands and bindings: in each JSON (`command`, `bindings`)."]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in args.files]
    text = "\n".join(tables(results)) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Side-by-side table of the peer benchmarks' JSON files (markdown).

    python bench/peers/make_table.py DIR [--out bench/results/peers_h200.md]

Reads DIR/*.json written by `bench/peers/{trl_grpo,engine,verl_ppo}.py` and writes, per work
(GRPO = TRL's, PPO = verl's; one section per model shape and LoRA rank), one row per system and
variant: median iteration time over the timed steps, the peer's time over ours ("x faster" > 1
means this engine is faster), tokens/s, generate-phase tokens/s, peak memory, then each system's
phases and the exact commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WORKS = {
    "grpo": ("GRPO: TRL's work", "trl", "32 prompts x 8 completions (256 sequences), 256-token prompts, 256 new "
             "tokens, reference model (KL 0.04), one optimizer step per generation batch, micro-batch 32, bf16, "
             "vLLM colocated on one GPU"),
    "ppo": ("PPO: verl's work", "verl", "256 prompts x 256 new tokens, 256-token prompts, critic + GAE, reference "
            "(KL in the reward, 0.05), mini-batch 64, micro-batch 32, one epoch, bf16, vLLM on the same GPU"),
}
ORDER = {"trl": 0, "verl": 0, "engine": 1}
# The same phase in every system's words: (label, {system: [keys summed]}).
PHASES = [
    ("generate", {"engine": ["generate"], "trl": ["_prepare_inputs>vLLM.generate", "vLLM.generate",
                                                  "_prepare_inputs>transformers.generate"], "verl": ["gen"]}),
    ("weight sync / engine switch", {"engine": ["sync_weights", "rollout_release"],
                                     "trl": ["_prepare_inputs>sync_weights", "sync_weights"],
                                     "verl": ["update_weights", "switch_to_rollout", "switch_to_trainer"]}),
    ("log-probs: old + reference", {"engine": ["old_logprobs", "reference"], "verl": ["old_log_prob", "ref"],
                                    "trl": ["_prepare_inputs>_get_per_token_logps_and_entropies"]}),
    ("values", {"engine": ["values"], "verl": ["values"]}),
    ("reward + advantages", {"engine": ["reward", "advantages"], "verl": ["reward", "adv"],
                             "trl": ["_prepare_inputs>_calculate_rewards"]}),
    ("update critic", {"engine": ["update_critic"], "verl": ["update_critic"]}),
    ("update actor", {"engine": ["update_actor"], "verl": ["update_actor"], "trl": ["@update"]}),
]


def skipped(d: Path) -> list[str]:
    return [f.name.split(".")[0] for f in sorted(d.glob("*.skipped.json"))]


def load(d: Path) -> list[dict]:
    out = []
    for f in sorted(d.glob("*.json")):
        try:
            r = json.loads(f.read_text())
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("system") in ORDER:
            r["_file"] = f.name
            out.append(r)
    return out


def fmt(x, nd=2, unit=""):
    if x is None:
        return "-"
    if isinstance(x, (int, float)):
        if abs(x) >= 1000:
            return f"{x:,.0f}{unit}"
        return f"{x:.{nd}f}{unit}"
    return str(x)


def name(r: dict) -> str:
    v = r.get("variant", "")
    label = {"trl": "TRL GRPOTrainer", "verl": "verl main_ppo", "engine": "this engine"}[r["system"]]
    return f"{label} ({v})" if v else label


def phase(r: dict, keys: list[str]):
    ph = r.get("median_phases_s") or {}
    if keys == ["@update"]:  # TRL: the step less its generation batch (_prepare_inputs): 8 x fwd+bwd + AdamW
        if r.get("median_step_s") and "_prepare_inputs" in ph:
            return r["median_step_s"] - ph["_prepare_inputs"]
        return None
    vals = [ph[k] for k in keys if k in ph]
    return sum(vals) if vals else None


def setting(r: dict) -> tuple:
    """(shape, LoRA rank) of a result: the 0.5B shape with full fine-tuning unless it says otherwise."""
    work = r.get("work") or {}
    return (work.get("shape") or "0.5b", int(work.get("lora_rank") or 0))


SHAPE_NAMES = {"0.5b": "Qwen2.5-0.5B", "7b": "Qwen2.5-7B", "tiny": "tiny"}


def table(rows: list[dict], peer: str) -> list[str]:
    """The section's rows. `peer / ours` is the reference's median time over each row's, the
    reference being the fastest row of the section's own peer (TRL for GRPO, verl for PPO), or of
    any peer when that one has no time; beneath, this engine against every peer's fastest row."""
    lines = ["| system (variant) | median s / iteration | peer / ours | tokens/s | generate tok/s | "
             "peak allocated GB | device peak in use GB | timed steps | first iteration s | setup s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fastest = {}  # system -> its fastest timed row
    for r in rows:
        if r.get("median_step_s") and (r["system"] not in fastest
                                       or r["median_step_s"] < fastest[r["system"]]["median_step_s"]):
            fastest[r["system"]] = r
    ref = fastest.get(peer) or min((r for s, r in fastest.items() if s != "engine"),
                                   key=lambda r: r["median_step_s"], default=None)
    for r in rows:
        t = r.get("median_step_s")
        if r["system"] == "engine" and ref and t:
            ratio = f"**{ref['median_step_s'] / t:.2f}x**"
        elif ref and t:
            ratio = f"{ref['median_step_s'] / t:.2f}" if r is not ref else "1 (reference)"
        else:
            ratio = "-"
        status = ""
        if r.get("error") or not t:
            status = " (failed: see its JSON)" if r.get("error") or not r.get("steps") else " (no timed step)"
        elif r.get("partial"):
            status = " (cut by its time limit)"
        lines.append(f"| {name(r)}{status} | {fmt(t)} | {ratio} | {fmt(r.get('tokens_per_s'))} | "
                     f"{fmt(r.get('generated_tokens_per_s'))} | {fmt(r.get('max_memory_allocated_gb'), 1)} | "
                     f"{fmt(r.get('gpu_memory_used_peak_gb'), 1)} | {r.get('timed_steps', 0)} | "
                     f"{fmt((r.get('all_step_s') or [None])[0])} | {fmt(r.get('setup_s'), 0)} |")
    if ref:
        lines.append("")
        lines.append(f"peer / ours: {name(ref)}'s median time ({fmt(ref['median_step_s'])} s) over each row's; "
                     f"above 1 the row is faster.")
        ours = fastest.get("engine")
        if ours:
            lines.append("This engine ({}, {} s) against each peer's fastest row: {}.".format(
                ours.get("variant", ""), fmt(ours["median_step_s"]), "; ".join(
                    f"{fmt(r['median_step_s'] / ours['median_step_s'])}x {name(r)}"
                    for s, r in sorted(fastest.items()) if s != "engine")))
    return lines


def phase_table(rows: list[dict]) -> list[str]:
    cols = [r for r in rows if r.get("median_phases_s")]
    if not cols:
        return []
    lines = ["| phase (median s) | " + " | ".join(name(r) for r in cols) + " |",
             "| --- |" + " ---: |" * len(cols)]
    for label, keys in PHASES:
        vals = [phase(r, keys.get(r["system"], [])) for r in cols]
        if any(v is not None for v in vals):
            lines.append(f"| {label} | " + " | ".join(fmt(v) for v in vals) + " |")
    lines.append("| other (the iteration less the phases above) | " + " | ".join(
        fmt(r["median_step_s"] - sum(v for v in (phase(r, keys.get(r["system"], [])) for _, keys in PHASES)
                                     if v is not None)) if r.get("median_step_s") else "-" for r in cols) + " |")
    lines.append("| **iteration** | " + " | ".join(f"**{fmt(r.get('median_step_s'))}**" for r in cols) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results = load(Path(args.dir))
    settings = sorted({setting(r) for r in results}) or [("0.5b", 0)]
    shapes = ", ".join(dict.fromkeys(SHAPE_NAMES.get(s, s) for s, _ in settings))
    gpus = " / ".join(sorted({r["versions"]["gpu"] for r in results if (r.get("versions") or {}).get("gpu")})) or "GPU"
    out = [f"# This engine beside TRL and verl on one {gpus} ({shapes} shape, random weights, bf16)", "",
           "Written by `bench/peers/make_table.py` from the JSON files beside it (one per system and "
           "variant, each with its exact command, versions, every step's time and the phases). All runs "
           "of one table come from one machine, one after the other on the same GPU (one device call unless "
           "the notes below say otherwise); medians over the "
           "steps after the warm-up. Memory: `torch.cuda.max_memory_allocated` of the process that trains "
           "(not reported for the Ray placements, whose ranks hold the GPU) and the device's peak memory in "
           "use (NVML, every process, vLLM's reservation of 0.3 of the GPU included).", ""]
    sections = [(algo, s) for algo in WORKS for s in settings]
    for algo, (shape, lora) in sections:
        title, peer, work = WORKS[algo]
        rows = sorted([r for r in results if r.get("algorithm") == algo and setting(r) == (shape, lora)],
                      key=lambda r: (ORDER[r["system"]], r.get("variant", "")))
        if not rows and results:  # a work nobody ran in this call (a table of no results keeps its sections)
            continue
        if len(settings) > 1 or settings[0] != ("0.5b", 0):
            title += f" ({SHAPE_NAMES.get(shape, shape)} shape" + (f", LoRA rank {lora}" if lora else "") + ")"
            if lora:
                work += (f"; LoRA rank {lora} on a frozen bf16 base (peft, every linear layer), reference = the base "
                         f"with the adapter off, gradient checkpointing")
        out += [f"## {title}", "", work + ".", ""]
        if not rows:
            out += ["No results yet.", ""]
            continue
        out += table(rows, peer) + [""]
        pt = phase_table(rows)
        if pt:
            out += pt + [""]
        for r in rows:
            if r.get("error"):
                first = r["error"].strip().splitlines()
                out += [f"- {name(r)} failed: `{(first[-1] if first else '')[:300]}`"]
            if r.get("handicaps"):
                out += [f"- {name(r)}: " + "; ".join(r["handicaps"])]
        out += ["", "Commands (run from the repo root on the device, `$ASSETS` the shared inputs):", ""]
        for r in rows:
            out.append(f"- `{r.get('command', '?')}`")
            if r.get("verl_command"):
                out.append(f"  - verl itself: `{r['verl_command']}`")
        vers = {}
        for r in rows:
            for k, v in (r.get("versions") or {}).items():
                if v:
                    vers.setdefault(k, set()).add(str(v))
        if vers:
            out += ["", "Versions: " + ", ".join(f"{k} {'/'.join(sorted(v))}" for k, v in sorted(vers.items())
                                                if k not in ("engine_git", "engine_sha256"))]
            if "engine_git" in vers:
                out.append(f"Engine commit: {', '.join(sorted(vers['engine_git']))}")
            if "engine_sha256" in vers:  # the engine's files (experiments.plan.code_version), whatever .git said
                out.append(f"Engine files sha256: {', '.join(sorted(vers['engine_sha256']))}")
        out.append("")
    if skipped(Path(args.dir)):
        out += ["Skipped for lack of time in the call: " + ", ".join(skipped(Path(args.dir))), ""]
    text = "\n".join(out).rstrip() + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

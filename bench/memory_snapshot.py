"""What the trainer's process holds on the GPU between two iterations of a shipped recipe (GPU; not a test).

The memory plan counts each phase's resident roles, micro-batch and a reserve (rlhf/memory/plan.py); a
measured phase can sit above it by what no formula names. This runs the recipe file bench/recipe_run.py
writes, in this process (`rlhf.trainer.PPOTrainer` with the allocator's settings, rlhf/allocator.py, as
`python -m rlhf.train` builds it), for --steps iterations (with `--stacks python`, torch's allocator
history on), then reads the allocator's snapshot at the end of the last iteration, once every phase has
given its cached blocks back: the state the next rollout starts from. It prints and writes (--json):

- torch's counters: allocated, reserved, inactive split bytes, segments;
- the memory held but not allocated, by segment (what empty_cache could not give back);
- the live blocks by size, and (`--stacks python`) grouped by where they were allocated (the deepest
  frame under rlhf/, else the deepest frame; blocks the history did not see are 'not recorded'),
  largest first, with their sizes: a workspace (cuBLAS's 32 MiB on Hopper) shows as blocks of one size.

    python bench/memory_snapshot.py --recipe models/instruct.gin --shape 0.5b --assets DIR \
        [--steps 2] [-b BINDING]... [--json OUT.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

MIB = 2 ** 20


def origin(frames: list[dict]) -> str:
    """'rlhf/roles/critic.py:112 update' for a block's stack (innermost frame first): the innermost
    frame in this project, else the innermost one."""
    ours = [f for f in frames if "/rlhf/" in f.get("filename", "")]
    f = (ours or frames or [{}])[0]
    name = f.get("filename", "?")
    name = name[name.rindex("/rlhf/") + 1:] if "/rlhf/" in name else name.rsplit("/", 2)[-1]
    return f"{name}:{f.get('line', '?')} {f.get('name', '')}".strip() if frames else "not recorded"


def summarize(snapshot: dict, stats: dict, top: int = 25) -> dict:
    """The allocator's snapshot (torch.cuda.memory._snapshot()) and memory_stats() as figures in MiB."""
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sizes: collections.Counter = collections.Counter()
    segments = []
    for seg in snapshot["segments"]:
        held = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        segments.append({"stream": seg.get("stream"), "pool": seg.get("segment_type"),
                         "total_mib": round(seg["total_size"] / MIB, 1), "allocated_mib": round(held / MIB, 1),
                         "free_mib": round((seg["total_size"] - held) / MIB, 1), "blocks": len(seg["blocks"])})
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                groups[origin(b.get("frames") or [])][b["size"]] += 1
                sizes[b["size"]] += 1
    by_origin = sorted(({"origin": k, "mib": round(sum(s * n for s, n in c.items()) / MIB, 1),
                         "sizes_mib": {f"{s / MIB:.2f}": n for s, n in c.most_common(4)}}
                        for k, c in groups.items()), key=lambda g: -g["mib"])
    segments.sort(key=lambda s: -s["free_mib"])
    return {
        "allocated_mib": round(stats.get("allocated_bytes.all.current", 0) / MIB, 1),
        "reserved_mib": round(stats.get("reserved_bytes.all.current", 0) / MIB, 1),
        "inactive_split_mib": round(stats.get("inactive_split_bytes.all.current", 0) / MIB, 1),
        "segments": len(snapshot["segments"]),
        "free_in_segments_mib": round(sum(s["free_mib"] for s in segments), 1),
        "segments_most_free": segments[:10],
        "allocated_by_origin": by_origin[:top],
        "allocated_by_size": [{"size_mib": round(s / MIB, 2), "blocks": n, "mib": round(s * n / MIB, 1)}
                              for s, n in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:top]],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="models/instruct.gin", help="the shipped model recipe the file includes")
    p.add_argument("--shape", default="0.5b", choices=("0.5b", "7b"))
    p.add_argument("--assets", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("-b", "--binding", action="append", default=[])
    p.add_argument("--json", default=None)
    p.add_argument("--stacks", choices=("none", "python"), default="none",
                   help="record where each block was allocated (torch's allocator history with Python stacks; "
                        "torch 2.11 fails inside a compiled autograd function with it: add "
                        "-b 'ppo.torch_compile = False')")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps} is invalid: 1 or more iterations")
    if args.prompts < 8 or args.prompts % 8:
        p.error(f"--prompts {args.prompts} is invalid: a multiple of 8 (8 generation calls an iteration)")
    if Path(args.assets).exists() and not Path(args.assets).is_dir():
        p.error(f"--assets {args.assets} is invalid: a file; give the inputs' directory (built there if missing)")
    if not (HERE.parent / "recipes" / args.recipe).is_file():
        p.error(f"--recipe {args.recipe}: no such recipe under recipes/")
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        p.error(f"--json {args.json} is invalid: a file path in an existing directory")
    from rlhf import allocator
    alloc_conf = allocator.configure()  # as `python -m rlhf.train` sets it, before CUDA starts
    import torch
    if not torch.cuda.is_available():
        print("bench/memory_snapshot.py needs a CUDA GPU: none is visible here", file=sys.stderr)
        return 2

    import recipe_run

    from rlhf import configurable
    from rlhf.trainer import PPOTrainer
    inputs = recipe_run.build(Path(args.assets), args.shape, tiny=False)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "recipe.gin"
        recipe.write_text(recipe_run.recipe_text(args.recipe, inputs, args.steps, args.prompts))
        cfg, _ = configurable.resolve(recipe, args.binding)
        if args.stacks == "python":
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
        trainer = PPOTrainer(cfg, Path(tmp) / "run", log=lambda m: print(m, file=sys.stderr, flush=True))
        while trainer.step < args.steps:
            trainer.step += 1
            record = trainer.train_step()
            print(f"step {trainer.step}: {record['timing_s/step']:.2f} s", flush=True)
        trainer.drain()
        torch.cuda.synchronize()
        result = {"recipe": args.recipe, "shape": args.shape, "bindings": args.binding, "steps": args.steps,
                  "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "alloc_conf": alloc_conf,
                  **summarize(torch.cuda.memory._snapshot(), torch.cuda.memory_stats())}
        close = getattr(trainer, "close", None)
        if callable(close):
            close()
    print(json.dumps({k: v for k, v in result.items() if k != "segments_most_free"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

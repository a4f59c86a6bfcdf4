"""Benchmark: real PPO iterations of the engine on one GPU, timed by phase (not a test).

    python bench/gpu_ppo.py --variant NAME=BINDING[;BINDING...] ... [--steps 3] [--json-dir bench/results]

Builds the rollout benchmark's inputs (a Qwen2.5-0.5B-shaped model with random weights, a
character tokenizer, 256-character prompts = 256 tokens), then runs `bench/ppo_step.py` on them
for each variant: 256 prompts x 256 new tokens per iteration with the vLLM backend, GAE with a
critic, mini-batches of 64, bf16 on the GPU. One JSON per variant, each with the exact command.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def base_bindings(assets: dict, train_path: str) -> list[str]:
    return [
        f"model.name_or_path = '{assets['model_dir']}'", f"model.tokenizer_path = '{assets['tokenizer_dir']}'",
        "task.name = 'file'", f"task.train_path = '{train_path}'", "task.reward_fn = 'exact_match'",
        "task.eval_size = 64", "task.eval_fraction = 0.1",
        "ppo.device = 'cuda'", "ppo.dtype = 'bfloat16'", "ppo.rollout_backend = 'vllm'",
        "ppo.max_prompt_length = 256", "ppo.max_response_length = 256",
        "ppo.rollout_micro_batch_size = 256", "ppo.num_rollout_batches = 1",
        "ppo.mini_batch_size = 64", "ppo.micro_batch_size = 16",
        "ppo.actor_learning_rate = 1e-6", "ppo.critic_learning_rate = 5e-6",
        "ppo.eval_every = 1000", "ppo.save_every = 1000",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=BINDING;BINDING (e.g. compiled=ppo.torch_compile = True)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--suffix", default="h200")
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU with the HF backend (smoke test)")
    p.add_argument("--rollout-parity", action="store_true",
                   help="one-process vLLM variants: also time vLLM's own generate on the same requests")
    p.add_argument("--variant-timeout", type=int, default=0, help="seconds per variant (0: none)")
    p.add_argument("--reward-model", default="", help="train against a reward model: 'random' (a one-output classifier "
                                                       "of the policy's shape, random weights) or a checkpoint dir")
    args = p.parse_args(argv)

    if len(args.variant) > 1:  # one process per variant: vLLM allows one sleep-mode engine per process
        import subprocess
        rest = [a for a in (sys.argv[1:] if argv is None else argv)]
        base = []
        skip = False
        for a in rest:
            if skip:
                skip = False
                continue
            if a == "--variant":
                skip = True
                continue
            if not a.startswith("--variant="):
                base.append(a)
        for spec in args.variant:
            try:
                subprocess.run([sys.executable, __file__, *base, "--variant", spec],
                               timeout=args.variant_timeout or None)
            except subprocess.TimeoutExpired:
                print(f"variant {spec} ran past {args.variant_timeout} s", file=sys.stderr)
        return 0

    import ppo_step
    from gpu_assets import build_assets, write_prompt_file

    root = Path(tempfile.mkdtemp(prefix="ppo-bench-"))
    assets = build_assets(root, tiny=args.tiny)
    train_path = write_prompt_file(root / "prompts.jsonl", 2048, 256)
    bindings = base_bindings(assets, train_path)
    if args.tiny:
        bindings += ["ppo.device = 'cpu'", "ppo.dtype = 'float32'", "ppo.rollout_backend = 'hf'",
                     "ppo.max_prompt_length = 16", "ppo.max_response_length = 8",
                     "ppo.rollout_micro_batch_size = 16", "ppo.mini_batch_size = 16", "task.eval_size = 8"]
    variants = args.variant or ["default="]
    command = "python bench/gpu_ppo.py " + " ".join(f"'{a}'" if " " in a else a
                                                   for a in (sys.argv[1:] if argv is None else argv))
    for spec in variants:
        name, _, extra = spec.partition("=")
        extra_bindings = [b.strip() for b in extra.split(";") if b.strip()]
        out = Path(args.json_dir) / f"gpu_ppo_{name}_{args.suffix}.json"
        try:
            parity = args.rollout_parity and not any("placement" in b for b in extra_bindings)
            ppo_step.main(["--recipe", str(REPO / "recipes" / "base" / "ppo.gin"), "--steps", str(args.steps),
                           "--json", str(out)] + (["--rollout-parity"] if parity else [])
                          + (["--reward-model", args.reward_model] if args.reward_model else [])
                          + [x for b in bindings + extra_bindings for x in ("-b", b)])
        except Exception as err:  # keep the other variants
            import traceback
            traceback.print_exc()
            out.write_text(json.dumps({"variant": name, "error": repr(err)[-2000:], "command": command}, indent=1))
            continue
        result = json.loads(out.read_text())
        result.update({"variant": name, "variant_bindings": extra_bindings, "command": command,
                       "workload": "256 prompts x 256 prompt tokens x 256 new tokens per iteration; "
                                   "Qwen2.5-0.5B shape, random weights; critic + reference; mini-batch 64, "
                                   "micro-batch 16"})
        result["bindings"] = [b.replace(str(root), "$ASSETS") for b in result.get("bindings", [])]
        out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

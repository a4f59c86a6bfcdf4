"""Benchmark: real PPO iterations of the engine on one GPU, timed by phase (not a test).

    python bench/gpu_ppo.py --variant NAME=BINDING[;BINDING...] ... [--steps 3] [--json-dir bench/results]
    python bench/gpu_ppo.py --preset lora7b|long2k [--assets DIR] [--variant ...] [--json-dir DIR] [--tiny]

Builds the rollout benchmark's inputs (a Qwen2.5-0.5B-shaped model with random weights, a
character tokenizer, 256-character prompts = 256 tokens), then runs `bench/ppo_step.py` on them
for each variant: 256 prompts x 256 new tokens per iteration with the vLLM backend, GAE with a
critic, mini-batches of 64, bf16 on the GPU. One JSON per variant, each with the exact command.

Presets (`--preset`; a preset fixes the shape, the workload's bindings, the variants, the steps
and the per-variant time limit; `--variant`, `--steps`, `--variant-timeout` override them):
- `lora7b`: the Qwen2.5-7B shape (random weights, drawn on the GPU by bench/gpu_assets.py),
  256 prompts x 256 tokens, 512 new tokens, LoRA rank 64 on actor and critic (frozen bf16 base,
  reference = the actor's base with the adapter off), gradient checkpointing, critic + reference,
  micro-batch 8 (forward-only 16), vLLM at 0.3 of the GPU; 1 warm-up + 2 timed iterations.
- `long2k`: the 0.5B shape, full fine-tuning, 2048 new tokens: a token budget of 16,384 tokens
  per micro-batch (`ppo.max_tokens_per_micro_batch`) against a fixed micro-batch of 8 sequences.
Presets record each phase's peak memory (`--phase-memory`), skip the final evaluation, and keep
their inputs in `--assets DIR` (default /tmp/assets-<shape>; built by a separate process when
missing, reused otherwise, shared with bench/peers/ of the same shape).

Every variant runs in its own process when there are several or a time limit is set (vLLM
allows one sleep-mode engine per process); `--total-time S` shares S between the variants (each
gets what is left over the variants still to run), `--variant-timeout` caps each; ppo_step gets
a variant's limit less 30 s as its budget, so it stops before an iteration that would pass it,
and its JSON is rewritten after every iteration. A variant whose feature bindings
(`ppo.max_tokens_per_micro_batch`, `ppo.lora_rank`, `ppo.gradient_checkpointing`) no engine
module reads yet is not run (its JSON says so) rather than timed on the default path.
`--tiny`: the tiny shape on the CPU with the HF backend (a smoke test of the same bindings,
lengths cut down).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

DEFAULT_WORKLOAD = ("256 prompts x 256 prompt tokens x 256 new tokens per iteration; Qwen2.5-0.5B shape, random "
                    "weights; critic + reference; mini-batch 64, micro-batch 16")

# Each variant: (name, bindings on the GPU, bindings that replace them under --tiny).
PRESETS = {
    "lora7b": dict(
        shape="7b", steps=2, variant_timeout=560, phase_memory=True, no_eval=True,
        bindings=["ppo.max_response_length = 512", "ppo.lora_rank = 64", "ppo.lora_alpha = 128.0",
                  "ppo.lora_dropout = 0.0", "ppo.lora_target_modules = 'all-linear'", "ppo.critic_lora_rank = -1",
                  "ppo.gradient_checkpointing = True", "ppo.micro_batch_size = 8", "ppo.forward_micro_batch_size = 16",
                  "ppo.vllm_gpu_memory_utilization = 0.3", "ppo.torch_threads = 8"],
        tiny_bindings=["ppo.micro_batch_size = 4", "ppo.forward_micro_batch_size = 8", "ppo.lora_rank = 8",
                       "ppo.lora_alpha = 16.0"],
        variants=[("lora7b_r64_gc", [], [])],
        workload="256 prompts x 256 prompt tokens x 512 new tokens per iteration; Qwen2.5-7B shape "
                 "(7.6B parameters), random weights, frozen bf16 base; LoRA rank 64 (alpha 128, every linear "
                 "layer of the blocks) on actor and critic, reference = the actor's base with the adapter off; "
                 "gradient checkpointing; critic + reference; mini-batch 64, micro-batch 8 (forward-only 16); "
                 "vLLM at 0.3 of the GPU, merged weights synced every iteration"),
    "long2k": dict(
        shape="0.5b", steps=2, variant_timeout=275, phase_memory=True, no_eval=True,
        bindings=["ppo.max_response_length = 2048", "ppo.torch_threads = 8"],
        tiny_bindings=["ppo.micro_batch_size = 4"],
        variants=[("long2k_budget16k", ["ppo.max_tokens_per_micro_batch = 16384"],
                   ["ppo.max_tokens_per_micro_batch = 64"]),
                  ("long2k_mb8", ["ppo.micro_batch_size = 8"], ["ppo.micro_batch_size = 8"])],
        workload="256 prompts x 256 prompt tokens x 2048 new tokens per iteration; Qwen2.5-0.5B shape, random weights; "
                 "full fine-tuning (fp32 weights, bf16 autocast); critic + reference; mini-batch 64; micro-batches by "
                 "variant (a fixed number of sequences, or a token budget packed without padding); vLLM at 0.3 of the "
                 "GPU"),
}


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


TINY_BINDINGS = ["ppo.device = 'cpu'", "ppo.dtype = 'float32'", "ppo.rollout_backend = 'hf'",
                 "ppo.max_prompt_length = 16", "ppo.max_response_length = 8",
                 "ppo.rollout_micro_batch_size = 16", "ppo.mini_batch_size = 16", "task.eval_size = 8"]


def preset_variant_specs(preset: dict, tiny: bool) -> list[str]:
    return [f"{name}=" + "; ".join(tiny_b if tiny else gpu_b) for name, gpu_b, tiny_b in preset["variants"]]


def ensure_assets(root: Path, shape: str, tiny: bool) -> None:
    """Builds the model and tokenizer in root in a separate process (a GPU build must not share the
    benchmark's process, nor a vLLM engine start after it) unless root holds a model already
    (whose shape build_assets checks)."""
    if (root / "model" / "config.json").is_file():
        return
    cmd = [sys.executable, str(REPO / "bench" / "gpu_assets.py"), "--shape", shape, "--out", str(root)]
    subprocess.run(cmd + (["--tiny"] if tiny else []), check=True)


WIRED_CHECK = ("max_tokens_per_micro_batch", "lora_rank", "gradient_checkpointing")


def unwired(bindings: list[str]) -> list[str]:
    """The bindings among WIRED_CHECK, set to a non-default value, that no engine module reads
    besides rlhf/config.py: in a checkout where a feature is declared but not yet implemented, a
    variant would otherwise time the default path under the feature's name."""
    out = []
    sources = [p.read_text() for p in (REPO / "rlhf").rglob("*.py") if p.name != "config.py"]
    for b in bindings:
        key, _, value = b.partition("=")
        name = key.strip().removeprefix("ppo.")
        if name in WIRED_CHECK and value.strip() not in ("0", "False", "") \
                and not any(f".{name}" in src for src in sources):
            out.append(b.strip())
    return out


def annotate(out: Path, name: str, extra: list, command: str, workload: str, root: str | None,
             error: str | None = None) -> None:
    """The variant's name, bindings, command and workload in its JSON (also one cut by its time limit)."""
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"error": error or "no result written (cut by the time limit before the first timed iteration?)"}
    if error and result.get("partial"):
        result["stopped"] = error
    if root:
        result["bindings"] = [b.replace(str(Path(root).resolve()), "$ASSETS").replace(str(root), "$ASSETS")
                              for b in result.get("bindings", [])]
    result.update({"variant": name, "variant_bindings": extra, "command": command, "workload": workload})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=BINDING;BINDING (e.g. compiled=ppo.torch_compile = True)")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None, help="a named workload (see the docstring)")
    p.add_argument("--shape", choices=("0.5b", "7b"), default=None, help="model shape (default: the preset's, or 0.5b)")
    p.add_argument("--assets", default=None, help="directory of the inputs, built by a separate process if missing "
                                                  "(default with --preset: /tmp/assets-<shape>; else a fresh temp dir)")
    p.add_argument("--steps", type=int, default=None, help="timed iterations after the warm-up (default 3; presets 2)")
    p.add_argument("--json-dir", default=str(REPO / "bench" / "results"))
    p.add_argument("--suffix", default="h200")
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU with the HF backend (smoke test)")
    p.add_argument("--rollout-parity", action="store_true",
                   help="one-process vLLM variants: also time vLLM's own generate on the same requests")
    p.add_argument("--variant-timeout", type=int, default=None, help="seconds per variant (0: none; presets set one)")
    p.add_argument("--reward-model", default="", help="train against a reward model: 'random' (a one-output classifier "
                                                       "of the policy's shape, random weights) or a checkpoint dir")
    p.add_argument("--phase-memory", action="store_true", help="peak memory of every phase (presets: on)")
    p.add_argument("--no-eval", action="store_true", help="skip the final evaluation (presets: on)")
    p.add_argument("--profile", action="store_true", help="one-process variants: one more iteration under "
                                                               "torch.profiler (bench/ppo_step.py --profile), into "
                                                               "JSON_DIR/profile_<variant>_<suffix>/")
    p.add_argument("--total-time", type=int, default=0, help="seconds for all the variants together: each gets what "
                                                               "is left divided by the variants still to run")
    p.add_argument("--time-budget", type=float, default=0.0, help=argparse.SUPPRESS)  # set for each variant process
    args = p.parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)
    command = os.environ.get("GPU_PPO_COMMAND") or "python bench/gpu_ppo.py " + " ".join(
        f"'{a}'" if " " in a else a for a in raw)

    preset = PRESETS[args.preset] if args.preset else None
    shape = args.shape or (preset["shape"] if preset else "0.5b")
    steps = args.steps if args.steps is not None else (preset["steps"] if preset else 3)
    timeout = args.variant_timeout if args.variant_timeout is not None else (preset["variant_timeout"] if preset else 0)
    phase_memory = args.phase_memory or bool(preset and preset["phase_memory"])
    no_eval = args.no_eval or bool(preset and preset["no_eval"])
    variants = args.variant or (preset_variant_specs(preset, args.tiny) if preset else ["default="])
    assets_dir = args.assets or (f"/tmp/assets-{'tiny' if args.tiny else shape}" if preset else None)
    workload = preset["workload"] if preset else DEFAULT_WORKLOAD

    if len(variants) > 1 or ((timeout or args.total_time) and not args.time_budget):  # one process per variant
        deadline = time.time() + args.total_time if args.total_time else None
        if assets_dir:
            ensure_assets(Path(assets_dir), shape, args.tiny)
        base, skip = [], False
        for a in raw:
            if skip:
                skip = False
                continue
            if a in ("--variant", "--total-time"):
                skip = True
                continue
            if not a.startswith(("--variant=", "--total-time=")):
                base.append(a)
        if assets_dir and not args.assets:
            base += ["--assets", assets_dir]
        env = dict(os.environ, GPU_PPO_COMMAND=command)
        runnable = []
        for spec in variants:
            name, _, extra = spec.partition("=")
            out = Path(args.json_dir) / f"gpu_ppo_{name}_{args.suffix}.json"
            out.unlink(missing_ok=True)  # a stale result must not pass for this run's
            missing = unwired((preset["bindings"] if preset else []) + extra.split(";"))
            if missing:
                msg = f"not run: this checkout's engine reads none of {missing} (declared in rlhf/config.py only)"
                print(f"variant {name}: {msg}", file=sys.stderr, flush=True)
                annotate(out, name, [b.strip() for b in extra.split(";") if b.strip()], command, workload,
                         assets_dir, msg)
            else:
                runnable.append((spec, name, extra, out))
        for i, (spec, name, extra, out) in enumerate(runnable):
            limit = timeout
            if deadline is not None:  # what is left, shared by the variants still to run
                share = int((deadline - time.time()) / (len(runnable) - i))
                limit = min(limit, share) if limit else share
                if limit < 60:
                    annotate(out, name, [b.strip() for b in extra.split(";") if b.strip()], command, workload,
                             assets_dir, f"not run: {limit} s left of --total-time")
                    continue
            child = [sys.executable, __file__, *base, "--variant", spec]
            if limit:
                child += ["--time-budget", str(max(limit - 30, 1))]
            t0 = time.time()
            error = None
            try:
                rc = subprocess.run(child, timeout=limit or None, env=env).returncode
                if rc:
                    error = f"variant process exited with {rc}"
            except subprocess.TimeoutExpired:
                error = f"variant ran past {limit} s"
                print(f"variant {spec} ran past {limit} s", file=sys.stderr)
            annotate(out, name, [b.strip() for b in extra.split(";") if b.strip()], command, workload, assets_dir,
                     error)
            print(f"variant {name}: {time.time() - t0:.0f} s (limit {limit} s), {out}", file=sys.stderr, flush=True)
        return 0

    import ppo_step
    from gpu_assets import build_assets, write_prompt_file

    if assets_dir:
        root = Path(assets_dir)
        ensure_assets(root, shape, args.tiny)
        assets = build_assets(root, tiny=args.tiny, shape=shape)  # reuses what ensure_assets wrote
        prompts_name = "gpu_ppo_prompts.jsonl"  # prompts.jsonl in a shared directory is bench/peers' file
    else:
        root = Path(tempfile.mkdtemp(prefix="ppo-bench-"))
        assets = build_assets(root, tiny=args.tiny, shape=shape)
        prompts_name = "prompts.jsonl"
    # --tiny: ppo.max_prompt_length 16
    train_path = write_prompt_file(root / prompts_name, 2048, 16 if args.tiny else 256)
    bindings = base_bindings(assets, train_path) + (preset["bindings"] if preset else [])
    if args.tiny:
        bindings += TINY_BINDINGS + (preset["tiny_bindings"] if preset else [])
    for spec in variants:
        name, _, extra = spec.partition("=")
        extra_bindings = [b.strip() for b in extra.split(";") if b.strip()]
        out = Path(args.json_dir) / f"gpu_ppo_{name}_{args.suffix}.json"
        try:
            parity = args.rollout_parity and not any("placement" in b for b in extra_bindings)
            profile = (["--profile", str(Path(args.json_dir) / f"profile_{name}_{args.suffix}")]
                       if args.profile and not any("placement" in b for b in extra_bindings) else [])
            ppo_step.main(["--recipe", "", "--steps", str(steps),
                           "--json", str(out)] + (["--rollout-parity"] if parity else []) + profile
                          + (["--reward-model", args.reward_model] if args.reward_model else [])
                          + (["--time-budget", str(args.time_budget)] if args.time_budget else [])
                          + (["--phase-memory"] if phase_memory else []) + (["--no-eval"] if no_eval else [])
                          + [x for b in bindings + extra_bindings for x in ("-b", b)])
        except Exception as err:  # keep the other variants
            import traceback
            traceback.print_exc()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"variant": name, "error": repr(err)[-2000:], "command": command}, indent=1))
            continue
        result = json.loads(out.read_text())
        result.update({"variant": name, "variant_bindings": extra_bindings, "command": command,
                       "workload": workload, "shape": "tiny" if args.tiny else shape})
        result["bindings"] = [b.replace(str(root), "$ASSETS") for b in result.get("bindings", [])]
        out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

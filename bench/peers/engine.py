"""This engine on the peers' work, timed the same way (not a test).

    python bench/peers/engine.py --assets DIR --algo grpo|ppo --placement local|colocated \
        --json OUT.json [--warmup 1] [--steps 3] [--shape 0.5b|7b] [--lora-rank 64] [-b BINDING]...

--algo grpo: TRL's work (`bench/peers/trl_grpo.py`): 32 prompts x 8 samples, 256-token prompts,
  256 new tokens, group-relative advantages (`ppo.adv_estimator = 'grpo'`, divided by the group's
  std, no further whitening), KL to the reference as a loss term with the k3 estimator at 0.04
  (TRL's beta), one optimizer step per generation batch (mini-batch 256), micro-batch 32, lr 1e-6.
--algo ppo: verl's work (`bench/peers/verl_ppo.py`): 256 prompts x 256 new tokens, critic + GAE,
  KL in the reward (k1, 0.05) so a reference model runs, mini-batches of 64, micro-batch 32.

Both: the shared inputs of `bench/peers/common.py` (Qwen2.5-0.5B shape, or `--shape 7b` the
Qwen2.5-7B shape, random weights, the full-vocabulary tokenizer, prompts of exactly 256 tokens),
vLLM rollouts at 0.3 of the GPU's memory, bf16, `ppo.torch_compile = True` (this engine's fast
path; `-b 'ppo.torch_compile = False'` for eager).
--lora-rank R (TRL's `--lora-rank`): LoRA adapters of rank R (alpha `--lora-alpha`, 2R by default,
  every linear layer of the blocks, no dropout) on a frozen bf16 base, the reference being that
  base with the adapter off, gradient checkpointing on, eager (`ppo.torch_compile = False`, as TRL
  runs); vLLM gets the merged weights every iteration.
--recipe models/lora.gin: the work on a shipped model recipe as a user runs it: the recipe sets how it
  is computed (its LoRA, packed token budgets, checkpointing, compiled layers, vLLM sleep); the work's
  bindings above set what is computed (and `--lora-rank`, when given, the adapters' rank and alpha).
--placement local: every role in the run's process; colocated: Ray ranks (world size 1)
sharing one GPU bundle (`ppo.offload_idle_models = 'auto'`, the default: every model fits here, so
none is offloaded; `-b 'ppo.offload_idle_models = True'` forces offloading).

The run is the user's command: the work is written as a recipe file (the model recipe included, then
the work's bindings; `recipe_file` in the JSON) and run by `python -m rlhf.train FILE --out DIR`, with
-b bindings passed on its command line. Each iteration's `timing_s/*` phases come from the run's
metrics.jsonl; the JSON is rewritten as each iteration lands.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import REPO  # noqa: E402

WORK = {
    "grpo": dict(prompts_per_step=32, samples_per_prompt=8, prompt_tokens=256, max_new_tokens=256,
                 mini_batch=256, micro_batch=32, kl="loss term, k3, 0.04", learning_rate=1e-6),
    "ppo": dict(prompts_per_step=256, samples_per_prompt=1, prompt_tokens=256, max_new_tokens=256,
                mini_batch=64, micro_batch=32, kl="in reward, k1, 0.05", actor_learning_rate=1e-6,
                critic_learning_rate=5e-6),
}


def lora_bindings(rank: int, alpha: float, speed: bool = True) -> list[str]:
    """What the adapters train (rank, alpha, every linear layer, no dropout) and, with `speed`, how: TRL's
    way (gradient checkpointing, eager)."""
    what = [f"ppo.lora_rank = {rank}", f"ppo.lora_alpha = {float(alpha)}", "ppo.lora_dropout = 0.0",
            "ppo.lora_target_modules = 'all-linear'", "ppo.critic_lora_rank = -1"]
    return what + (["ppo.gradient_checkpointing = True", "ppo.torch_compile = False"] if speed else [])


def bindings(inputs: dict, algo: str, placement: str, tiny: bool = False, lora_rank: int = 0,
             lora_alpha: float = 0.0, recipe: str | None = None) -> list[str]:
    b = [
        f"model.name_or_path = '{inputs['model_dir']}'", f"model.tokenizer_path = '{inputs['tokenizer_dir']}'",
        "task.name = 'file'", f"task.train_path = '{inputs['prompts_jsonl']}'", "task.reward_fn = 'exact_match'",
        "task.eval_size = 64", "task.eval_fraction = 0.1",
        "ppo.device = 'cuda'", "ppo.dtype = 'bfloat16'", "ppo.rollout_backend = 'vllm'",
        "ppo.vllm_gpu_memory_utilization = 0.3",
        "ppo.max_prompt_length = 256", "ppo.max_response_length = 256", "ppo.temperature = 1.0",
        "ppo.num_rollout_batches = 1", "ppo.ppo_epochs = 1",
        "ppo.eval_every = 100000", "ppo.save_every = 100000", "ppo.seed = 0",
    ]
    if algo == "grpo":
        b += ["ppo.adv_estimator = 'grpo'", "ppo.rollout_micro_batch_size = 32", "ppo.samples_per_prompt = 8",
              "ppo.grpo_normalize_std = True", "ppo.whiten_advantages = False",
              "ppo.kl_mode = 'loss'", "ppo.kl_estimator = 'k3'", "ppo.kl_coef = 0.04", "ppo.adaptive_kl = False",
              "ppo.mini_batch_size = 256", "ppo.micro_batch_size = 32", "ppo.actor_learning_rate = 1e-6",
              "ppo.clip_range = 0.2", "ppo.loss_aggregation = 'token_mean'"]
    else:
        b += ["ppo.adv_estimator = 'gae'", "ppo.rollout_micro_batch_size = 256", "ppo.samples_per_prompt = 1",
              "ppo.kl_mode = 'reward'", "ppo.kl_estimator = 'k1'", "ppo.kl_coef = 0.05", "ppo.adaptive_kl = False",
              "ppo.gamma = 1.0", "ppo.lam = 1.0", "ppo.whiten_advantages = True",
              "ppo.mini_batch_size = 64", "ppo.micro_batch_size = 32",
              "ppo.actor_learning_rate = 1e-6", "ppo.critic_learning_rate = 5e-6",
              "ppo.clip_range = 0.2", "ppo.value_clip_range = 0.5", "ppo.loss_aggregation = 'token_mean'"]
    b += [f"ppo.placement = '{placement}'", "ppo.world_size = 1"]
    if not recipe:  # a recipe says how the work is computed itself
        b.append("ppo.torch_compile = True")
    if lora_rank:
        b += lora_bindings(lora_rank, lora_alpha or 2 * lora_rank, speed=not recipe)
    if tiny:
        b += ["ppo.device = 'cpu'", "ppo.dtype = 'float32'", "ppo.rollout_backend = 'hf'", "ppo.torch_compile = False",
              "ppo.max_prompt_length = 16", "ppo.max_response_length = 8", "task.eval_size = 8"]
        if algo == "grpo":
            b += ["ppo.rollout_micro_batch_size = 4", "ppo.samples_per_prompt = 4", "ppo.mini_batch_size = 16",
                  "ppo.micro_batch_size = 8"]
        else:
            b += ["ppo.rollout_micro_batch_size = 16", "ppo.mini_batch_size = 8", "ppo.micro_batch_size = 4"]
    return b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--assets", required=True, help="directory for the shared inputs (built if missing)")
    p.add_argument("--algo", choices=("grpo", "ppo"), required=True)
    p.add_argument("--placement", choices=("local", "colocated"), default="local")
    p.add_argument("--json", required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("-b", "--binding", action="append", default=[], help="extra gin bindings (last wins)")
    p.add_argument("--variant", default=None, help="name in the JSON (default: the placement, with _lora<R>)")
    p.add_argument("--shape", choices=("0.5b", "7b"), default="0.5b", help="model shape of the shared inputs")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank of the actor (and critic); 0: full fine-tuning")
    p.add_argument("--lora-alpha", type=float, default=0.0, help="LoRA alpha (default: twice the rank)")
    p.add_argument("--recipe", default=None, help="a shipped model recipe under recipes/ (e.g. models/lora.gin) that "
                   "sets how the work is computed")
    p.add_argument("--out", default=None, help="the run directory, kept (default: a temporary one); its recipe file "
                   "is written beside it")
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU, HF generate (smoke test)")
    p.add_argument("--config-only", action="store_true", help="resolve and validate the bindings, then exit")
    args = p.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    # What the user gave is checked before the inputs are built (minutes at 7B).
    if args.recipe and not (REPO / "recipes" / args.recipe).is_file():
        p.error(f"--recipe {args.recipe}: no such recipe under recipes/")
    if args.out and Path(args.out).exists() and (not Path(args.out).is_dir() or any(Path(args.out).iterdir())):
        p.error(f"--out {args.out}: {'not empty' if Path(args.out).is_dir() else 'a file'}; give a new run directory")
    if Path(args.assets).exists() and not Path(args.assets).is_dir():
        p.error(f"--assets {args.assets}: a file; give the inputs' directory (built there if missing)")

    t0 = time.perf_counter()
    inputs = common.build_inputs(args.assets, tiny=args.tiny, shape=args.shape)
    common.check_assets(inputs)
    work = bindings(inputs, args.algo, args.placement, args.tiny, args.lora_rank, args.lora_alpha, args.recipe)

    from rlhf import configurable
    from rlhf.errors import ConfigError

    root = str(Path(args.assets).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.out).resolve() if args.out else Path(tmp) / "run"
        recipe_file = run_dir.parent / f"{run_dir.name}.gin"
        recipe_file.parent.mkdir(parents=True, exist_ok=True)
        recipe_file.write_text(work_recipe(args.recipe, work, args.warmup + args.steps))
        try:
            cfg, _ = configurable.resolve(recipe_file, args.binding)
        except ConfigError as err:
            p.error(f"-b: {err}")
        print(f"engine {args.algo} {args.placement}: rollout buffer {cfg.ppo.rollout_batch_size}, mini-batch "
              f"{cfg.ppo.mini_batch_size}, micro-batch {cfg.ppo.micro_batch_size}, placement "
              f"{cfg.ppo.resolved_placement}, critic {'yes' if cfg.ppo.uses_critic else 'no'}, shape "
              f"{inputs['shape']}, lora rank {cfg.ppo.lora_rank}, gradient checkpointing "
              f"{cfg.ppo.gradient_checkpointing}", flush=True)
        if args.config_only:
            return 0
        result = {
            "system": "engine", "algorithm": args.algo,
            "variant": args.variant or args.placement + (f"_lora{args.lora_rank}" if args.lora_rank else ""),
            "placement": args.placement, "command": common.command_line(argv),
            "work": dict(WORK[args.algo], tiny=args.tiny, shape=inputs["shape"], lora_rank=cfg.ppo.lora_rank,
                         lora_alpha=cfg.ppo.lora_alpha if cfg.ppo.lora_rank else None,
                         gradient_checkpointing=cfg.ppo.gradient_checkpointing, torch_compile=cfg.ppo.torch_compile,
                         max_tokens_per_micro_batch=cfg.ppo.max_tokens_per_micro_batch),
            "recipe": args.recipe or "",  # else the engine defaults (rlhf/config.py) and the bindings
            "bindings": [b.replace(root, "$ASSETS") for b in work + args.binding],
            "recipe_file": recipe_file.read_text().replace(root, "$ASSETS"),
            "versions": common.versions("gin-config"),
            "steps": [],
        }
        cmd = [sys.executable, "-m", "rlhf.train", str(recipe_file), "--out", str(run_dir), "--quiet"]
        for b in args.binding:
            cmd += ["-b", b]
        result["train_command"] = " ".join(["python", "-m", "rlhf.train", recipe_file.name, "--out", run_dir.name,
                                            "--quiet"] + [f"-b {b!r}" for b in args.binding])
        return train_and_time(cmd, run_dir, result, args, t0)


def work_recipe(recipe: str | None, bindings_: list[str], steps: int) -> str:
    """The recipe file a user writes for the work: the shipped model recipe included (when given), then
    the work's bindings, then the iteration count."""
    head = [f"include '{recipe}'"] if recipe else []
    return "\n".join(head + bindings_ + [f"ppo.total_steps = {steps}", ""])


def train_and_time(cmd: list[str], run_dir: Path, result: dict, args, t0: float) -> int:
    """Runs `python -m rlhf.train` (its own process, as a user runs it) and rewrites the JSON from its
    metrics.jsonl as each iteration lands: the iteration and phase times (`timing_s/*`) are the engine's
    own. The device-wide peak (`gpu_memory_used_peak_gb`) is sampled from here, restarted when the warm-up
    iterations are done, so it covers the timed iterations and the final evaluation; the JSON says when it
    came (`gpu_memory_peak_at_s`, beside each step's `seen_at_s`) and which processes held the device then."""
    from rlhf.metrics import read_metrics

    gpu = common.GPUMemorySampler().start()

    def finish(partial: bool, records: list[dict]):
        steps = [{**{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
                  "gpu_memory_used_peak_gb": gpu.peak_gb if i >= args.warmup else None,
                  "seen_at_s": seen_at.get(r["step"])}
                 for i, r in enumerate(records)]
        result["steps"] = steps
        result.update(common.summarize([s["timing_s/step"] for s in steps], args.warmup))
        timed = steps[args.warmup:]
        if timed:
            # the final evaluation is timed apart from its iteration (timing_s/eval), not a phase of the work
            keys = sorted({k for s in timed for k in s if k.startswith("timing_s/") and k != "timing_s/eval"})
            result["median_phases_s"] = {k.split("/", 1)[1]: statistics.median(s[k] for s in timed if k in s)
                                         for k in keys}
            result["tokens_per_s"] = statistics.median(s["perf/tokens_per_s"] for s in timed)
            result["generated_tokens_per_s"] = statistics.median(s["perf/generated_tokens_per_s"] for s in timed)
            result["response_length_mean"] = statistics.mean(s["response_length_mean"] for s in timed)
            mem = [s["perf/max_memory_allocated_gb"] for s in timed if "perf/max_memory_allocated_gb" in s]
            result["max_memory_allocated_gb"] = max(mem) if mem else None
            result["gpu_memory_used_peak_gb"] = gpu.peak_gb or None
            # when the device's peak came (seconds from the command's start, beside each step's `seen_at_s`)
            # and which processes held the device then
            result["gpu_memory_peak_at_s"] = round(gpu.peak_at - t0, 1) if gpu.peak_at else None
            result["gpu_memory_peak_processes"] = gpu.peak_processes
        result["partial"] = partial
        common.write_json(args.json, result)

    def records() -> list[dict]:
        path = run_dir / "metrics.jsonl"
        return [r for r in read_metrics(path) if r.get("step", 0) > 0] if path.is_file() else []

    print(f"[engine] {' '.join(cmd)}", flush=True)
    # In this script's process group, so that a part's time limit (`timeout`, a group kill) stops the run
    # too; a SIGTERM to this script alone stops it through the `finally` below.
    proc = subprocess.Popen(cmd, cwd=str(REPO))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seen: list[dict] = []
    seen_at: dict[int, float] = {}  # step -> seconds from t0 when this script saw it in metrics.jsonl
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            now = records()
            if len(now) > len(seen):
                if not seen:  # the first iteration's end less its own time: building the roles, vLLM, evaluation
                    result["setup_s"] = round(time.perf_counter() - t0 - now[0]["timing_s/step"], 1)
                if len(seen) < args.warmup <= len(now):
                    gpu.reset()
                for r in now[len(seen):]:
                    seen_at[r["step"]] = round(time.perf_counter() - t0, 1)
                    print(f"step {r['step']}: {r['timing_s/step']:.2f} s", flush=True)
                seen = now
                finish(True, seen)
    finally:
        if proc.poll() is None:  # this script stopped (a part's time limit): stop the run with it
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    gpu.stop()
    result["exit_code"] = proc.returncode
    result.update(common.run_plan(run_dir))
    finish(proc.returncode != 0, records())
    print(f"engine {args.algo} ({result['variant']}): median {result.get('median_step_s')} s per iteration over "
          f"{result.get('timed_steps')}; rlhf.train exit {proc.returncode}; wrote {args.json}", flush=True)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

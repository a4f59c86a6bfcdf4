"""A shipped recipe as a user runs it, timed: `python -m rlhf.train` on a recipe file that includes the
shipped model recipe and the verl GSM8K task, as a user writes it (not a test).

    python bench/recipe_run.py --recipe models/lora.gin --shape 7b --assets DIR --out RUN_DIR \
        --json OUT.json [--steps 10] [--prompts 256] [--time-budget S] [--profile STEP] [-b BINDING]...

Inputs (`bench/peers/common.py`, built once per DIR): the Qwen2.5 shape with random bf16 weights and
the full-vocabulary tokenizer saved beside them (the user's instruct-model directory), and GSM8K-
shaped rows in verl's parquet format (`data_source`, `prompt` as chat messages, `reward_model.
ground_truth`) whose prompts render to exactly 256 tokens. The recipe file written beside the run:

    include 'models/lora.gin'
    include 'tasks/gsm8k_verl.gin'
    model.name_or_path = '<DIR>/model'
    task.train_path = '<DIR>/gsm8k/train.parquet'
    task.eval_path = '<DIR>/gsm8k/test.parquet'
    task.eval_size = 64
    ppo.rollout_micro_batch_size = 32        # 256 prompts an iteration (--prompts)
    ppo.total_steps = 10
    ppo.eval_every = 1000                    # evaluated before the first and after the last iteration
    ppo.save_every = 5                       # --resume continues a run cut by --time-budget

A run dir that holds checkpoints is resumed (`--resume`), so a run longer than one device call
finishes over several. The JSON (rewritten at the end of every call) holds the command, the steps
completed, the median iteration and per-phase times over the iterations after the first (and how busy
the host thread that ran each phase was: `perf/host_busy/<phase>`; on Ray the rank's, beside the time the
phase's calls ran on the slowest rank, `perf/rank_s/<phase>`), tokens/s
(prompt + response tokens of an iteration over its wall time), and for each phase the memory plan's
prediction (`python -m rlhf.memory`: resident roles + awake engine + the phase's micro-batch) beside
the peaks torch measured, allocated (`perf/memory_gb/<phase>`) and reserved (`perf/memory_reserved_gb/<phase>`),
beside the plan's figures for each (`planned_gb`, `planned_reserved_gb`); and the device's own peak over the
whole command, every process's memory (`gpu_memory_used_peak_gb`, NVML or nvidia-smi), with the processes that
held it then (`gpu_memory_peak_processes`). `bindings` (-b) are recorded, and
`--replan` uses them: a result stays the plan of the configuration it measured when the recipe changes.
The run's own resolved `config.gin` is kept too (`config_gin`): with it a later replan reads every setting
as the run had it, not the `include`d recipes as they are then (`result_config`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE / "peers"))

from rlhf.run_dir import PROFILE_DIR  # noqa: E402


def build(assets: Path, shape: str, tiny: bool) -> dict:
    import common
    inputs = common.build_inputs(assets, tiny=tiny, shape=shape)
    prompts = common.prompt_texts(common.N_PROMPTS, inputs["prompt_tokens"], vocab_size=inputs["vocab_size"])
    data = assets / "gsm8k"
    if not (data / "test.parquet").is_file():
        answers = [str(i % 100) for i in range(len(prompts))]
        for name, rows in (("train", slice(None, -256)), ("test", slice(-256, None))):
            common.write_verl_parquet(data / f"{name}.parquet", prompts[rows], data_source="openai/gsm8k",
                                      ability="math", answers=answers[rows])
    return {**inputs, "train": str(data / "train.parquet"), "test": str(data / "test.parquet")}


def recipe_text(recipe: str, inputs: dict, steps: int, prompts: int) -> str:
    return "\n".join([
        f"include '{recipe}'", "include 'tasks/gsm8k_verl.gin'",
        f"model.name_or_path = '{inputs['model_dir']}'",
        f"task.train_path = '{inputs['train']}'", f"task.eval_path = '{inputs['test']}'",
        "task.eval_size = 64",
        f"ppo.rollout_micro_batch_size = {prompts // 8}", "ppo.num_rollout_batches = 8",
        f"ppo.total_steps = {steps}", "ppo.eval_every = 1000", "ppo.save_every = 5", ""])


SHAPES = {"0.5b": "qwen2.5-0.5b", "7b": "qwen2.5-7b"}


def result_config(result: dict):
    """A result's configuration: the run's own `config.gin` (`config_gin`, every setting as the run resolved
    it: what it measured, whatever recipes/ says now) when the result holds it, else its recipe file, whose
    `include`s are read from recipes/ as it is now; with its bindings (-b) on top (on `config_gin`, which
    already holds them, the same values again). bench/phase_limits.py reads results with it too."""
    import tempfile

    from rlhf import configurable
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "recipe.gin"
        recipe.write_text(result.get("config_gin") or result["recipe_file"])
        cfg, _ = configurable.resolve(recipe, list(result.get("bindings", [])))
    return cfg


def predicted_plan(cfg, shape: str, available_gib: float, total_gib: float, longest_prompt: int | None = None):
    """The memory plan (`rlhf.memory.predict`) of a run's configuration (`result_config`) at the bench shape
    `shape`, on a GPU of `total_gib` with `available_gib` free at the start."""
    from rlhf import memory
    return memory.predict(cfg, memory.KNOWN_SHAPES[SHAPES[shape]], available=int(available_gib * memory.GIB),
                          device_total=int(total_gib * memory.GIB), longest_prompt=longest_prompt)


def planned_device_gib(result: dict) -> float:
    """What the plan of a result's run says the whole device holds at its largest phase (every process,
    the CUDA contexts' reserve included): the figure its `gpu_memory_peak_processes` are held to."""
    from rlhf import memory
    plan = predicted_plan(result_config(result), result["shape"], result["gpu_available_gib"],
                          result["gpu_total_gib"], result.get("longest_prompt"))
    return max(p.total for p in plan.phases) / memory.GIB


def planned_by_phase(cfg, shape: str, available_gib: float, total_gib: float,
                     longest_prompt: int | None = None) -> tuple[dict, dict]:
    """({phase: GiB} allocated, {phase: GiB} reserved): what the memory plan of this code predicts torch
    holds at each phase's peak for the run's configuration (`result_config`) on a GPU of `total_gib`
    (`available_gib` free at the start), the data's longest prompt as the run measured it (`longest_prompt`,
    None: ppo.max_prompt_length). Allocated: resident roles, the engine when awake, the phase's
    micro-batch and the trainer's cuBLAS workspaces; reserved: that plus the allocator's share of the
    plan's reserve (not the CUDA context's, which torch does not count). With `ppo.vllm_own_process` the
    engine's memory is another process's, outside what torch measures here: the figures are the
    trainer's share of the plan (resident roles, micro-batch and workspaces, reserved with the first
    two's fragmentation), and the engine's is left to a device-wide measurement."""
    from rlhf import memory
    from rlhf.memory.plan import RESERVE_BYTES, fragmentation_bytes
    plan = predicted_plan(cfg, shape, available_gib, total_gib, longest_prompt)
    if cfg.ppo.vllm_own_process:
        return ({p.name: round((p.allocated - p.engine) / memory.GIB, 2) for p in plan.phases},
                {p.name: round((p.allocated - p.engine + fragmentation_bytes(p.resident, p.transient)) / memory.GIB, 2)
                 for p in plan.phases})
    return ({p.name: round(p.allocated / memory.GIB, 2) for p in plan.phases},
            {p.name: round((p.total - RESERVE_BYTES) / memory.GIB, 2) for p in plan.phases})


def memory_by_phase(planned: tuple[dict, dict], measured: dict, reserved: dict | None = None) -> dict:
    """Per phase: the plan's figures and the peaks torch held, allocated and reserved (GiB), and each
    plan over its measurement (the goal: measured <= planned <= 1.10 x measured, for both)."""
    allocated_plan, reserved_plan = planned
    reserved = reserved or {}
    def ratio(a, b):
        return round(a / b, 3) if a and b else None
    return {name: {"planned_gb": allocated_plan.get(name), "measured_gb": measured.get(name),
                   "planned_over_measured": ratio(allocated_plan.get(name), measured.get(name)),
                   "planned_reserved_gb": reserved_plan.get(name), "reserved_gb": reserved.get(name),
                   "planned_over_reserved": ratio(reserved_plan.get(name), reserved.get(name))}
            for name in sorted(set(allocated_plan) | set(measured) | set(reserved))}


def replan(result: dict) -> dict:
    """The result with `memory_by_phase`'s predictions recomputed by this code (the measurements kept)."""
    measured = {k: v["measured_gb"] for k, v in result["memory_by_phase"].items() if v["measured_gb"] is not None}
    reserved = {k: v["reserved_gb"] for k, v in result["memory_by_phase"].items() if v.get("reserved_gb") is not None}
    planned = planned_by_phase(result_config(result), result["shape"], result["gpu_available_gib"],
                               result["gpu_total_gib"], result.get("longest_prompt"))
    return {**result, "memory_by_phase": memory_by_phase(planned, measured, reserved)}


def summarize(run_dir: Path, command: str, recipe_file: str, extra: dict) -> dict:
    from rlhf.metrics import PHASE_KEYS, read_metrics
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step", 0) > 0] \
        if (run_dir / "metrics.jsonl").is_file() else []
    # The first iteration compiles; a profiled one carries the profiler's cost (`--profile`).
    steady = [r for r in records[1:] if not r.get("perf/profiled")] or records
    def med(key):
        return (round(statistics.median([r[key] for r in steady if key in r]), 3)
                if any(key in r for r in steady) else None)
    phases = sorted({k[len("timing_s/"):] for r in steady for k in r if k.startswith("timing_s/")})
    import common
    recorded = common.run_plan(run_dir)
    gpu = {k: recorded[k] for k in ("gpu_available_gib", "gpu_total_gib")}
    measured, reserved = {}, {}
    for r in records:
        for k, v in r.items():
            for prefix, into in zip(PHASE_KEYS, (measured, reserved)):
                if k.startswith(prefix):
                    name = k[len(prefix):]
                    into[name] = round(max(into.get(name, 0.0), v), 2)  # GiB, as the plan's
    longest = recorded["longest_prompt"]  # the run's plan: its data's longest prompt
    # the run's own resolved config.gin: the settings it measured (`result_config`)
    config_gin = (run_dir / "config.gin").read_text() if (run_dir / "config.gin").is_file() else None
    config = result_config({"config_gin": config_gin, "recipe_file": recipe_file,
                            "bindings": extra.get("bindings", [])})
    planned = planned_by_phase(config, extra["shape"], gpu["gpu_available_gib"], gpu["gpu_total_gib"], longest) \
        if gpu["gpu_available_gib"] and gpu["gpu_total_gib"] else ({}, {})
    tokens = [r["perf/tokens_per_s"] * r["timing_s/step"] for r in steady if "perf/tokens_per_s" in r]
    return {
        "command": command, "recipe_file": recipe_file, "config_gin": config_gin,
        "steps_completed": len(records),
        "iteration_s_median": med("timing_s/step"),
        "phase_s_median": {p: med(f"timing_s/{p}") for p in phases if p != "step"},
        "host_busy_median": {p: med(f"perf/host_busy/{p}") for p in phases if med(f"perf/host_busy/{p}") is not None},
        "rank_s_median": {p: med(f"perf/rank_s/{p}") for p in phases if med(f"perf/rank_s/{p}") is not None},
        "tokens_per_s": med("perf/tokens_per_s"),
        "tokens_per_iteration_median": round(statistics.median(tokens)) if tokens else None,
        "generated_tokens_per_s": med("perf/generated_tokens_per_s"),
        "gpu_utilization_median": med("perf/gpu_utilization"),
        "max_memory_allocated_gb": max((r.get("perf/max_memory_allocated_gb", 0) for r in records), default=None),
        "memory_by_phase": memory_by_phase(planned, measured, reserved),
        "memory_plan_verdict": recorded["memory_plan_verdict"],
        "longest_prompt": longest,
        **gpu,
        "reward_mean": [r.get("reward_mean") for r in records],
        "kl_divergence": [r.get("kl_divergence") for r in records],
        "steps": [{k: v for k, v in r.items() if k.startswith(("timing_s/", "perf/")) or k == "step"} for r in records],
        **extra,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="models/lora.gin", help="the shipped model recipe the user's file includes")
    p.add_argument("--shape", default="7b", choices=("0.5b", "7b"))
    p.add_argument("--assets", required=True)
    p.add_argument("--out", required=True, help="the run directory (resumed when it holds checkpoints)")
    p.add_argument("--json", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=256, help="prompts an iteration (8 calls of prompts/8)")
    p.add_argument("--time-budget", type=float, default=0, help="seconds this call may run rlhf.train (0: no limit)")
    p.add_argument("--tiny", action="store_true", help="the tiny shape (CPU rehearsal)")
    p.add_argument("-b", "--binding", action="append", default=[])
    p.add_argument("--replan", action="store_true", help="only recompute the JSON's predictions with this code")
    p.add_argument("--longest-prompt", type=int, default=None, metavar="TOKENS",
                   help="with --replan: the data's longest prompt, for a result whose run did not record it "
                        "(this script's data: 256 tokens)")
    p.add_argument("--profile", type=int, default=0, metavar="STEP",
                   help="rlhf.train --profile STEP: that iteration under torch.profiler (left out of the medians; "
                        "its summary by phase in the JSON's `profile`)")
    args = p.parse_args(argv)
    if args.replan and not Path(args.json).is_file():
        p.error(f"--json {args.json}: no such result file to replan")
    if args.steps < 1 or args.prompts < 8 or args.prompts % 8:
        p.error(f"--steps {args.steps} / --prompts {args.prompts}: steps must be >= 1 and prompts a multiple of 8 "
                f"(8 generation calls an iteration)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out} is a file: give the run directory")
    if args.replan:
        path = Path(args.json)
        result = json.loads(path.read_text())
        if args.longest_prompt is not None:
            result["longest_prompt"] = args.longest_prompt
        path.write_text(json.dumps(replan(result), indent=2) + "\n")
        return 0
    t0 = time.time()
    inputs = build(Path(args.assets), args.shape, args.tiny)
    out = Path(args.out)
    recipe_file = out.parent / f"{out.name}.gin"
    recipe_file.parent.mkdir(parents=True, exist_ok=True)
    recipe_file.write_text(recipe_text(args.recipe, inputs, args.steps, args.prompts))
    cmd = [sys.executable, "-m", "rlhf.train", str(recipe_file), "--out", str(out), "--quiet"]
    for b in args.binding:
        cmd += ["-b", b]
    if args.profile:
        cmd += ["--profile", str(args.profile)]
    if (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()):
        cmd.append("--resume")
    print(f"[recipe_run] assets in {time.time() - t0:.0f} s; {shlex.join(cmd)}", flush=True)
    import common
    gpu = common.GPUMemorySampler().start()  # the whole device, every process: vLLM's own, Ray's ranks
    proc = subprocess.Popen(cmd, cwd=str(REPO), start_new_session=True)
    try:
        rc = proc.wait(timeout=args.time_budget or None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        print(f"[recipe_run] stopped after --time-budget {args.time_budget:.0f} s; rerun to resume", flush=True)
    shown = ["python", "-m", "rlhf.train", recipe_file.name, "--out", out.name] + \
        [x for b in args.binding for x in ("-b", b)] + (["--profile", str(args.profile)] if args.profile else [])
    gpu.stop()
    extra = {"exit_code": rc, "shape": args.shape, "recipe": args.recipe, "bindings": args.binding,
             # the device's peak over the whole command (start-up and evaluation too) and who held it then
             "gpu_memory_used_peak_gb": gpu.peak_gb or None, "gpu_memory_peak_processes": gpu.peak_processes}
    profiled = out / PROFILE_DIR / f"step_{args.profile}.json"
    if args.profile and profiled.is_file():
        extra["profile"] = json.loads(profiled.read_text())
    result = summarize(out, shlex.join(shown), recipe_file.read_text(), extra)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("steps_completed", "iteration_s_median", "tokens_per_s",
                                             "phase_s_median", "memory_by_phase")}, indent=1), flush=True)
    return 0 if rc in (0, None) else rc


if __name__ == "__main__":
    raise SystemExit(main())

"""Each phase of a recipe run against what the GPU can do: how far a figure could still go (not a test).

    python bench/phase_limits.py bench/results/RUN.json [--gpu h100|h200] [--json OUT.json]

Reads a bench/recipe_run.py result (a shipped recipe through `python -m rlhf.train`) and sets each
phase's median time beside the least it could take on the GPU (bench/flops.py, datasheet limits):
- the dense phases (reference, old log-probs, values, the two updates): their executed FLOPs at the
  GPU's bf16 matrix rate; the ratio is the phase's share of that rate (MFU, executed FLOPs);
- generate: every decoding step reads the weights and the KV cache so far, so the HBM bandwidth sets
  a floor (the prompts' prefill and the decoding's FLOPs at the matrix rate set another: the larger
  holds); the measured time per decoding step beside it says how much is the host's, not the GPU's;
- every other phase (reward, advantages, weight sync, ...) has no floor here: host work, at 0.

An iteration's tokens and their split into prompt and response come from the run's own steps
(`perf/tokens_per_s` x the step's time, `perf/generated_tokens_per_s` x generation's), its sequences
and shapes from the run's configuration (bench/recipe_run.py `result_config`: its own config.gin, or for
an older result its recipe file and bindings, the `include`s read from recipes/ as it is now). The sum
of the floors is what an iteration cannot go under on this GPU; the tokens/s at that floor is the
ceiling no setting of the engine passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import flops  # noqa: E402  (bench/, on the path above)
import recipe_run  # noqa: E402

DENSE = ("reference", "old_logprobs", "values", "update_actor", "update_critic")


def iteration_tokens(result: dict) -> dict:
    """Median tokens of an iteration, all and generated, from the run's steady steps (the first compiles)."""
    steps = [s for s in result["steps"][1:] if not s.get("perf/profiled")] or result["steps"]
    total = statistics.median(s["perf/tokens_per_s"] * s["timing_s/step"] for s in steps)
    # generated tokens/s is over generation's whole time, the part run ahead of the iteration included
    generated = statistics.median(s["perf/generated_tokens_per_s"]
                                  * (s["timing_s/generate"] + s.get("timing_s/generate_ahead", 0.0)) for s in steps)
    return {"tokens": total, "generated": generated, "prompt": total - generated}


def floors(result: dict, gpu: str) -> dict:
    """Per phase: measured median seconds, the floor on `gpu` and what sets it; and the iteration's."""
    from rlhf.memory import KNOWN_SHAPES
    cfg = recipe_run.result_config(result)
    ppo, shape, limits = cfg.ppo, KNOWN_SHAPES[recipe_run.SHAPES[result["shape"]]], flops.GPUS[gpu]
    rate, bandwidth = limits["bf16_tflops"] * 1e12, limits["hbm_tb_s"] * 1e12
    sequences = ppo.rollout_micro_batch_size * ppo.num_rollout_batches * ppo.samples_per_prompt
    tok = iteration_tokens(result)
    seq_len = tok["tokens"] / sequences
    prompt_len, response_len = tok["prompt"] / sequences, tok["generated"] / sequences
    critic_rank = ppo.lora_rank if ppo.critic_lora_rank == -1 else ppo.critic_lora_rank

    def forward(logits: bool) -> float:
        return flops.forward_flops(shape, tok["tokens"], seq_len, tok["generated"] if logits else 0)

    def update(logits: bool, lora: bool) -> float:
        return ppo.ppo_epochs * flops.training_flops(shape, tok["tokens"], seq_len, tok["generated"] if logits else 0,
                                                     frozen_base=lora, checkpointing=ppo.gradient_checkpointing)

    work = {"reference": forward(True), "old_logprobs": forward(True), "values": forward(False),
            "update_actor": update(True, ppo.lora_rank > 0), "update_critic": update(False, critic_rank > 0)}
    measured = result["phase_s_median"]
    phases = {}
    for name, seconds in measured.items():
        if name in ("eval", "step") or seconds is None:
            continue
        row: dict = {"measured_s": seconds}
        if name in DENSE:
            row.update(floor_s=work[name] / rate, bound="bf16 matmul", tflop=work[name] / 1e12,
                       achieved_tflop_s=work[name] / seconds / 1e12, share_of_limit=work[name] / rate / seconds)
        elif name == "generate":
            steps = ppo.max_response_length  # decoding steps: the longest response sets them
            weights = 2.0 * shape.parameter_count()
            kv = sequences * response_len * (prompt_len + response_len / 2) * flops.kv_bytes_per_token(shape)
            memory_s = (steps * weights + kv) / bandwidth
            compute = flops.forward_flops(shape, tok["tokens"], seq_len, tok["generated"])
            compute_s = compute / rate
            floor = max(memory_s, compute_s)
            row.update(floor_s=floor, bound="HBM" if memory_s >= compute_s else "bf16 matmul",
                       decoding_steps=steps, measured_ms_per_step=1e3 * seconds / steps,
                       floor_ms_per_step=1e3 * floor / steps, bytes_read_gb=(steps * weights + kv) / 1e9,
                       share_of_limit=floor / seconds)
        else:
            row.update(floor_s=0.0, bound="host")
        phases[name] = row
    floor = sum(r["floor_s"] for r in phases.values())
    iteration = result["iteration_s_median"]
    return {"gpu": limits["name"], "gpu_key": gpu, "bf16_tflops": limits["bf16_tflops"], "hbm_tb_s": limits["hbm_tb_s"],
            "shape": shape.name, "sequences": sequences, "prompt_tokens_mean": prompt_len,
            "response_tokens_mean": response_len, "tokens_per_iteration": tok["tokens"], "phases": phases,
            "iteration_s": iteration, "iteration_floor_s": floor, "tokens_per_s": result["tokens_per_s"],
            "tokens_per_s_ceiling": tok["tokens"] / floor if floor else None,
            "phases_s": sum(r["measured_s"] for r in phases.values())}


def table(out: dict) -> str:
    lines = [f"{out['shape']}, {out['sequences']} sequences of {out['prompt_tokens_mean']:.0f} + "
             f"{out['response_tokens_mean']:.0f} tokens, on {out['gpu']} ({out['bf16_tflops']:.0f} TFLOP/s bf16, "
             f"{out['hbm_tb_s']} TB/s)",
             f"{'phase':<16} {'measured s':>10} {'floor s':>8} {'share':>6}  bound"]
    for name, r in sorted(out["phases"].items(), key=lambda kv: -kv[1]["measured_s"]):
        share = f"{100 * r['share_of_limit']:5.1f}%" if "share_of_limit" in r else "     -"
        extra = ""
        if "achieved_tflop_s" in r:
            extra = f" ({r['achieved_tflop_s']:.0f} TFLOP/s)"
        elif "measured_ms_per_step" in r:
            extra = (f" ({r['decoding_steps']} steps: {r['measured_ms_per_step']:.2f} ms each against "
                     f"{r['floor_ms_per_step']:.2f})")
        lines.append(f"{name:<16} {r['measured_s']:>10.3f} {r['floor_s']:>8.3f} {share}  {r['bound']}{extra}")
    lines.append(f"iteration: {out['iteration_s']:.3f} s measured, {out['iteration_floor_s']:.3f} s floor; "
                 f"{out['tokens_per_s']:,.0f} tokens/s against a ceiling of {out['tokens_per_s_ceiling']:,.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("result", help="a bench/recipe_run.py JSON")
    p.add_argument("--gpu", choices=sorted(flops.GPUS), help="default: the GPU whose memory the run recorded")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    path = Path(args.result)
    if not path.is_file():
        p.error(f"{args.result}: {'a directory' if path.is_dir() else 'no such file'}; give a bench/recipe_run.py JSON")
    try:
        result = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        p.error(f"{args.result} is not JSON ({err}): give a bench/recipe_run.py JSON")
    missing = [k for k in ("steps", "phase_s_median", "recipe_file", "shape", "iteration_s_median")
               if not isinstance(result, dict) or k not in result]
    if missing:
        p.error(f"{args.result} is not a bench/recipe_run.py result (it lacks {', '.join(missing)})")
    if len(result["steps"]) < 2:
        p.error(f"{args.result} holds {len(result['steps'])} iteration(s): the first compiles, so at least 2 "
                f"are needed")
    gpu = args.gpu or flops.gpu_for_memory(result.get("gpu_total_gib"))
    if gpu is None:
        p.error(f"{args.result} records no GPU (a CPU run?): name one with --gpu")
    out = floors(result, gpu)
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps({"result": args.result, **out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: generated tokens/s per rollout backend on a Qwen2.5-0.5B-shaped model (not a test).

    python bench/gpu_rollout.py --parts vllm,vllm_logprobs --json bench/results/gpu_rollout_vllm_h200.json
    python bench/gpu_rollout.py --parts hf,hf_static --json bench/results/gpu_rollout_hf_h200.json

256 prompts x 256 prompt tokens x 256 new tokens (sampling at temperature 1; random weights
almost never emit EOS, so every response is 256 tokens). Each part runs in its own process
(a vLLM engine per process; a failure in one part leaves the others' figures):
- `vllm`: one in-process engine; `vllm.LLM.generate` alone on the same token ids (no seeds, and
  per-request seeds) against the engine's `VLLMRollout.generate` (prompt encoding, seeds, Batch
  conversion) in both seed modes; repeatability of seeds; `sync_weights` time and effect;
  sleep/wake time and the memory it frees.
- `vllm_logprobs`: `VLLMRollout(return_logprobs=True)` throughput, and the mean gap between its
  sampling log-probs and an HF bf16 forward of the same weights (what `rollout/logprob_gap` logs).
- `vllm_in_process`, `vllm_own_process`: the engine's `VLLMRollout` with vLLM's engine in this process or
  in its own (`ppo.vllm_own_process`): `vllm.LLM.generate` alone, beside a training load in this process,
  and `sync_weights` (own process: through the CUDA IPC staging buffer).
- `vllm_variance`: the same generate call repeated in one in-process engine, each call probed for where
  its wall time goes (its thread's CPU time, the process's, the collector's pauses, the GPU's clock and
  power: bench/host_probe.py), after a training load and straight after the previous call.
- `hf`: the engine's `HFRollout` (fp32 weights, bf16 autocast, dynamic KV cache), as a run with
  ppo.dtype = 'bfloat16' uses it; `hf_static`: a bf16 model with transformers' static KV cache
  and its automatic torch.compile of the decoding step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def timed(fn, device):
    import torch
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def generated_tokens(batch) -> int:
    return int(batch["response_mask"].sum())


def part_vllm(args, assets) -> dict:
    import torch
    import vllm
    from gpu_assets import random_prompts

    from rlhf.config import PPOConfig
    from rlhf.models import load_policy, load_tokenizer
    from rlhf.rollout import SamplingParams
    from rlhf.rollout.vllm import VLLMRollout

    device = torch.device("cuda")
    tok = load_tokenizer(assets["tokenizer_dir"])
    max_len = args.prompt_len + args.new_tokens
    kwargs = dict(tokenizer=tok, device=device, model_dir=assets["model_dir"], seed=0, max_model_len=max_len,
                  per_request_seeds=True, gpu_memory_utilization=args.gpu_memory_utilization)
    try:
        rollout, sleep_error = VLLMRollout(sleep=True, **kwargs), None
    except Exception as err:  # measure the rest without sleep mode
        traceback.print_exc()
        rollout, sleep_error = VLLMRollout(sleep=False, **kwargs), repr(err)[-1000:]
    out = {"engine_start_s": rollout.timings["engine_start_s"], "vllm": vllm.__version__,
           "sleep_mode_error": sleep_error}
    prompts = random_prompts(args.prompts, args.prompt_len, seed=1)
    sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=args.new_tokens,
                                                 max_prompt_length=args.prompt_len))
    rollout.generate(prompts[:8], sampling, seed=123)  # warm-up

    # vLLM alone: the same token ids straight into LLM.generate.
    ids = [{"prompt_token_ids": tok(p)["input_ids"]} for p in prompts]
    alone = vllm.SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    for label, params in (("vllm_alone", alone),
                          ("vllm_alone_per_request_seeds",
                           [vllm.SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True,
                                                detokenize=False, seed=i) for i in range(len(ids))])):
        times = []
        for _ in range(args.repeats):
            res, s = timed(lambda: rollout.llm.generate(ids, params, use_tqdm=False), device)
            times.append(s)
        n = sum(len(r.outputs[0].token_ids) for r in res)
        out[label] = {"seconds": min(times), "all_seconds": times, "generated_tokens": n,
                      "tokens_per_s": n / min(times)}

    # The engine's rollout phase, both seed modes.
    batches = {}
    for per_request in (True, False):
        rollout.per_request_seeds = per_request
        label = "engine_per_request_seeds" if per_request else "engine_per_call_seed"
        times = []
        for _ in range(args.repeats):
            b, s = timed(lambda: rollout.generate(prompts, sampling, seed=7), device)
            times.append(s)
        batches[per_request] = b
        out[label] = {"seconds": min(times), "all_seconds": times, "generated_tokens": generated_tokens(b),
                      "tokens_per_s": generated_tokens(b) / min(times)}
        again = rollout.generate(prompts[:32], sampling, seed=7)
        other = rollout.generate(prompts[:32], sampling, seed=8)
        first = rollout.generate(prompts[:32], sampling, seed=7)
        out[label]["same_seed_same_tokens"] = bool(torch.equal(again["response_ids"], first["response_ids"]))
        out[label]["other_seed_other_tokens"] = not torch.equal(other["response_ids"], first["response_ids"])
    # Per-request seeds make a response independent of its batch: the first 32 of the 256 agree.
    out["engine_per_request_seeds"]["batch_invariant"] = bool(torch.equal(
        batches[True]["response_ids"][:32], _gen(rollout, True, prompts[:32], sampling, 7)["response_ids"]))
    rollout.per_request_seeds = True
    for key in ("engine_per_request_seeds", "engine_per_call_seed"):
        out[key]["vs_vllm_alone"] = out[key]["tokens_per_s"] / out["vllm_alone"]["tokens_per_s"]

    # Weight sync: perturbed HF weights change greedy output; the originals bring it back.
    greedy = SamplingParams.from_ppo(PPOConfig(max_response_length=32, max_prompt_length=args.prompt_len), 0.0)
    base = rollout.generate(prompts[:16], greedy, seed=0)["response_ids"]
    model = load_policy(assets["model_dir"], torch.bfloat16).to(device)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    sync_times = []
    for _ in range(2):
        rollout.sync_weights(model)
        sync_times.append(rollout.timings["last_sync_s"])
    changed = rollout.generate(prompts[:16], greedy, seed=0)["response_ids"]
    rollout.sync_weights(original)
    restored = rollout.generate(prompts[:16], greedy, seed=0)["response_ids"]
    out["sync_weights"] = {"seconds": min(sync_times), "all_seconds": sync_times,
                           "output_changed": not torch.equal(base, changed),
                           "original_restored": bool(torch.equal(base, restored))}
    del model, original

    # Sleep mode: what it frees and what it costs.
    if sleep_error:
        return out
    free_before = torch.cuda.mem_get_info(device)[0]
    _, sleep_s = timed(rollout.release_memory, device)
    free_asleep = torch.cuda.mem_get_info(device)[0]
    _, wake_s = timed(rollout._wake, device)
    after = rollout.generate(prompts[:16], greedy, seed=0)["response_ids"]
    out["sleep"] = {"sleep_s": sleep_s, "wake_s": wake_s, "freed_gb": (free_asleep - free_before) / 2**30,
                    "output_same_after_wake": bool(torch.equal(base, after))}
    return out


def _gen(rollout, per_request, prompts, sampling, seed):
    rollout.per_request_seeds = per_request
    return rollout.generate(prompts, sampling, seed)


def part_vllm_logprobs(args, assets) -> dict:
    import torch
    from gpu_assets import random_prompts

    from rlhf.config import PPOConfig
    from rlhf.models import load_policy, load_tokenizer
    from rlhf.roles.forward import response_logprobs
    from rlhf.rollout import SamplingParams
    from rlhf.rollout.vllm import VLLMRollout

    device = torch.device("cuda")
    tok = load_tokenizer(assets["tokenizer_dir"])
    rollout = VLLMRollout(tokenizer=tok, device=device, model_dir=assets["model_dir"], seed=0,
                          max_model_len=args.prompt_len + args.new_tokens, return_logprobs=True,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    prompts = random_prompts(args.prompts, args.prompt_len, seed=1)
    out = {"engine_start_s": rollout.timings["engine_start_s"]}
    for temperature in (1.0, 0.7):
        sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=args.new_tokens,
                                                     max_prompt_length=args.prompt_len), temperature)
        rollout.generate(prompts[:8], sampling, seed=1)
        times = []
        for _ in range(args.repeats):
            b, s = timed(lambda: rollout.generate(prompts, sampling, seed=3), device)
            times.append(s)
        model = load_policy(assets["model_dir"], torch.bfloat16).to(device).eval()
        gaps = []
        with torch.no_grad():
            for micro in b.split(32):
                lp = response_logprobs(model, micro, device, temperature, with_entropy=False)[0].cpu()
                mask = micro["response_mask"].float()
                gaps.append(float(((lp - micro["rollout_logprobs"]).abs() * mask).sum() / mask.sum()))
        del model
        out[f"temperature_{temperature}"] = {
            "seconds": min(times), "tokens_per_s": generated_tokens(b) / min(times),
            "mean_abs_gap_vs_hf_bf16": sum(gaps) / len(gaps)}
    return out


def part_hf(args, assets, static: bool) -> dict:
    import torch
    from gpu_assets import random_prompts

    from rlhf.config import PPOConfig
    from rlhf.models import load_policy, load_tokenizer
    from rlhf.rollout import SamplingParams
    from rlhf.rollout.hf import HFRollout

    device = torch.device("cuda")
    tok = load_tokenizer(assets["tokenizer_dir"])
    prompts = random_prompts(args.prompts, args.prompt_len, seed=1)
    sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=args.new_tokens,
                                                 max_prompt_length=args.prompt_len))
    if not static:  # the engine's path with ppo.dtype = 'bfloat16': fp32 weights under bf16 autocast
        model = load_policy(assets["model_dir"], torch.float32).to(device)
        rollout = HFRollout(model, tok, device, autocast_dtype=torch.bfloat16)
        warm_up = SamplingParams.from_ppo(PPOConfig(max_response_length=8, max_prompt_length=args.prompt_len))
        rollout.generate(prompts[:8], warm_up, 0)
        b, s = timed(lambda: rollout.generate(prompts, sampling, seed=3), device)
        return {"seconds": s, "generated_tokens": generated_tokens(b), "tokens_per_s": generated_tokens(b) / s,
                "weights": "fp32 + bf16 autocast", "kv_cache": "dynamic"}
    from rlhf.rollout import encode_prompts
    model = load_policy(assets["model_dir"], torch.bfloat16).to(device).eval()
    ids, mask = encode_prompts(tok, prompts, args.prompt_len)
    ids, mask = ids.to(device), mask.to(device)

    def gen():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                  pad_token_id=tok.pad_token_id, cache_implementation="static")
    _, first_s = timed(gen, device)  # compiles
    outs, s = timed(gen, device)
    n = (outs.shape[1] - ids.shape[1]) * outs.shape[0]
    return {"seconds": s, "first_call_s": first_s, "generated_tokens": n, "tokens_per_s": n / s,
            "weights": "bf16", "kv_cache": "static + torch.compile"}


def training_load(model_dir: str, device):
    """A training load on the policy's shape, the function that runs it once and returns its seconds: 24
    micro-batches of 8 x 1024 tokens (their fp32 logits fit an 80 GB card beside the engine, whichever
    process the engine is in) and one AdamW step."""
    import torch

    from rlhf.models import load_policy
    model = load_policy(model_dir, torch.bfloat16).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, 1000, (8, 1024), device=device, generator=gen) for _ in range(24)]

    def train() -> float:
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for x in batches:
            model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        return time.perf_counter() - t

    return model, train


def part_vllm_process(args, assets, own_process: bool) -> dict:
    """The engine's `VLLMRollout` with vLLM's engine in this process or in its own (`ppo.vllm_own_process`),
    on the same token ids: `LLM.generate` alone; a training load alone (the 0.5B shape's forward and
    backward over 12 micro-batches of 16 x 1024 tokens and an AdamW step, about a critic update's work);
    both at once (the generation in a thread, as `ppo.overlap_rollout` runs it), each's own time and the
    wall time; `sync_weights` of the trained model (own process: through the staging buffer)."""
    import threading

    import torch
    import vllm
    from gpu_assets import random_prompts

    from rlhf.models import load_tokenizer
    from rlhf.rollout.vllm import VLLMRollout

    device = torch.device("cuda")
    tok = load_tokenizer(assets["tokenizer_dir"])
    rollout = VLLMRollout(tokenizer=tok, device=device, model_dir=assets["model_dir"], seed=0,
                          max_model_len=args.prompt_len + args.new_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization, own_process=own_process)
    llm = rollout.llm
    out = {"engine_start_s": rollout.timings["engine_start_s"], "vllm": vllm.__version__, "own_process": own_process}
    ids = [{"prompt_token_ids": tok(p)["input_ids"]} for p in random_prompts(args.prompts, args.prompt_len, seed=1)]
    params = vllm.SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    llm.generate(ids[:8], params, use_tqdm=False)  # warm-up

    def generate():
        t = time.perf_counter()
        res = llm.generate(ids, params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(r.outputs[0].token_ids) for r in res)

    model, train = training_load(assets["model_dir"], device)
    train()  # warm-up
    alone_gen, alone_train, both = [], [], []
    for _ in range(args.repeats):
        s, n = generate()
        alone_gen.append(s)
        alone_train.append(train())
        box = {}
        t = time.perf_counter()
        thread = threading.Thread(target=lambda: box.update(gen=generate()))
        thread.start()
        train_s = train()
        thread.join()
        both.append({"wall_s": time.perf_counter() - t, "generate_s": box["gen"][0], "train_s": train_s})
    out.update(generated_tokens=n, generate_alone_s=alone_gen, train_alone_s=alone_train, together=both,
               generate_tokens_per_s=n / min(alone_gen),
               overlap_saving_s=min(alone_gen) + min(alone_train) - min(b["wall_s"] for b in both))
    syncs = []
    for _ in range(3):
        rollout.sync_weights(model)
        syncs.append(rollout.timings["last_sync_s"])
    out["sync_weights_s"] = syncs
    return out


def engine_step_targets(llm) -> dict:
    """The in-process engine's decoding loop, by part, for `MethodTimer`: a whole step (`LLMEngine.step`);
    on the host, the scheduler's `schedule` and `update_from_output`, the executor's `execute_model` (input
    preparation and the launches) and `sample_tokens`, the output processor; what a step spends beyond its
    parts is waiting for the GPU's tokens. Parts this vLLM version does not have are left out."""
    engine = llm.llm_engine
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient's EngineCore
    candidates = {"step": (engine, "step"),
                  "process_outputs": (getattr(engine, "output_processor", None), "process_outputs"),
                  "schedule": (getattr(core, "scheduler", None), "schedule"),
                  "update_from_output": (getattr(core, "scheduler", None), "update_from_output"),
                  "execute_model": (getattr(core, "model_executor", None), "execute_model"),
                  "sample_tokens": (getattr(core, "model_executor", None), "sample_tokens")}
    return {label: (obj, name) for label, (obj, name) in candidates.items() if callable(getattr(obj, name, None))}


def step_split(steps: dict) -> dict:
    """A `MethodTimer` summary of `engine_step_targets` as seconds per part, and the steps' time beyond
    their parts ('gpu_wait_s')."""
    parts = {label: s.get("total_s", 0.0) for label, s in steps.items() if label != "step"}
    split = {f"{label}_s": v for label, v in parts.items()}
    if "step" in steps and steps["step"].get("count"):
        split["gpu_wait_s"] = steps["step"]["total_s"] - sum(parts.values())
    return split


VARIANCE_SETTINGS = ("default", "not_sampled", "collector_off", "one_thread", "frozen")


@contextlib.contextmanager
def host_setting(name: str):
    """The host setting a `vllm_variance` call runs under: 'default'; 'not_sampled' (the caller leaves the
    device-sampling thread out: its NVML reads take the GIL as the trainer's utilisation monitor's do);
    'collector_off' (`gc.disable()`); 'frozen' (`gc.freeze()`: the objects alive before the call leave the
    collector's generations, so its passes walk only the call's own; it stays so, as vLLM's own freeze of
    its start-up heap does, since `gc.unfreeze()` would undo both: the plan runs it last); 'one_thread'
    (torch's intra-op threads at 1). Everything else is put back after the call."""
    import gc

    import torch
    if name not in VARIANCE_SETTINGS:
        raise ValueError(f"unknown host setting {name!r}; one of {', '.join(VARIANCE_SETTINGS)}")
    threads = torch.get_num_threads()
    if name == "collector_off":
        gc.disable()
    elif name == "frozen":
        gc.freeze()
    elif name == "one_thread":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        gc.enable()
        torch.set_num_threads(threads)


def part_vllm_variance(args, assets) -> dict:
    """The same `vllm.LLM.generate` call over and over in one in-process engine, each one probed
    (bench/host_probe.py): wall time against the calling thread's CPU time, the process's, the collector's
    pauses, the GPU's clock and power, and each decoding step split into its host parts and its wait for
    the GPU. Calls alternate between following a training load (as a recipe's rollout follows the updates)
    and following the previous call: `--repeats` pairs as they are, then a pair under each other host
    setting (`host_setting`). A slow call with the same thread CPU time waited (the GIL, the OS, the GPU);
    one with more worked longer."""
    import torch
    import vllm
    from gpu_assets import random_prompts
    from host_probe import CallProbe, GCTimer, MethodTimer, device_reader

    from rlhf.models import load_tokenizer
    from rlhf.rollout.vllm import VLLMRollout

    device = torch.device("cuda")
    tok = load_tokenizer(assets["tokenizer_dir"])
    rollout = VLLMRollout(tokenizer=tok, device=device, model_dir=assets["model_dir"], seed=0,
                          max_model_len=args.prompt_len + args.new_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    llm = rollout.llm
    ids = [{"prompt_token_ids": tok(p)["input_ids"]} for p in random_prompts(args.prompts, args.prompt_len, seed=1)]
    params = vllm.SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    llm.generate(ids[:8], params, use_tqdm=False)  # warm-up
    _, train = training_load(assets["model_dir"], device)
    read = device_reader(device)
    calls = []
    plan = ["default"] * (2 * args.repeats) + [name for name in VARIANCE_SETTINGS[1:] for _ in range(2)]
    with GCTimer() as timer:
        for i, setting in enumerate(plan):
            after = "training" if i % 2 == 0 else "generate"
            if after == "training":
                train()
            with host_setting(setting), CallProbe(timer, None if setting == "not_sampled" else read) as probe, \
                    MethodTimer(engine_step_targets(llm)) as steps:
                res = llm.generate(ids, params, use_tqdm=False)
            tokens = sum(len(r.outputs[0].token_ids) for r in res)
            summary = steps.summary()
            split = step_split(summary)
            calls.append({"call": i, "after": after, "setting": setting, "tokens": tokens, **probe.record,
                          "steps": summary, "step_split": split})
            step = summary.get("step", {})
            parts = ", ".join(f"{k} {v:.2f}" for k, v in split.items())
            print(f"call {i} after {after}, {setting}: {probe.record['wall_s']:.2f} s, "
                  f"thread CPU {probe.record['thread_cpu_s']:.2f} s, GC {probe.record['gc_pause_s'] * 1e3:.0f} ms, "
                  f"steps {step.get('count', 0)} median {step.get('median_ms', 0):.2f} ms "
                  f"max {step.get('max_ms', 0):.1f} stall {step.get('stall_s', 0):.2f} s, split {parts}, "
                  f"device {probe.record['device']}", flush=True)
    walls = [c["wall_s"] for c in calls]
    by_setting = {name: [c["wall_s"] for c in calls if c["setting"] == name] for name in VARIANCE_SETTINGS}
    return {"vllm": vllm.__version__, "calls": calls, "wall_s_min": min(walls), "wall_s_max": max(walls),
            "wall_s_by_setting": by_setting}


PARTS = {"vllm": part_vllm, "vllm_logprobs": part_vllm_logprobs, "vllm_variance": part_vllm_variance,
         "hf": lambda a, s: part_hf(a, s, False), "hf_static": lambda a, s: part_hf(a, s, True),
         "vllm_in_process": lambda a, s: part_vllm_process(a, s, False),
         "vllm_own_process": lambda a, s: part_vllm_process(a, s, True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="vllm,vllm_logprobs,hf,hf_static")
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "gpu_rollout_h200.json"))
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--part-timeout", type=int, default=400)
    p.add_argument("--assets", default="", help="reuse a folder from bench/gpu_assets.py")
    p.add_argument("--run-part", default="", help=argparse.SUPPRESS)
    p.add_argument("--part-json", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    from gpu_assets import build_assets
    root = args.assets or tempfile.mkdtemp(prefix="rollout-bench-")
    assets = build_assets(root)
    if args.run_part:  # child process: one part
        result = PARTS[args.run_part](args, assets)
        Path(args.part_json).write_text(json.dumps(result, indent=1))
        return 0

    passthrough = ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--new-tokens",
                   str(args.new_tokens), "--repeats", str(args.repeats), "--assets", root,
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    results, errors = {}, {}
    for part in args.parts.split(","):
        part_json = Path(root) / f"{part}.json"
        t = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--run-part", part, "--part-json", str(part_json)]
                                  + passthrough, timeout=args.part_timeout)
            if proc.returncode == 0:
                results[part] = json.loads(part_json.read_text())
            else:
                errors[part] = f"exit status {proc.returncode} (see the log)"
        except subprocess.TimeoutExpired:
            errors[part] = f"timed out after {args.part_timeout} s"
        print(f"part {part}: {time.perf_counter() - t:.0f} s {'ok' if part in results else errors[part]}", flush=True)
    import torch
    result = {
        "command": "python bench/gpu_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "workload": f"{args.prompts} prompts x {args.prompt_len} prompt tokens x {args.new_tokens} new tokens, "
                    f"temperature 1", "model_shape": "Qwen2.5-0.5B (random weights), bf16",
        "results": results, "errors": errors,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

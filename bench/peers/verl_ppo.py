"""Peer benchmark: verl's `verl.trainer.main_ppo` (FSDP + vLLM, one GPU), PPO or GRPO (not a test).

    python bench/peers/verl_ppo.py --assets DIR --json OUT.json [--warmup 1] [--steps 3] \
        [--trainer v1|v0] [--timeout 480] [--config-only] [extra hydra overrides...]
    python bench/peers/verl_ppo.py --algo grpo --shape 7b --lora-rank 64 [--lora-merge] ...

`--algo ppo` (default), the work of `bench/peers/engine.py --algo ppo`: 256 prompts x 256 new
tokens per step, prompts of exactly 256 tokens (the shared inputs of `bench/peers/common.py`,
written as verl's parquet: `prompt` as chat messages, a content-only chat template), GAE with a
critic (gamma 1, lambda 1), KL in the reward (k1, fixed 0.05) so the reference model runs,
mini-batches of 64, micro-batches of 32, one PPO epoch, lr 1e-6 (actor) / 5e-6 (critic), bf16
rollouts in vLLM at 0.3 of the GPU's memory, FSDP actor/critic/reference in one hybrid-engine
worker group.

`--algo grpo`, the work of `bench/peers/trl_grpo.py` and `engine.py --algo grpo`: 32 prompts x 8
completions (`rollout.n`), group-normalized advantages, no critic, KL 0.04 as a loss against the
reference (`use_kl_loss`, k3 = verl's `low_var_kl`, as TRL's beta), one optimizer step per
generation batch (`ppo_mini_batch_size` 32 prompts = 256 sequences), micro-batch 32, lr 1e-6.
`--lora-rank R` uses verl's own LoRA settings: `actor_rollout_ref.model.lora_rank=R`,
`lora_alpha` (2R unless `--lora-alpha`), `target_modules=all-linear`, with what verl's LoRA guide
requires and recommends: `rollout.load_format=safetensors` (vLLM loads the base itself) and
`rollout.layered_summon=True`. verl then computes the reference with the adapter off (no second
model) and hands vLLM the adapter as a LoRA request each step (`max_lora_rank` R);
`--lora-merge` (`actor_rollout_ref.model.lora.merge=True`) merges it into the base weights
instead. `--gradient-checkpointing` turns on verl's `enable_gradient_checkpointing` (the 7B LoRA
work checkpoints in every system); `--shape 7b` is the Qwen2.5-7B shape.

verl runs as its own process (`python -m verl.trainer.main_ppo` with the overrides below, the
exact line is in the JSON); its per-step metrics (verl's `timing_s/*`, `perf/*`) come from its
file logger (`trainer.logger=[console,file]`, VERL_FILE_LOGGER_PATH), medians over the steps after
`--warmup`. The device's peak memory in use is sampled here (NVML / nvidia-smi).

Choices forced by the GPU machine (recorded in the JSON as `handicaps`): no flash-attn wheel
there, so `attn_implementation=sdpa` and `use_remove_padding=False` (verl's padding-free path
needs flash_attn's varlen kernels); gradient checkpointing off in the PPO work (this engine does
not checkpoint there). verl 0.9.1 pins transformers < 5.11 (its vllm extra: 5.9.0) and
transformers 5.9 checks for tokenizers <= 0.23.0, so both travel in the verl site (`run_h200.sh`
puts it first on PYTHONPATH), with TRL 1.12 (verl imports `AutoModelForCausalLMWithValueHead`,
gone from TRL 1.13). verl's critic loader hard-codes `attn_implementation="flash_attention_2"`;
`install_carry.sh` patches it to take the model config's, which
`+critic.model.override_config.attn_implementation=sdpa` sets (verl's HFModelConfig passes it to
`AutoConfig.from_pretrained`, so `hf_config._attn_implementation` is sdpa).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORKS = {
    "ppo": dict(prompts_per_step=256, samples_per_prompt=1, prompt_tokens=256, max_new_tokens=256, mini_batch=64,
                micro_batch=32, kl="in reward, k1, 0.05", actor_learning_rate=1e-6, critic_learning_rate=5e-6),
    "grpo": dict(prompts_per_step=32, num_generations=8, prompt_tokens=common.PROMPT_TOKENS,
                 max_new_tokens=common.RESPONSE_TOKENS, beta=0.04, micro_batch=32, learning_rate=1e-6),
}


def work(args) -> dict:
    """What one step does, as the other peers' JSON says it (make_table.py groups rows by it)."""
    w = dict(WORKS[args.algo])
    if args.shape != "0.5b":
        w["shape"] = args.shape
    if args.lora_rank:
        w.update(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank,
                 target_modules="all-linear", lora_merge=args.lora_merge)
    if args.gradient_checkpointing:
        w["gradient_checkpointing"] = True
    return w


REWARD_PY = '''\
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A free rule reward, as in the other peers: exact match of the stripped response."""
    return float(solution_str.strip() == ground_truth)
'''


def overrides(inputs: dict, files: dict, steps: int, args) -> list[str]:
    """verl's Hydra overrides for `args.algo` on the shared inputs (the exact line goes in the JSON)."""
    m = inputs["model_dir"]
    grpo = args.algo == "grpo"
    w = work(args)
    prompts = w["prompts_per_step"]
    seqs = prompts * w.get("num_generations", 1)
    gc = "True" if args.gradient_checkpointing else "False"
    ovr = [
        # data
        f"data.train_files={files['train']}", f"data.val_files={files['val']}",
        f"data.train_batch_size={prompts}", f"data.max_prompt_length={w['prompt_tokens']}",
        f"data.max_response_length={w['max_new_tokens']}",
        "data.filter_overlong_prompts=False", "data.truncation=error", "data.dataloader_num_workers=0",
        "data.shuffle=True", "data.seed=0",
        # actor / rollout / reference
        f"actor_rollout_ref.model.path={m}", f"actor_rollout_ref.model.tokenizer_path={m}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={gc}",
        # FSDP2 under LoRA: verl's FSDP1 path gathers the adapter with summon_full_params(offload_to_cpu=True),
        # which torch refuses on one GPU (NO_SHARD); this engine trains with FSDP2 too
        f"actor_rollout_ref.actor.strategy={'fsdp2' if args.lora_rank else 'fsdp'}",
        f"actor_rollout_ref.actor.optim.lr={w.get('learning_rate', w.get('actor_learning_rate'))}",
        # one optimizer step per generation batch (GRPO: mini-batch in prompts, x rollout.n sequences)
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts if grpo else w['mini_batch']}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={w['micro_batch']}",
        "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.clip_ratio=0.2",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        f"actor_rollout_ref.rollout.n={w.get('num_generations', 1)}",
        "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.rollout.max_num_seqs={seqs}",
        f"actor_rollout_ref.rollout.max_model_len={w['prompt_tokens'] + w['max_new_tokens']}",
        "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={w['micro_batch']}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={w['micro_batch']}",
        "actor_rollout_ref.ref.fsdp_config.param_offload=False",
    ]
    if grpo:  # group-normalized advantages, no critic; KL as a loss against the reference (TRL's beta, k3)
        ovr += ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
                "actor_rollout_ref.actor.use_kl_loss=True", f"actor_rollout_ref.actor.kl_loss_coef={w['beta']}",
                "actor_rollout_ref.actor.kl_loss_type=low_var_kl"]
    else:  # GAE + critic, KL in the reward so the reference model runs
        ovr += ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=1.0",
                "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.type=fixed",
                "algorithm.kl_ctrl.kl_coef=0.05", "actor_rollout_ref.actor.use_kl_loss=False",
                f"critic.model.path={m}", f"critic.model.tokenizer_path={m}", "critic.model.use_remove_padding=False",
                "+critic.model.override_config.attn_implementation=sdpa",
                f"critic.model.enable_gradient_checkpointing={gc}",
                f"critic.optim.lr={w['critic_learning_rate']}",
                f"critic.ppo_micro_batch_size_per_gpu={w['micro_batch']}",
                "critic.cliprange_value=0.5", "critic.fsdp.param_offload=False", "critic.fsdp.optimizer_offload=False"]
    if args.lora_rank:  # verl's own LoRA settings, and what its LoRA guide requires (safetensors) and recommends
        ovr += [f"actor_rollout_ref.model.lora_rank={w['lora_rank']}",
                f"actor_rollout_ref.model.lora_alpha={w['lora_alpha']}",
                f"actor_rollout_ref.model.target_modules={w['target_modules']}",
                "actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.layered_summon=True"]
        if args.lora_merge:
            ovr.append("actor_rollout_ref.model.lora.merge=True")
    name = f"verl_{args.algo}" + (f"_{args.shape}" if args.shape != "0.5b" else "") + \
        (f"_lora{args.lora_rank}" if args.lora_rank else "")
    ovr += [
        # reward: a rule function
        f"reward.custom_reward_function.path={files['reward']}", "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=2",
        # trainer
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1", "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.critic_warmup=0", "trainer.logger=[console,file]", "trainer.project_name=peers",
        f"trainer.experiment_name={name}", f"trainer.default_local_dir={files['ckpt']}",
        f"trainer.use_v1={'True' if args.trainer == 'v1' else 'False'}",
        # logical CPUs: TransferQueue (9 actors), 8 agent-loop and 2 reward workers, the task runner and the
        # worker bundle each ask for CPUs; 16 (the cores) would leave some waiting forever
        "ray_kwargs.ray_init.num_cpus=64",
    ]
    # the carried sites, in every worker
    return ovr + [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{os.environ[k]}'"
                  for k in ("PYTHONPATH", "VLLM_USE_FLASHINFER_SAMPLER") if os.environ.get(k)]


def prepare(args) -> tuple[dict, dict]:
    inputs = common.build_inputs(args.assets, tiny=args.tiny, shape=args.shape)
    common.check_assets(inputs)
    root = Path(args.assets) / "verl"
    root.mkdir(parents=True, exist_ok=True)
    prompts = common.prompt_texts(common.N_PROMPTS, inputs["prompt_tokens"], vocab_size=inputs["vocab_size"])
    files = {"train": str(root / "train.parquet"), "val": str(root / "val.parquet"),
             "reward": str(root / "reward.py"), "ckpt": str(root / "checkpoints"), "log": str(root / "metrics.jsonl")}
    if not Path(files["train"]).is_file():
        common.write_verl_parquet(files["train"], prompts)
        common.write_verl_parquet(files["val"], prompts[:64])
    Path(files["reward"]).write_text(REWARD_PY)
    return inputs, files


def compose_only(ovr: list[str]) -> None:
    """Compose verl's Hydra config with the overrides and run verl's own validation (CPU, no Ray)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=ovr)
    OmegaConf.resolve(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    print(f"verl config composed and validated: critic={need_critic(cfg)} reference={need_reference_policy(cfg)} "
          f"train_batch_size={cfg.data.train_batch_size} mini={cfg.actor_rollout_ref.actor.ppo_mini_batch_size} "
          f"attn={cfg.actor_rollout_ref.model.override_config.attn_implementation} v1={cfg.trainer.use_v1}")


def variant(args) -> str:
    """The row's name in make_table.py: fsdp_vllm_v1, or lora64_gc_v1 (the 7B LoRA work)."""
    if args.lora_rank:
        return f"lora{args.lora_rank}" + ("_merged" if args.lora_merge else "") + \
            ("_gc" if args.gradient_checkpointing else "") + f"_{args.trainer}"
    return f"fsdp_vllm_{args.trainer}"


def handicaps(args) -> list[str]:
    """What this machine forces on verl, beside its defaults (the JSON and the table say so)."""
    out = ["attn_implementation=sdpa, use_remove_padding=False (no flash-attn on the device)"]
    if not args.gradient_checkpointing:
        out.append("gradient checkpointing off (as this engine)")
    if args.algo == "ppo":
        out.append("verl's critic loader hard-codes flash_attention_2: patched at install "
                   "(bench/peers/install_carry.sh) to take the critic config's attention (sdpa)")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--assets", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trainer", choices=("v1", "v0"), default="v1",
                   help="v1: verl's default trainer (needs TransferQueue); v0: the deprecated RayPPOTrainer")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("PEERS_PART_LIMIT_S", 510)) - 30,
                   help="seconds before verl is stopped (default: run_h200.sh's limit for the part, less 30 s)")
    p.add_argument("--algo", choices=tuple(WORKS), default="ppo")
    p.add_argument("--shape", choices=("0.5b", "7b"), default="0.5b")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--lora-alpha", type=int, default=0, help="default: twice the rank")
    p.add_argument("--lora-merge", action="store_true", help="merge the adapter into vLLM's weights each step")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--config-only", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny inputs (to test this script's plumbing only)")
    p.add_argument("extra", nargs="*", help="more hydra overrides (last wins)")
    args = p.parse_args(argv)

    if args.lora_rank < 0 or args.lora_alpha < 0:
        p.error("--lora-rank and --lora-alpha must be >= 0")
    inputs, files = prepare(args)
    ovr = overrides(inputs, files, args.warmup + args.steps, args) + args.extra
    if args.config_only:
        compose_only(ovr)
        return 0

    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *ovr]
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=files["log"], WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false", RAY_DEDUP_LOGS="0",
               HYDRA_FULL_ERROR="1")
    root = str(Path(args.assets).resolve())
    result = {
        "system": "verl", "algorithm": args.algo, "variant": variant(args),
        "command": common.command_line(argv),
        "verl_command": " ".join(shlex.quote(c.replace(root, "$ASSETS")) for c in cmd[1:]),
        "work": work(args),
        "handicaps": handicaps(args),
        "versions": common.versions("verl", "tensordict", "hydra-core", "transferqueue", "tokenizers", "trl"),
        "env": {k: os.environ.get(k) for k in ("PYTHONPATH", "VLLM_USE_FLASHINFER_SAMPLER")},
    }
    Path(files["log"]).unlink(missing_ok=True)
    log_path = Path(args.json).with_suffix(".verl.log")  # run_h200.sh writes this script's output to .log
    gpu = common.GPUMemorySampler().start()
    t0 = time.perf_counter()

    def collect(final: bool) -> list:
        """Reads verl's file logger and (re)writes the JSON: a hard kill still leaves the steps so far."""
        result["wall_s"] = time.perf_counter() - t0
        steps = []
        if Path(files["log"]).is_file():
            for line in Path(files["log"]).read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                data = rec.get("data", {})
                steps.append({"step": rec.get("step"),
                              **{k: v for k, v in data.items() if isinstance(v, (int, float))}})
        result["steps"] = steps
        if steps and first_logged is not None and steps[0].get("timing_s/step"):
            # start-up: Ray, the FSDP workers, vLLM's server (load, compile, CUDA graphs), up to the first step
            result["setup_s"] = first_logged - steps[0]["timing_s/step"]
        times = [s.get("timing_s/step") for s in steps if s.get("timing_s/step") is not None]
        result.update(common.summarize(times, args.warmup))
        timed = steps[args.warmup:]
        if timed:
            keys = sorted({k for s in timed for k in s if k.startswith("timing_s/")})
            result["median_phases_s"] = {k.split("/", 1)[1]: statistics.median(s[k] for s in timed if k in s)
                                         for k in keys}
            thr = [s["perf/throughput"] for s in timed if "perf/throughput" in s]
            result["tokens_per_s"] = statistics.median(thr) if thr else None  # verl: tokens/s per GPU (1 GPU)
            lens = [s["response_length/mean"] for s in timed if "response_length/mean" in s]
            result["response_length_mean"] = statistics.mean(lens) if lens else None
            gen = result["median_phases_s"].get("gen")
            sequences = result["work"]["prompts_per_step"] * result["work"].get("num_generations", 1)
            if gen and lens:
                result["generated_tokens_per_s"] = sequences * result["response_length_mean"] / gen
            mem = [s["perf/max_memory_allocated_gb"] for s in timed if "perf/max_memory_allocated_gb" in s]
            result["max_memory_allocated_gb"] = max(mem) if mem else None
            result["gpu_memory_used_peak_gb"] = gpu.peak_gb
            result["gpu_memory_peak_processes"] = gpu.peak_processes  # verl's Ray workers and vLLM server at the peak
        result.pop("error", None)
        if not steps:
            tail = log_path.read_text(errors="replace")[-6000:] if log_path.is_file() else ""
            result["error"] = ("verl logged no step" + ("" if final else " yet") + "; the end of its log:\n" + tail)
        result["partial"] = not final
        common.write_json(args.json, result)
        return steps

    print("running: " + result["verl_command"], flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(Path(args.assets)),
                                start_new_session=True)
        reset, last_write, first_logged = False, 0.0, None
        try:
            while proc.poll() is None and time.perf_counter() - t0 < args.timeout:
                time.sleep(1.0)
                if first_logged is None and _count_lines(files["log"]) >= 1:
                    first_logged = time.perf_counter() - t0  # within a second of the first step's end
                if not reset and _count_lines(files["log"]) >= args.warmup:
                    gpu.reset()  # the device's peak over the timed steps only
                    reset = True
                if time.perf_counter() - last_write > 10:
                    collect(final=False)
                    last_write = time.perf_counter()
        finally:
            if proc.poll() is None:
                import signal
                result["stopped_after_s"] = time.perf_counter() - t0
                os.killpg(proc.pid, signal.SIGTERM)  # verl's own process group (its Ray is stopped by run_h200.sh)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
    gpu.stop()
    result["returncode"] = proc.returncode
    steps = collect(final=True)
    print(f"verl PPO: rc={proc.returncode}, {len(steps)} steps, median {result.get('median_step_s')} s; "
          f"wrote {args.json} (log {log_path})", flush=True)
    return 0 if steps else 1


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


if __name__ == "__main__":
    sys.exit(main())

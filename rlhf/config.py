"""Typed, frozen configuration for the PPO engine.

Engine code takes these dataclasses; gin binds them at the edge (`rlhf/configurable.py`)
under the names `ppo`, `model`, `task`, `sft` and `tiny_model`. Every default is written
once, here, next to its meaning. Every value is validated in `__post_init__`, so a bad
binding fails before any compute with one line naming the binding and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Dict

from rlhf.errors import ConfigError
from rlhf.start_checks import check_adapter_starts, model_position_limit
from rlhf.validation import check, choice, number, positive_int

if TYPE_CHECKING:
    from rlhf.algos import AdvantageEstimator

GPU_TORCH_THREADS = 4
"""torch's intra-op threads of a one-process GPU run that sets no `ppo.torch_threads`."""


LORA_SETTINGS = ("lora_alpha", "lora_dropout", "lora_target_modules")
"""The adapters' settings: binding one while no model has adapters is an error, not a silent no-op."""


def estimators() -> Dict[str, "AdvantageEstimator"]:
    """rlhf/algos.py `ADVANTAGE_ESTIMATORS`, the choices of `ppo.adv_estimator`: imported when a
    config is validated, not when this module is (the math loads torch)."""
    from rlhf.algos import ADVANTAGE_ESTIMATORS
    return ADVANTAGE_ESTIMATORS


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """The PPO algorithm, its rollouts and its schedule (gin name: `ppo`)."""

    # --- run length and bookkeeping ---
    seed: int = 0
    """Controls initialisation of new heads, data order and sampling."""
    total_steps: int = 60
    """PPO iterations (rollout + update) to run."""
    eval_every: int = 20
    """Evaluate on the held-out split every N steps (and always at step 0 and at the end)."""
    save_every: int = 20
    """Write a checkpoint every N steps (and always at the end)."""
    keep_checkpoints: int = 2
    """How many of the latest checkpoints to keep on disk (0 keeps all)."""
    final_window: int = 10
    """Steps averaged into summary.json's `final_window` metrics."""

    # --- rollout: the guide's parameters ---
    rollout_micro_batch_size: int = 16
    """Prompts per generation call (responses: this x samples_per_prompt). The guide: 8-64, start at
    16; too small wastes the GPU on launch overhead, too large runs out of memory on long contexts
    (tune for 85-92% GPU memory). With HF generate each call is one padded batch. vLLM takes an
    iteration's calls together as one continuous batch (up to 256 sequences in flight, its KV cache
    within `vllm_gpu_memory_utilization`), so there this x num_rollout_batches is what fills it:
    more prompts an iteration keep more sequences in flight, for throughput and KV-cache memory."""
    num_rollout_batches: int = 4
    """Generation calls per PPO iteration; their union is the rollout buffer. The guide: 4-32 (8 or
    16); too few update on tiny data, too many make the critic stale."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt (GRPO needs >= 2)."""
    max_prompt_length: int = 32
    """Prompt tokens at most (see prompt_truncation). The guide: >= 1024 for dialogue."""
    prompt_truncation: str = "error"
    """A prompt longer than max_prompt_length: 'error' (the run stops at start, naming the longest
    prompt's row), 'left' (its first tokens are cut) or 'right' (its last tokens are cut), verl's
    `data.truncation`. Where cutting is allowed the share of prompts cut is logged
    (`rollout/prompt_truncated_fraction`, summary.json's `prompt_truncated_fraction`)."""
    max_response_length: int = 8
    """Generated tokens at most; a response that reaches it without EOS is truncated. The guide: 512
    (dialogue), 256 (summaries), 768 (code); memory grows about quadratically with it."""
    temperature: float = 1.0
    """Sampling temperature of rollouts (> 0; 1 samples the policy as it is)."""
    top_p: float = 1.0
    """Nucleus sampling of rollouts: the smallest set of tokens whose probability reaches top_p (1 disables)."""
    top_k: int = 0
    """0 disables top-k filtering."""
    rollout_backend: str = "hf"
    """'hf' (transformers generate) or 'vllm' (GPU)."""
    rollout_logprobs: bool = False
    """vLLM only: also return the sampling log-probs and log their mean gap to the trainer's
    recomputed old log-probs as `rollout/logprob_gap` (the ratio still uses the trainer's).
    Costs 40-60% of vLLM's generation throughput."""
    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of the GPU's memory the vLLM engine may take (weights, activations, KV cache);
    the trainer's models and optimizer states share the rest."""
    vllm_sleep: object = "auto"
    """vLLM: offload the engine's weights and free its KV cache between rollouts (sleep mode),
    so the update phases get that memory; it wakes before the next weight sync. 'auto' sleeps only
    when the roles do not fit on the device beside the awake engine (rlhf/memory/runtime.py;
    the decision is logged): sleeping and waking cost ~0.2 s a step."""
    vllm_per_request_seeds: bool = False
    """vLLM: True gives every request its own seed (derived from seed, step, call, index); False
    seeds the engine's sampler once per call. Both repeat a call's tokens exactly for the same
    seed; per-request seeds cost vLLM's first model runner throughput (it draws their noise request by
    request: bench/results/gpu_h200.md; the second draws every request's in one kernel) and still do not
    make a response independent of its batch (bf16 kernels differ with the batch size)."""
    vllm_own_process: bool = False
    """vLLM: run the engine's scheduler and model runner in a process of their own (vLLM's multiprocessing
    mode) instead of the trainer's; the trainer's weights reach it through a CUDA IPC staging buffer and
    its samplers are seeded there, so the same seed gives the same tokens either way
    (rlhf/rollout/vllm_worker.py)."""
    vllm_model_runner: str = "auto"
    """vLLM: which of its model runners drives the model. 'v2' prepares each decoding step's inputs on the
    GPU and seeds the sampling noise of every request in one kernel, so a step costs the host less; 'v1'
    is the first runner; 'auto' leaves vLLM's own choice (0.24 picks 'v2' for Llama, Mistral and Qwen3
    architectures, 'v1' for the rest, Qwen2 included). vLLM's VLLM_USE_V2_MODEL_RUNNER variable, where a
    user exports it, must agree with a runner named here. Unused by the HF backend (a recipe that names a
    runner still runs with ppo.rollout_backend = 'hf')."""

    # --- optimisation ---
    actor_learning_rate: float = 2e-6
    """Adam learning rate of the actor (the policy). The guide: 1e-6 - 5e-6 (2e-6 for a 7B model); a
    sawtooth reward (rise then crash) says lower it. Small models need far more (recipes/models/tiny_llama.gin)."""
    critic_learning_rate: float = 1e-5
    """Adam learning rate of the critic (the value model). The guide: 5e-6 - 1e-5, 2-3x the actor's,
    never more than 3x; a long flat reward says raise it."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup."""
    lr_schedule: str = "constant"
    """'constant', 'linear' or 'cosine' decay after warmup (over the whole run)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay of both optimizers, per step x learning rate (0 disables)."""
    adam_beta1: float = 0.9
    """Adam's decay of the first moment (the gradient's running mean)."""
    adam_beta2: float = 0.95
    """Adam's decay of the second moment (the squared gradient's running mean)."""
    adam_eps: float = 1e-8
    """Adam's epsilon, added to the second moment's square root."""
    max_grad_norm: float = 1.0
    """Gradient norm clipping (0 disables)."""
    ppo_epochs: int = 1
    """Passes over the rollout buffer per iteration."""
    mini_batch_size: int = 32
    """Sequences per optimizer step; must divide the rollout buffer."""
    micro_batch_size: int = 16
    """Sequences per forward/backward (on each rank, capped at its share mini_batch_size / world_size);
    gradients accumulate over the rest of the mini-batch."""
    forward_micro_batch_size: int = 0
    """Sequences per forward-only pass (old log-probs, reference log-probs, values): these keep no
    activations for a backward, so they can take larger batches than training (verl's
    `log_prob_micro_batch_size`). 0: the same as micro_batch_size."""

    max_tokens_per_micro_batch: int = 0
    """Token budget of a micro-batch (verl's `ppo_max_token_len_per_gpu` with `use_dynamic_bsz`):
    each mini-batch's sequences, in order, are cut into micro-batches of at most this many real
    (prompt + response) tokens, and each micro-batch runs packed into one row without padding, for
    the update and for every forward-only pass. Mini-batch boundaries and the shuffle do not change,
    so results depend on the budget only through floating-point summation order. 0: fixed
    micro_batch_size / forward_micro_batch_size counts of padded sequences."""
    forward_max_tokens_per_micro_batch: int = 0
    """Token budget of a packed micro-batch in the forward-only passes (reference and old log-probs,
    values): they keep no activations for a backward, so they take larger rows than the update
    (verl's `log_prob_max_token_len_per_gpu`); fewer, larger matmuls and launches. 0: the update's
    `max_tokens_per_micro_batch`. Needs that budget set (packed micro-batches)."""

    # --- memory: adapters and activations ---
    lora_rank: int = 0
    """LoRA rank of the actor's adapters (peft): the base weights are frozen (bf16 on a GPU, fp32
    on the CPU) and only the adapters train, in fp32; the reference is the base with the adapter
    switched off (no second copy). 0: full fine-tuning. verl's `lora_rank`, OpenRLHF's `--lora_rank`."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter's update is scaled by lora_alpha / rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps training deterministic given the seed)."""
    lora_target_modules: object = "all-linear"
    """Which linear layers get adapters: 'all-linear' (every linear layer of the transformer
    blocks, not the LM head) or a list of module names such as ['q_proj', 'v_proj']."""
    critic_lora_rank: int = -1
    """LoRA rank of the critic's backbone (its value head always trains in full); -1: the actor's
    lora_rank, 0: full fine-tuning of the critic. GRPO has no critic: leave it at -1."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them
    (transformers' gradient checkpointing), for the actor and the critic: activation memory falls
    from every layer's to about one layer's, for about a third more compute in the update."""

    # --- losses ---
    clip_range: float = 0.2
    """PPO ratio clip half-width: ratios are clipped to [1 - c, 1 + c]. The guide: 0.1-0.2 (0.1 for
    7B+); more than 40% of tokens clipped says raise it, under 5% lower it."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss for negative advantages (0 disables)."""
    value_clip_range: float = 0.2
    """Value predictions are clipped to old_value +- this (0 disables)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the actor loss."""
    loss_aggregation: str = "token_mean"
    """'token_mean' (mean over all response tokens) or 'seq_mean' (mean of per-sequence means)."""

    # --- KL to the reference policy ---
    kl_coef: float = 0.05
    """Weight of KL(actor || reference) per token; the initial value when adaptive. The guide:
    0.01-0.2 (PPO 0.05-0.1); too big: stiff, repeats prompts; too small: reward hacking."""
    kl_estimator: str = "k1"
    """Per-token estimator: 'k1' (log-ratio), 'k2' (squared half), 'k3' (Schulman's unbiased)."""
    kl_mode: str = "reward"
    """'reward': subtract kl_coef * KL from per-token rewards; 'loss': add it to the actor loss."""
    adaptive_kl: bool = False
    """Adapt kl_coef toward kl_target (Ziegler et al. controller)."""
    kl_target: float = 0.05
    """Adaptive KL: the per-token KL (nats) the controller steers toward."""
    kl_horizon: int = 1000
    """Samples over which the adaptive controller moves kl_coef."""

    # --- advantages ---
    adv_estimator: str = "gae"
    """A name of rlhf/algos.py `ADVANTAGE_ESTIMATORS`: 'gae' (critic + GAE) or 'grpo' (critic-free,
    group-relative baseline)."""
    gamma: float = 1.0
    """Discount of per-token rewards in GAE (1: none, the usual choice for language)."""
    lam: float = 0.95
    """GAE's lambda: 1 is the Monte-Carlo return, 0 the one-step TD error."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean and unit variance over the rollout buffer."""
    grpo_normalize_std: bool = True
    """GRPO: divide by the group's standard deviation."""

    # --- evaluation ---
    eval_temperature: float = 1.0
    """Sampling temperature of eval/accuracy (pass@1 at this temperature); greedy is logged too."""
    eval_samples_per_prompt: int = 1
    """Responses sampled per held-out prompt; eval/accuracy averages pass@1 over them."""

    # --- where and how ---
    device: str = "auto"
    """'auto' (cuda if available), 'cpu' or 'cuda'."""
    dtype: str = "float32"
    """Parameter dtype for training: 'float32' or 'bfloat16' (autocast on GPU)."""
    init_from: str = ""
    """A checkpoint dir (`.../checkpoints/step_N`) whose actor and critic weights start this run."""
    torch_compile: bool = False
    """GPU: compile the models' training and scoring forwards and the log-prob/entropy math with
    torch.compile (fuses the many small kernels of narrow models; the first steps compile)."""
    deterministic: bool = True
    """GPU: the updates' backward passes run torch's deterministic algorithms strictly, flash
    attention's among them (its backward otherwise adds query gradients with atomics, so two runs
    of one seed drift apart in the last bits from the first update). The same seed, config and
    code then give the same numbers run after run (bench/results/determinism_h200.md). An op with
    no deterministic kernel stops the run with one line naming it. False: flash attention's atomic
    backward (the speed it costs is in the same file). CPU runs are deterministic either way."""
    torch_threads: int = 0
    """CPU threads for torch; on Ray, the threads of each rank. 0: one thread on a CPU run (the
    pinned numerics, rlhf/numerics.py), `GPU_TORCH_THREADS` (4) for a one-process GPU run, whose
    host threads only launch kernels and share the cores with vLLM (bench/results/threads/), on Ray
    `cpus_per_rank`."""

    # --- scale-out on Ray (bindings that say where a run executes, not what it computes) ---
    world_size: int = 1
    """Ranks per model role (actor, critic, reference): one Ray actor per rank, the model sharded
    over them with FSDP2. The global batch sizes above do not change with it, so results do not."""
    placement: str = "auto"
    """'local' (every role in this process: the single-process engine), 'colocated' (rank i of every
    role shares placement-group bundle i and its device; on GPU, models not in use are offloaded
    to CPU between phases), 'split' (each role's ranks on bundles of their own), or 'auto'
    ('local' at world_size 1, 'colocated' above)."""
    cpus_per_rank: float = 1.0
    """Logical Ray CPUs in each placement-group bundle (one bundle per rank; on GPU it also holds one GPU)."""
    overlap_rollout: object = "auto"
    """Generate the next iteration's rollout while the critic trains on this one: the rollout needs
    only the updated actor, the critic's update only this iteration's buffer, so the two run at once
    (on Ray in their own processes, in one process on two threads with the critic on a CUDA stream of
    its own) and the GPU fills the gaps vLLM's host-bound decoding leaves. The computed numbers are
    those of the sequential loop. 'auto': on a GPU with the vLLM backend and a critic, when the
    memory plan keeps the engine awake and every model resident, and never before an iteration that
    evaluates or saves (a checkpoint holds no rollout in flight); True: the same, but a plan that
    sleeps or offloads is an error; False: never."""
    offload_idle_models: object = "auto"
    """Colocated placement on GPU: True moves the models (and optimizer states) of the roles not at
    work to pinned CPU memory between phases, so one role at a time holds GPU memory; False keeps
    them all resident; 'auto' keeps them resident when they fit together with room for
    activations (decided from their sizes and the device's free memory, logged and recorded in
    provenance), and offloads otherwise."""

    def __post_init__(self) -> None:
        s = "ppo"
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
              "ppo.seed", self.seed, "must be a non-negative integer")
        for name in ("total_steps", "eval_every", "save_every", "final_window",
                     "rollout_micro_batch_size", "num_rollout_batches", "samples_per_prompt",
                     "max_prompt_length", "max_response_length", "ppo_epochs", "mini_batch_size",
                     "micro_batch_size", "kl_horizon", "eval_samples_per_prompt"):
            positive_int(s, name, getattr(self, name))
        for name in ("keep_checkpoints", "top_k", "lr_warmup_steps", "torch_threads", "forward_micro_batch_size",
                     "max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch", "lora_rank"):
            positive_int(s, name, getattr(self, name), minimum=0)
        number(s, "temperature", self.temperature, 0.0, 100.0, lo_open=True)
        number(s, "eval_temperature", self.eval_temperature, 0.0, 100.0)
        number(s, "top_p", self.top_p, 0.0, 1.0, lo_open=True)
        number(s, "actor_learning_rate", self.actor_learning_rate, 0.0, 1.0)
        number(s, "critic_learning_rate", self.critic_learning_rate, 0.0, 1.0)
        number(s, "weight_decay", self.weight_decay, 0.0, 1.0)
        number(s, "adam_beta1", self.adam_beta1, 0.0, 1.0, hi_open=True)
        number(s, "adam_beta2", self.adam_beta2, 0.0, 1.0, hi_open=True)
        number(s, "adam_eps", self.adam_eps, 0.0, 1.0, lo_open=True)
        number(s, "max_grad_norm", self.max_grad_norm, 0.0, 1e6)
        number(s, "clip_range", self.clip_range, 0.0, 1.0, lo_open=True, hi_open=True)
        check(self.dual_clip == 0 or (isinstance(self.dual_clip, (int, float)) and self.dual_clip > 1),
              "ppo.dual_clip", self.dual_clip, "must be 0 (off) or a number > 1")
        number(s, "value_clip_range", self.value_clip_range, 0.0, 1e6)
        number(s, "entropy_coef", self.entropy_coef, 0.0, 10.0)
        number(s, "kl_coef", self.kl_coef, 0.0, 100.0)
        number(s, "kl_target", self.kl_target, 0.0, 100.0, lo_open=True)
        number(s, "gamma", self.gamma, 0.0, 1.0)
        number(s, "lam", self.lam, 0.0, 1.0)
        choice(s, "rollout_backend", self.rollout_backend, ("hf", "vllm"))
        choice(s, "prompt_truncation", self.prompt_truncation, ("error", "left", "right"))
        choice(s, "lr_schedule", self.lr_schedule, ("constant", "linear", "cosine"))
        choice(s, "loss_aggregation", self.loss_aggregation, ("token_mean", "seq_mean"))
        choice(s, "kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        choice(s, "kl_mode", self.kl_mode, ("reward", "loss"))
        choice(s, "adv_estimator", self.adv_estimator, tuple(estimators()))
        choice(s, "device", self.device, ("auto", "cpu", "cuda"))
        choice(s, "dtype", self.dtype, ("float32", "bfloat16"))
        positive_int(s, "world_size", self.world_size)
        choice(s, "placement", self.placement, ("auto", "local", "colocated", "split"))
        choice(s, "vllm_model_runner", self.vllm_model_runner, ("auto", "v1", "v2"))
        number(s, "cpus_per_rank", self.cpus_per_rank, 0.0, 1024.0, lo_open=True)
        for name in ("offload_idle_models", "vllm_sleep", "overlap_rollout"):
            value = getattr(self, name)
            check(isinstance(value, bool) or value == "auto", f"ppo.{name}", value, "must be 'auto', True or False")
        number(s, "vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization, 0.0, 1.0,
               lo_open=True, hi_open=True)
        check(isinstance(self.critic_lora_rank, int) and not isinstance(self.critic_lora_rank, bool)
              and self.critic_lora_rank >= -1, "ppo.critic_lora_rank", self.critic_lora_rank,
              "must be -1 (the actor's ppo.lora_rank), 0 (full fine-tuning) or a positive rank")
        number(s, "lora_alpha", self.lora_alpha, 0.0, 1e6, lo_open=True)
        number(s, "lora_dropout", self.lora_dropout, 0.0, 1.0, hi_open=True)
        targets = self.lora_target_modules
        check(targets == "all-linear" or (isinstance(targets, (list, tuple)) and bool(targets)
                                          and all(isinstance(t, str) and t for t in targets)),
              "ppo.lora_target_modules", targets,
              "must be 'all-linear' or a non-empty list of module names such as ['q_proj', 'v_proj']")
        for name in ("adaptive_kl", "whiten_advantages", "grpo_normalize_std", "rollout_logprobs",
                     "vllm_per_request_seeds", "vllm_own_process", "torch_compile", "gradient_checkpointing",
                     "deterministic"):
            check(isinstance(getattr(self, name), bool), f"ppo.{name}", getattr(self, name),
                  "must be True or False")
        check(isinstance(self.init_from, str), "ppo.init_from", self.init_from, "must be a path string")
        # Cross-field rules.
        if self.rollout_logprobs:
            check(self.rollout_backend == "vllm", "ppo.rollout_logprobs", self.rollout_logprobs,
                  "needs ppo.rollout_backend = 'vllm' (the HF backend returns no sampling log-probs)")
        if self.vllm_own_process:
            check(self.rollout_backend == "vllm", "ppo.vllm_own_process", self.vllm_own_process,
                  "needs ppo.rollout_backend = 'vllm' (the HF backend generates in the trainer)")
        with_critic = " or ".join(repr(name) for name, e in estimators().items() if e.uses_critic)
        if self.overlap_rollout is True:
            check(self.rollout_backend == "vllm" and self.uses_critic, "ppo.overlap_rollout",
                  self.overlap_rollout, f"needs ppo.rollout_backend = 'vllm' and a critic (ppo.adv_estimator = "
                  f"{with_critic}): the next rollout overlaps the critic's update; use 'auto' or False")
        group = self.estimator.min_samples_per_prompt
        if group > 1:
            check(self.samples_per_prompt >= group, "ppo.samples_per_prompt", self.samples_per_prompt,
                  f"must be >= {group} when ppo.adv_estimator = {self.adv_estimator!r} (the group baseline "
                  f"needs a group)")
        if not self.uses_critic:
            check(self.critic_lora_rank == -1, "ppo.critic_lora_rank", self.critic_lora_rank,
                  f"is set but ppo.adv_estimator = {self.adv_estimator!r} has no critic; remove it, or use "
                  f"ppo.adv_estimator = {with_critic}")
        if not self.lora_rank and self.resolved_critic_lora_rank <= 0:  # no adapters anywhere
            for name in LORA_SETTINGS:
                default = PPOConfig.__dataclass_fields__[name].default
                check(getattr(self, name) == default, f"ppo.{name}", getattr(self, name),
                      f"is set but no model has LoRA adapters (ppo.lora_rank = 0); set ppo.lora_rank > 0 "
                      f"(or ppo.critic_lora_rank > 0) to train adapters, or remove ppo.{name}")
        buffer = self.rollout_batch_size
        check(buffer % self.mini_batch_size == 0, "ppo.mini_batch_size", self.mini_batch_size,
              f"must divide the rollout buffer (rollout_micro_batch_size x num_rollout_batches x "
              f"samples_per_prompt = {buffer})")
        check(self.mini_batch_size % self.micro_batch_size == 0, "ppo.micro_batch_size",
              self.micro_batch_size, f"must divide ppo.mini_batch_size = {self.mini_batch_size}")
        if self.max_tokens_per_micro_batch:  # every sequence must fit in one micro-batch
            longest = self.max_prompt_length + self.max_response_length
            check(self.max_tokens_per_micro_batch >= longest, "ppo.max_tokens_per_micro_batch",
                  self.max_tokens_per_micro_batch,
                  f"must be 0 (off) or at least ppo.max_prompt_length + ppo.max_response_length = {longest} "
                  f"(every sequence must fit in one micro-batch)")
        if self.forward_max_tokens_per_micro_batch:
            check(bool(self.max_tokens_per_micro_batch), "ppo.forward_max_tokens_per_micro_batch",
                  self.forward_max_tokens_per_micro_batch,
                  "needs packed micro-batches: set ppo.max_tokens_per_micro_batch too (or use "
                  "ppo.forward_micro_batch_size for padded ones)")
            check(self.forward_max_tokens_per_micro_batch >= self.max_tokens_per_micro_batch,
                  "ppo.forward_max_tokens_per_micro_batch", self.forward_max_tokens_per_micro_batch,
                  f"must be 0 (the update's budget) or at least ppo.max_tokens_per_micro_batch = "
                  f"{self.max_tokens_per_micro_batch} (a forward-only pass holds less than an update)")
        check(self.world_size == 1 or self.placement != "local", "ppo.placement", self.placement,
              f"must be 'colocated', 'split' or 'auto' when ppo.world_size = {self.world_size} "
              f"('local' runs every role in one process)")
        # Every rank takes an equal share of each mini-batch: sharded models need every rank to run
        # the same number of forward passes, or their all-gathers wait on each other forever.
        check(self.mini_batch_size % self.world_size == 0, "ppo.mini_batch_size", self.mini_batch_size,
              f"must be a multiple of ppo.world_size = {self.world_size} (each rank takes an equal share)")

    @property
    def rollout_batch_size(self) -> int:
        """Sequences in one iteration's rollout buffer."""
        return self.rollout_micro_batch_size * self.num_rollout_batches * self.samples_per_prompt

    @property
    def on_policy_update(self) -> bool:
        """Whether the update is on-policy: one epoch over one mini-batch on one process, with no KL
        in the reward. Its first forward is then the very policy that sampled, so the old log-prob
        pass is skipped and the update's own log-probs stand in for them (as TRL and verl do); the
        record is the same. With the KL in the reward (kl_coef > 0) the advantages need the old
        log-probs before the update."""
        kl_in_reward = self.kl_mode == "reward" and (self.kl_coef > 0 or self.adaptive_kl)
        return (self.ppo_epochs == 1 and self.rollout_batch_size <= self.mini_batch_size and not kl_in_reward
                and self.world_size == 1)

    @property
    def forward_batch_size(self) -> int:
        """Sequences per forward-only pass (`forward_micro_batch_size`, default micro_batch_size)."""
        return self.forward_micro_batch_size or self.micro_batch_size

    @property
    def forward_max_tokens(self) -> int:
        """Token budget of a forward-only micro-batch (`forward_max_tokens_per_micro_batch`, default the
        update's `max_tokens_per_micro_batch`; 0: padded micro-batches)."""
        return self.forward_max_tokens_per_micro_batch or self.max_tokens_per_micro_batch

    @property
    def bf16_autocast(self) -> bool:
        """Whether a GPU computes in bf16 autocast: `dtype = 'bfloat16'`, or any LoRA (its frozen base
        is bf16 on a GPU)."""
        return self.dtype == "bfloat16" or self.lora_rank > 0 or self.resolved_critic_lora_rank > 0

    def host_threads(self, device_type: str) -> int:
        """torch's intra-op threads for a one-process run on `device_type`: `torch_threads`, else
        `GPU_TORCH_THREADS` (at most the cores) on a GPU; 0 on a CPU (the pinned numerics decide)."""
        if self.torch_threads:
            return self.torch_threads
        return min(GPU_TORCH_THREADS, os.cpu_count() or 1) if device_type == "cuda" else 0

    @property
    def estimator(self) -> "AdvantageEstimator":
        """`ppo.adv_estimator`'s entry of rlhf/algos.py `ADVANTAGE_ESTIMATORS`."""
        return estimators()[self.adv_estimator]

    @property
    def uses_critic(self) -> bool:
        """A value model is built, trained and checkpointed beside the policy (the estimator's say)."""
        return self.estimator.uses_critic

    @property
    def resolved_critic_lora_rank(self) -> int:
        """The critic's LoRA rank (`critic_lora_rank`, -1 resolved to the actor's)."""
        return self.lora_rank if self.critic_lora_rank == -1 else self.critic_lora_rank

    @property
    def resolved_placement(self) -> str:
        """'local', 'colocated' or 'split' ('auto' resolved by world size)."""
        if self.placement == "auto":
            return "local" if self.world_size == 1 else "colocated"
        return self.placement


# Bindings that say where a run executes, not what it computes: a run may resume under other values.
PLACEMENT_BINDINGS = ("ppo.world_size", "ppo.placement", "ppo.cpus_per_rank", "ppo.offload_idle_models",
                      "ppo.overlap_rollout")


def without_placement(config_text: str) -> str:
    """The operative config without the bindings that say where a run executes: a checkpoint
    resumes at any world size and placement."""
    return "\n".join(line for line in config_text.splitlines()
                     if not line.strip().startswith(PLACEMENT_BINDINGS))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which policy to tune (gin name: `model`)."""

    name_or_path: str = "tiny"
    """'tiny' (the embedded default: built locally, SFT warm start) or a local checkpoint dir."""
    tokenizer_path: str = ""
    """Tokenizer dir; empty means the model's own dir."""
    critic_init: str = "policy"
    """'policy': the critic's backbone starts from the policy's weights; 'random': fresh head and backbone."""

    def __post_init__(self) -> None:
        check(isinstance(self.name_or_path, str) and bool(self.name_or_path), "model.name_or_path",
              self.name_or_path, "must be 'tiny' or a local model directory")
        choice("model", "critic_init", self.critic_init, ("policy", "random"))


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the embedded default model (gin name: `tiny_model`); a Llama architecture."""

    hidden_size: int = 64
    """Width of the residual stream (the model dimension)."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size."""
    intermediate_size: int = 256
    """Width of each block's MLP hidden layer."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            positive_int("tiny_model", name, getattr(self, name))
        check(self.hidden_size % self.num_heads == 0, "tiny_model.num_heads", self.num_heads,
              f"must divide tiny_model.hidden_size = {self.hidden_size}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Prompts and reward (gin name: `task`)."""

    name: str = "arithmetic"
    """'arithmetic' (the embedded synthetic task) or 'file' (prompts from train_path / eval_path)."""
    train_path: str = ""
    """JSONL or parquet of prompts (task.name = 'file')."""
    eval_path: str = ""
    """Held-out JSONL or parquet (task.name = 'file'); empty holds out eval_fraction of train_path."""
    prompt_key: str = "prompt"
    """The column holding the prompt (format 'plain'): a string or chat messages."""
    answer_key: str = "answer"
    """The column holding the reference answer (format 'plain'), what the rule reward checks."""
    reward_fn: object = "arithmetic"
    """The rule that scores a response: a name in the reward registry (rlhf/rewards.py:
    'arithmetic', 'gsm8k', 'exact_match'), 'auto' (each row's scorer by its `data_source`, verl's
    names such as 'openai/gsm8k' included), or a mapping {data_source: reward name}. With 'auto' or
    a mapping, a row whose data_source has no scorer stops the run at start."""
    eval_size: int = 128
    """Held-out prompts evaluated (the first N of the held-out split)."""
    eval_fraction: float = 0.2
    """Fraction of prompts held out when no eval_path is given (a deterministic hash split)."""
    max_operand: int = 20
    """Arithmetic task: operands are drawn from [0, max_operand]."""
    missing_eos_penalty: float = 0.5
    """Subtracted from the reward of a response cut at max_response_length without EOS."""
    format_reward: float = 0.1
    """Added for a well-formed answer (a number followed by EOS), right or wrong."""
    format: str = "auto"
    """Rows of train_path / eval_path: 'plain' (prompt_key / answer_key), 'verl' (data_source,
    prompt as chat messages, reward_model.ground_truth, extra_info), or 'auto' (from the columns)."""
    chat_template: str = "auto"
    """'auto' (the policy tokenizer's chat template with the generation prompt when it has one, else
    the raw text), 'none' (raw text), or the path of a Jinja chat template file."""
    system_prompt: str = ""
    """Prepended as a system message when the conversation has none."""
    instruction_suffix: str = ""
    """Appended to the last user message (e.g. 'Let's think step by step and output the final answer
    after "####".')."""

    def __post_init__(self) -> None:
        choice("task", "name", self.name, ("arithmetic", "file"))
        choice("task", "format", self.format, ("auto", "plain", "verl"))
        check(isinstance(self.chat_template, str) and bool(self.chat_template), "task.chat_template",
              self.chat_template, "must be 'auto', 'none' or the path of a Jinja chat template file")
        if self.chat_template not in ("auto", "none"):
            from pathlib import Path
            check(Path(self.chat_template).is_file(), "task.chat_template", self.chat_template,
                  "no such template file (use 'auto', 'none' or the path of a Jinja chat template)")
        for name in ("system_prompt", "instruction_suffix"):
            check(isinstance(getattr(self, name), str), f"task.{name}", getattr(self, name), "must be a string")
        positive_int("task", "eval_size", self.eval_size)
        number("task", "eval_fraction", self.eval_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        positive_int("task", "max_operand", self.max_operand)
        number("task", "missing_eos_penalty", self.missing_eos_penalty, 0.0, 100.0)
        number("task", "format_reward", self.format_reward, 0.0, 100.0)
        if self.name == "file":
            check(bool(self.train_path), "task.train_path", self.train_path,
                  "must name a JSONL or parquet file when task.name = 'file'")
        else:
            for name in ("train_path", "eval_path"):
                check(not getattr(self, name), f"task.{name}", getattr(self, name),
                      "is set but task.name = 'arithmetic' trains on the embedded task and ignores it; "
                      "set task.name = 'file' to train on the file")
        from rlhf.rewards import REWARD_FUNCTIONS  # local import: rewards imports nothing from here
        names = tuple(sorted(REWARD_FUNCTIONS))
        if isinstance(self.reward_fn, dict):
            check(bool(self.reward_fn) and all(isinstance(k, str) and k and v in names
                                               for k, v in self.reward_fn.items()),
                  "task.reward_fn", self.reward_fn,
                  f"a mapping takes each data_source (a non-empty string) to a reward name: "
                  f"{', '.join(map(repr, names))}")
        else:
            choice("task", "reward_fn", self.reward_fn, names + ("auto",))


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """What the policy is trained on (gin name: `reward`): the task's rule, a reward model, or both.

    The missing-EOS penalty (task.missing_eos_penalty) is subtracted on top of every kind. Whenever
    the task has ground truth, rule correctness is logged as gold accuracy beside the model's score."""

    kind: str = "rule"
    """'rule' (task.reward_fn), 'model' (a reward model's score) or 'combined'
    (rule_weight x rule + model_weight x model score)."""
    model_path: str = ""
    """A local AutoModelForSequenceClassification checkpoint with num_labels = 1 (kind 'model' or
    'combined'), e.g. one written by `python -m rlhf.reward_model`."""
    tokenizer_path: str = ""
    """The reward model's tokenizer dir; empty means model_path."""
    chat_template: str = "auto"
    """How the reward model reads a conversation: 'auto' (its tokenizer's chat template when it has
    one, else raw prompt + response text), 'none', or a Jinja template file. Each rollout's prompt
    and decoded response are encoded exactly as reward-model training encodes a pair
    (rlhf/reward_model/score.py `encode_conversation`), whether or not it shares the policy's tokenizer."""
    rule_weight: float = 1.0
    """Weight of the rule's reward when kind = 'combined'."""
    model_weight: float = 1.0
    """Weight of the reward model's (normalised, clipped) score when kind = 'combined'."""
    normalize: str = "none"
    """The model score: 'none', 'batch' (whiten over each rollout batch) or 'running' (running
    mean / std over all rollouts so far, kept in checkpoints)."""
    clip: float = 0.0
    """Clip the (normalised) model score to [-clip, clip]; 0 disables."""
    micro_batch_size: int = 32
    """Sequences per reward-model forward."""

    def __post_init__(self) -> None:
        choice("reward", "kind", self.kind, ("rule", "model", "combined"))
        choice("reward", "normalize", self.normalize, ("none", "batch", "running"))
        number("reward", "rule_weight", self.rule_weight, -100.0, 100.0)
        number("reward", "model_weight", self.model_weight, -100.0, 100.0)
        number("reward", "clip", self.clip, 0.0, 1e6)
        positive_int("reward", "micro_batch_size", self.micro_batch_size)
        for name in ("model_path", "tokenizer_path", "chat_template"):
            check(isinstance(getattr(self, name), str), f"reward.{name}", getattr(self, name), "must be a string")
        if self.kind != "rule":
            check(bool(self.model_path), "reward.model_path", self.model_path,
                  f"must name a reward-model checkpoint dir when reward.kind = {self.kind!r}")
        else:  # the model score's settings do nothing under the rule
            for name in ("model_path", "tokenizer_path", "normalize", "clip"):
                default = RewardConfig.__dataclass_fields__[name].default
                check(getattr(self, name) == default, f"reward.{name}", getattr(self, name),
                      "is set but reward.kind = 'rule' trains on task.reward_fn and ignores it; set "
                      "reward.kind = 'model' or 'combined' to score with the reward model")
        check(bool(self.chat_template), "reward.chat_template", self.chat_template,
              "must be 'auto', 'none' or the path of a Jinja chat template file")

    @property
    def uses_model(self) -> bool:
        return self.kind in ("model", "combined")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start of the embedded default (gin name: `sft`)."""

    steps: int = 500
    """Optimizer steps of the warm start."""
    batch_size: int = 64
    """Examples per SFT step."""
    learning_rate: float = 3e-3
    """AdamW learning rate of the warm start."""
    seed: int = 1234
    """Fixed apart from ppo.seed, so every PPO seed starts from the same SFT policy."""

    def __post_init__(self) -> None:
        positive_int("sft", "steps", self.steps)
        positive_int("sft", "batch_size", self.batch_size)
        number("sft", "learning_rate", self.learning_rate, 0.0, 1.0, lo_open=True)
        positive_int("sft", "seed", self.seed, minimum=0)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one run depends on."""

    ppo: PPOConfig
    """The algorithm, rollouts and schedule (gin `ppo`)."""
    model: ModelConfig
    """The policy (gin `model`)."""
    task: TaskConfig
    """Prompts and the rule reward (gin `task`)."""
    sft: SFTConfig
    """The embedded default's warm start (gin `sft`)."""
    tiny_model: TinyModelConfig
    """The embedded default's shape (gin `tiny_model`)."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """What PPO trains on: the rule, a reward model, or both (gin `reward`)."""

    def __post_init__(self) -> None:
        # Cross-scope rules: each names the binding to change.
        if self.model.name_or_path == "tiny":
            check(self.task.name == "arithmetic", "task.name", self.task.name,
                  "model.name_or_path = 'tiny' is warm-started on the arithmetic task only; use task.name = "
                  "'arithmetic', or build a warm start on your data (python -m experiments sft) and "
                  "point model.name_or_path at it")
        if self.ppo.init_from:
            from pathlib import Path
            actor = Path(self.ppo.init_from) / "actor"
            check((actor / "config.json").is_file() or (actor / "adapter_config.json").is_file(), "ppo.init_from",
                  self.ppo.init_from, "not a checkpoint dir (a run's checkpoints/step_N, holding actor/config.json, "
                  "or actor/adapter_config.json for LoRA)")
            check_adapter_starts(self.ppo)
        limit, source = model_position_limit(self)
        need = self.ppo.max_prompt_length + self.ppo.max_response_length
        if limit is not None and need > limit:
            raise ConfigError(
                f"ppo.max_prompt_length + ppo.max_response_length = {self.ppo.max_prompt_length} + "
                f"{self.ppo.max_response_length} = {need} is invalid: exceeds the model's position limit "
                f"({source} = {limit}); lower ppo.max_prompt_length or ppo.max_response_length")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

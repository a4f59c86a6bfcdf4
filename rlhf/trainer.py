"""The PPO loop: one iteration is a sequence of named, timed phases.

    generate -> reward -> reference logprobs -> old logprobs -> values -> advantages
             -> update actor -> update critic -> sync weights -> log (-> evaluate, save)

An on-policy update (`ppo.on_policy_update`: one epoch over one mini-batch, no KL in the reward)
skips the old log-prob pass: the update's first forward is the policy that sampled.

With `ppo.overlap_rollout` (a GPU with vLLM and a critic) the weights are synced right after the
actor's update and the next iteration's generate runs beside this one's critic update: it needs
only the actor's synced weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple, cast

import torch
import transformers

from rlhf import algos, checkpoint, heap, memory
from rlhf.allocator import OutOfMemory, oom_line
from rlhf.atomic import write_json
from rlhf.batch import Batch
from rlhf.chat import PromptRenderer, check_rows, prompt_key
from rlhf.config import RunConfig
from rlhf.data import Example, PromptSampler, check_prompt_lengths, dataset_hash, load_task
from rlhf.determinism import deterministic_algorithms
from rlhf.gpu_monitor import PhaseMemory
from rlhf.memory.formulas import GIB
from rlhf.metrics import (
    PERF_SUMMARY,
    PHASE_KEYS,
    MetricLogger,
    is_machine_metric,
    read_metrics,
    step_record,
    window_means,
)
from rlhf.models import check_vocab_fits, load_tokenizer
from rlhf.placement import build_roles
from rlhf.placement.proxy import submit
from rlhf.profiling import PhaseClock, in_phase, phase_range, profiled_iteration
from rlhf.rollout import SamplingParams, SeedStream, decode_responses, derive_seed, rollout_logprob_gap
from rlhf.run_dir import PROFILE_DIR
from rlhf.tiny import prepare_tiny


class TrainingDiverged(RuntimeError):
    """A loss or metric became NaN or infinite."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        from rlhf.start_checks import check_machine
        check_machine(device=name)
    return torch.device(name)


def resolve_model_paths(cfg: RunConfig, log=print) -> tuple[Path, Path]:
    """(policy dir, tokenizer dir): the tiny default is built (once, cached) on demand. The policy is
    checked first (a causal LM, its shape, the LoRA bindings against its layers), as
    `python -m rlhf.memory` checks it, before any weights load."""
    memory.check_policy(cfg)
    if cfg.model.name_or_path == "tiny":
        return prepare_tiny(cfg.tiny_model, cfg.sft, cfg.task, log=log)
    model_dir = Path(cfg.model.name_or_path)
    return model_dir, Path(cfg.model.tokenizer_path or model_dir)


def policy_tokenizer(cfg: RunConfig, log=print) -> Tuple[Path, Path, transformers.PreTrainedTokenizerBase]:
    """(policy dir, tokenizer dir, tokenizer): the paths as `resolve_model_paths` checks them and the
    policy's tokenizer, held to the model's embedding (`check_vocab_fits`); a bad one is a ConfigError
    line naming its binding."""
    model_dir, tokenizer_dir = resolve_model_paths(cfg, log)
    binding = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.name_or_path"
    tokenizer = load_tokenizer(tokenizer_dir, binding)
    check_vocab_fits(tokenizer, binding, tokenizer_dir, "model.name_or_path", model_dir)
    return model_dir, tokenizer_dir, tokenizer


@dataclasses.dataclass
class TaskPrompts:
    """The policy's tokenizer and prompt renderer, and the task's splits, as a run loads them at its start."""

    model_dir: Path
    tokenizer_dir: Path
    tokenizer: transformers.PreTrainedTokenizerBase
    prompts: PromptRenderer
    train: List[Example]
    held: List[Example]
    """The whole held-out split; the run evaluates its first task.eval_size (`eval`)."""
    eval: List[Example]

    @classmethod
    def load(cls, cfg: RunConfig, log=print) -> "TaskPrompts":
        """The policy checked (`resolve_model_paths`), its tokenizer loaded and held to the model's
        embedding, the chat settings and the task's splits read: one ConfigError line for the first bad
        one. `python -m rlhf.memory` loads them as the run does to measure the data's prompts."""
        model_dir, tokenizer_dir, tokenizer = policy_tokenizer(cfg, log)
        prompts = PromptRenderer.from_task(tokenizer, cfg.task)  # rollout, evaluation and reward model alike
        train, held = load_task(cfg.task)
        if not held[:cfg.task.eval_size]:
            from rlhf.errors import ConfigError
            raise ConfigError("the task's held-out split is empty: set task.eval_path or task.eval_fraction")
        return cls(model_dir, tokenizer_dir, tokenizer, prompts, train, held, held[:cfg.task.eval_size])

    def lengths(self) -> Dict[str, List[int]]:
        """Every train and evaluation prompt rendered once, in tokens, by split (`check_rows`: a row its
        chat template rejects is one line)."""
        return {name: check_rows(examples, self.prompts.ids, "task.chat_template")
                for name, examples in (("train", self.train), ("eval", self.eval))}


def longest_prompt(lengths: Dict[str, List[int]]) -> Optional[int]:
    """The data's longest prompt in tokens over every split (None for no prompts). The memory plan sizes
    the policy's sequences by it, capped at ppo.max_prompt_length, which the rollout cuts a longer
    one to (rlhf/memory/plan.py `planned_prompt`)."""
    return max((n for ns in lengths.values() for n in ns), default=None)


class PhaseTimer:
    """Wall time of each phase and, for a GPU in this process, the most memory torch held during it
    (rlhf/gpu_monitor.py `PhaseMemory`: allocated and reserved, each phase's cache given back as it
    ends), recorded as `perf/memory_gb/<phase>` and `perf/memory_reserved_gb/<phase>`. On Ray the ranks'
    hosts measure the memory of the calls made under each phase's name (rlhf/profiling.py `in_phase`) and report it
    with the step's device report. A phase that runs out of GPU memory raises `OutOfMemory` with the
    line `out_of_memory(phase, allocated GiB, reserved GiB)` gives. `host_cpu` is the CPU time of the
    thread that ran each phase (`time.thread_time`): near the phase's wall time the host, not the
    device, sets its pace (a decoding loop driven step by step from here)."""

    annotate = False
    """Each phase also a named range of torch.profiler, under which the profiled iteration's host waits
    are filed (`rlhf/profiling.py` `phase_range`): set while one iteration is profiled."""

    def __init__(self, device: torch.device | None = None, out_of_memory=None, off_device=None):
        self.clock = PhaseClock()
        self.phase_memory = PhaseMemory(device, off_device)
        self.out_of_memory = out_of_memory

    @property
    def times(self) -> Dict[str, float]:
        """Each phase's wall seconds."""
        return self.clock.times

    @property
    def host_cpu(self) -> Dict[str, float]:
        """Each phase's CPU seconds on the thread that ran it."""
        return self.clock.host_cpu

    @property
    def memory(self) -> Dict[str, float]:
        """Each phase's peak allocated GiB (on a GPU in this process)."""
        return self.phase_memory.allocated

    @property
    def reserved(self) -> Dict[str, float]:
        """Each phase's peak reserved GiB (on a GPU in this process)."""
        return self.phase_memory.reserved

    @contextlib.contextmanager
    def __call__(self, name: str):
        with self.clock.measure(name), self.phase_memory.measure(name) as peaks, \
                (phase_range if self.annotate else in_phase)(name):
            try:
                yield
            except torch.OutOfMemoryError as err:
                if self.out_of_memory is None:
                    raise
                raise OutOfMemory(self.out_of_memory(name, *peaks())) from err


class PPOTrainer:
    def __init__(self, cfg: RunConfig, out_dir: str | Path, log=print, ray_address: str | None = None):
        self.cfg = cfg
        self.ppo = cfg.ppo
        self.out = Path(out_dir)
        self.log = log
        transformers.utils.logging.disable_progress_bar()
        # On Ray the ranks hold the devices; this process only steers them (and computes advantages).
        local = self.ppo.resolved_placement == "local"
        self.device = resolve_device(self.ppo.device) if local else torch.device("cpu")
        if self.ppo.host_threads(self.device.type):  # on a GPU, kernel launches: more threads take cores from vLLM
            torch.set_num_threads(self.ppo.host_threads(self.device.type))
        deterministic_algorithms(self.device.type)
        self.autocast_dtype = torch.bfloat16 if self.ppo.bf16_autocast and self.device.type == "cuda" else None

        task = TaskPrompts.load(cfg, log)
        self.model_dir, self.tokenizer_dir, self.tokenizer, self.prompts = (task.model_dir, task.tokenizer_dir,
                                                                            task.tokenizer, task.prompts)
        log(self.prompts.describe())
        self.train_examples, self.eval_examples = task.train, task.eval
        self.data_hash = dataset_hash(task.train + task.held)
        self.sampler = PromptSampler(self.train_examples, seed=self.ppo.seed)
        self.prompt_truncated = self._check_prompts(task, log)

        start_dir = Path(self.ppo.init_from) / "actor" if self.ppo.init_from else self.model_dir
        if self.ppo.init_from:  # verified as --resume verifies a checkpoint: a damaged file is one line here
            checkpoint.check_start_checkpoint(self.ppo.init_from)
        if cfg.model.name_or_path != "tiny":
            checkpoint.check_weights(self.model_dir, "model.name_or_path")
        self.start_checkpoint = str(start_dir)
        # The predicted memory plan, before any model is built: on a GPU a run that cannot fit stops
        # here with one line naming the bindings that would make it fit (rlhf/memory/plan.py).
        self.memory_plan = memory.preflight(cfg, self.model_dir, self.device if local else None, log,
                                            longest_prompt=self.longest_prompt)
        roles = build_roles(cfg, model_dir=self.model_dir, tokenizer_dir=self.tokenizer_dir, tokenizer=self.tokenizer,
                            start_dir=start_dir, device=self.device, autocast_dtype=self.autocast_dtype,
                            ray_address=ray_address, log=log, memory_plan=self.memory_plan)
        self.roles = roles
        assert roles.reward is not None, "build_roles sets the reward phase"
        self.actor, self.critic, self.reference, self.reward = roles.actor, roles.critic, roles.reference, roles.reward
        self.placement, self.close = roles.placement, roles.close
        if self.memory_plan is not None:  # provenance: beside the measured `memory`
            self.placement["memory_predicted"] = self.memory_plan.to_dict()
        self.kl_ctl = (algos.AdaptiveKLController(self.ppo.kl_coef, self.ppo.kl_target, self.ppo.kl_horizon)
                       if self.ppo.adaptive_kl else algos.FixedKLController(self.ppo.kl_coef))
        self.sampling = SamplingParams.from_ppo(self.ppo)
        self.step = 0
        self.overlap = self._overlap_mode(log)
        # Only a sleeping engine leaves memory counted that it does not hold; asking an awake one would
        # wait behind a rollout running ahead (the proxy's calls run in turn).
        self._engine_sleeps = bool((self.placement.get("memory") or {}).get("rollout_sleep"))
        self._ahead = None  # (prompts, calls, pending generation) of the next iteration, when it runs ahead

    def _check_prompts(self, task: TaskPrompts, log) -> Dict[str, float]:
        """Every train and evaluation prompt rendered once before any compute (`TaskPrompts.lengths`)
        and measured against ppo.max_prompt_length (rlhf/data.py `check_prompt_lengths`); with a reward
        model, every conversation encoded as it will be scored. Returns the fraction of each split's
        prompts that are cut ({} under 'error')."""
        splits = {"train": self.train_examples, "eval": self.eval_examples}
        lengths = task.lengths()
        if self.cfg.reward.uses_model:
            from rlhf.roles.reward_model import check_reward_model
            check_reward_model(self.cfg.reward, self.cfg.task, self.train_examples + self.eval_examples)
        fractions = check_prompt_lengths({name: (splits[name], lengths[name]) for name in splits},
                                         self.ppo.max_prompt_length, self.ppo.prompt_truncation, log)
        self._cut_prompts = {prompt_key(ex.prompt) for name in splits for ex, n in zip(splits[name], lengths[name])
                             if n > self.ppo.max_prompt_length}
        self.longest_prompt = longest_prompt(lengths)  # what the memory plan sizes by
        return fractions

    # ----------------------------------------------------------------- phases
    def generate(self, examples: List[Example], sampling: SamplingParams, seed_parts: tuple,
                 samples_per_prompt: int, calls: int) -> Batch:
        """Samples `samples_per_prompt` responses per prompt in `calls` generation calls."""
        requests, calls_made = self._requests(examples, seed_parts, samples_per_prompt, calls)
        return self._assemble(self.actor.generate(requests, sampling), calls_made, samples_per_prompt)

    def _requests(self, examples: List[Example], seed_parts: tuple, samples_per_prompt: int, calls: int):
        """The generation calls' (prompt ids, seed) and the examples each call samples for."""
        per_call = math.ceil(len(examples) / calls)
        calls_made, requests = [], []
        for call in range(calls):
            repeated = [ex for ex in examples[call * per_call:(call + 1) * per_call] for _ in range(samples_per_prompt)]
            if repeated:
                calls_made.append(repeated)
                requests.append(([self.prompts.ids(ex.prompt) for ex in repeated], derive_seed(*seed_parts, call)))
        return requests, calls_made

    def _assemble(self, parts: List[Batch], calls_made: list, samples_per_prompt: int) -> Batch:
        """One rollout `Batch` from the generation calls' results."""
        for out, repeated in zip(parts, calls_made):
            out["prompts"] = [ex.prompt for ex in repeated]
            out["answers"] = [ex.answer for ex in repeated]
            out["data_sources"] = [ex.data_source for ex in repeated]
        pad_id = cast(int, self.tokenizer.pad_token_id)  # load_tokenizer sets one
        batch = Batch.concat(parts, pad_values={"prompt_ids": pad_id, "response_ids": pad_id},
                             left_pad=("prompt_ids", "prompt_mask"))
        batch["responses"] = decode_responses(self.tokenizer, batch)
        n = self.ppo.samples_per_prompt if samples_per_prompt > 1 else 1
        batch["group_ids"] = torch.arange(len(batch)) // n
        return batch

    def token_kl(self, batch: Batch) -> torch.Tensor:
        """KL(actor || reference) per response token [B, R] from the old log-probs (`algos.token_kl`)."""
        return algos.token_kl(batch["old_logprobs"] if "old_logprobs" in batch else None,
                              batch["ref_logprobs"] if "ref_logprobs" in batch else None,
                              batch["response_mask"].float(), self.ppo.kl_estimator)

    def kl_metrics(self, batch: Batch) -> Dict[str, float]:
        kl = self.token_kl(batch)
        return {"kl_divergence": float(algos.masked_mean(kl, batch["response_mask"].float())),
                "actor/kl_seq_sum": float(kl.sum(-1).mean())}

    def compute_advantages(self, batch: Batch) -> Dict[str, float]:
        """`algos.compute_advantages` on the scored rollout, with this step's KL coefficient; `batch`
        gains advantages (and returns, for a critic)."""
        mask = batch["response_mask"].float()
        result = algos.compute_advantages(scores=batch["scores"], mask=mask, group_ids=batch["group_ids"],
                                          values=batch["values"] if "values" in batch else None,
                                          kl=self.token_kl(batch), kl_coef=self.kl_ctl.value, ppo=self.ppo)
        if result.returns is not None:
            batch["returns"] = result.returns
        batch["advantages"] = result.advantages
        rewards = result.token_rewards
        kl_metrics = self.kl_metrics(batch)
        out = {"kl_divergence": kl_metrics["kl_divergence"],
               "kl_coef": float(self.kl_ctl.value),
               "actor/kl_seq_sum": kl_metrics["actor/kl_seq_sum"],
               "critic/token_reward_mean": float(algos.masked_mean(rewards, mask))}
        if self.critic is not None:
            out["critic/values_mean"] = float(algos.masked_mean(batch["values"], mask))
            out["critic/returns_mean"] = float(algos.masked_mean(batch["returns"], mask))
            out["critic/explained_variance"] = float(algos.explained_variance(batch["values"], batch["returns"], mask))
        return out

    # ----------------------------------------------------------------- the next rollout, ahead
    def _overlap_mode(self, log) -> bool:
        """Whether the next rollout may run during the critic's update (`ppo.overlap_rollout`):
        on a GPU, with vLLM and a critic, while the memory plan keeps the engine awake and every
        model resident (an offloaded critic or a sleeping engine would fight for that memory)."""
        ppo = self.ppo
        memory_plan = self.placement.get("memory") or {}
        why_not = None
        if ppo.rollout_backend != "vllm" or self.critic is None:
            why_not = "it needs the vLLM backend and a critic"
        elif memory_plan.get("rollout_sleep") or memory_plan.get("offload"):
            why_not = "the memory plan puts the engine to sleep or offloads models between phases"
        elif self.placement.get("device") != "cuda":
            why_not = "it runs on a GPU only"
        if why_not and ppo.overlap_rollout is True:
            from rlhf.errors import ConfigError
            raise ConfigError(f"ppo.overlap_rollout = True is invalid here: {why_not}; use 'auto' or False")
        on = ppo.overlap_rollout is not False and why_not is None
        if on:
            log("the next rollout overlaps the critic's update (ppo.overlap_rollout)")
        elif ppo.overlap_rollout is not False and memory_plan.get("rollout_sleep") is not None:
            log(f"rollouts run in turn: {why_not}")  # a GPU run that could have overlapped says why not
        return on

    def _start_next_rollout(self) -> None:
        """Submits the next iteration's generation (prompts drawn now, in order) and returns at once."""
        ppo = self.ppo
        prompts = self.sampler.next(ppo.rollout_micro_batch_size * ppo.num_rollout_batches)
        requests, calls_made = self._requests(prompts, (ppo.seed, self.step + 1), ppo.samples_per_prompt,
                                              ppo.num_rollout_batches)
        self._ahead = (prompts, calls_made, submit(self.actor, "generate", requests, self.sampling))

    def drain(self) -> None:
        """Waits for a rollout running ahead and drops it (its prompts are spent): for a caller
        that drives `train_step` itself and stops before the iteration that would take it."""
        if self._ahead is not None:
            self._ahead[2].result()
            self._ahead = None

    def _may_run_ahead(self) -> bool:
        """No rollout runs ahead of an iteration that ends the run, evaluates or saves: a checkpoint
        then holds the sampler exactly where the sequential loop leaves it, and evaluation (which
        uses the same engine) never runs beside a rollout."""
        ppo, step = self.ppo, self.step
        return (self.overlap and step < ppo.total_steps and step % ppo.eval_every != 0
                and step % ppo.save_every != 0)

    # ----------------------------------------------------------------- loop
    def train_step(self) -> Dict:
        """One PPO iteration: its phases, each timed under its name, then the step's record
        (rlhf/metrics.py `step_record`)."""
        ppo, step = self.ppo, self.step
        timer = PhaseTimer(self.device, out_of_memory=self.out_of_memory_line,
                           off_device=self.actor.rollout_asleep_bytes if self._engine_sleeps else None)
        start = time.perf_counter()
        ahead_s = 0.0
        with timer("generate"):
            if self._ahead is not None:  # submitted during the previous iteration's critic update
                prompts, calls_made, pending = self._ahead
                self._ahead = None
                ahead_s = time.perf_counter() - pending.submitted  # what ran beside the previous iteration
                batch = self._assemble(pending.result(), calls_made, ppo.samples_per_prompt)
            else:
                prompts = self.sampler.next(ppo.rollout_micro_batch_size * ppo.num_rollout_batches)
                batch = self.generate(prompts, self.sampling, (ppo.seed, step), ppo.samples_per_prompt,
                                      ppo.num_rollout_batches)
        with timer("rollout_release"):  # vLLM sleep mode: frees its KV cache and weights until the next sync
            self.actor.release_memory()
        if self.roles.reward_model is not None:
            with timer("reward_model"):
                batch["rm_scores"] = self.reward.model_scores(batch)
        with timer("reward"):
            for key, value in self.reward.score(batch).items():
                batch[key] = value
        with timer("reference"):
            batch["ref_logprobs"] = self.reference.compute_logprobs(batch)
        on_policy = ppo.on_policy_update  # the update's own log-probs are the old ones: no pass for them
        if not on_policy:
            with timer("old_logprobs"):
                batch["old_logprobs"], entropy = self.actor.compute_logprobs(batch)
        if self.critic is not None:
            with timer("values"):
                batch["values"] = self.critic.compute_values(batch)
        with timer("advantages"):
            advantage_stats = self.compute_advantages(batch)
        # The actor first: the next rollout needs only its new weights, so with overlap it runs
        # while the critic trains (the two updates read the same buffer and touch nothing of each
        # other's, so their order changes no number).
        with timer("update_actor"):
            actor_stats = self.actor.update(batch, shuffle_seed=derive_seed(ppo.seed, step, SeedStream.ACTOR_SHUFFLE),
                                            kl_coef=self.kl_ctl.value)
        if on_policy:
            batch["old_logprobs"], entropy = actor_stats.pop("old_logprobs"), actor_stats.pop("entropy_old")
            advantage_stats.update(self.kl_metrics(batch))  # the same keys, from the log-probs the update computed
        # The next rollout needs the new weights now when it runs ahead; otherwise they go to the engine
        # after the critic's update, so a sleeping engine stays asleep through it (the memory plan's
        # update_critic counts no engine then). The order changes no number.
        ahead = self._may_run_ahead()
        if ahead:
            with timer("sync_weights"):
                self.actor.sync_weights()
            self._start_next_rollout()
        critic_stats = {}
        if self.critic is not None:
            with timer("update_critic"):
                critic_stats = self.critic.update(batch,
                                                  shuffle_seed=derive_seed(ppo.seed, step, SeedStream.CRITIC_SHUFFLE))
        if not ahead:
            with timer("sync_weights"):
                self.actor.sync_weights()
        self.kl_ctl.update(advantage_stats["kl_divergence"], len(batch))
        record = step_record(batch, advantages=advantage_stats, critic=critic_stats, actor=actor_stats,
                             entropy_old=entropy, logprob_gap=rollout_logprob_gap(batch),
                             prompt_truncated_fraction=self._truncated_fraction(prompts),
                             phase_times=timer.times, phase_memory_gb=timer.memory,
                             phase_reserved_gb=timer.reserved, phase_host_cpu_s=timer.host_cpu,
                             step_s=time.perf_counter() - start, generate_ahead_s=ahead_s,
                             max_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                             device_report=self.roles.device_report())
        self._check_finite(record)
        return record

    def out_of_memory_line(self, phase: str, allocated_gib: float | None, reserved_gib: float | None) -> str:
        """The one line of a phase that ran out of GPU memory (rlhf/allocator.py `oom_line`): what
        torch held, the plan's figure for the phase and the binding to change (`memory.relief`)."""
        from rlhf.memory.plan import relief
        planned = None
        if self.memory_plan is not None:
            planned = next((p.total / GIB for p in self.memory_plan.phases if p.name == phase), None)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory / GIB
        else:  # on Ray: the smallest of the ranks' devices, as each reported when placed
            totals = [w["device_total_gb"] for ranks in (self.placement.get("roles") or {}).values()
                      for w in ranks if "device_total_gb" in w]
            total = min(totals, default=float("nan"))
        if allocated_gib is None or reserved_gib is None:  # on Ray the ranks measured the phase (PhaseMemory)
            report = self.roles.device_report()
            allocated_gib = report.get(f"{PHASE_KEYS[0]}{phase}", float("nan"))
            reserved_gib = report.get(f"{PHASE_KEYS[1]}{phase}", float("nan"))
        fix = relief(self.cfg, phase, self.longest_prompt)
        return oom_line(phase, allocated_gib, reserved_gib, total, planned, fix)

    def _truncated_fraction(self, prompts: List[Example]) -> float | None:
        """The share of `prompts` that the rollout cut to ppo.max_prompt_length (None under 'error')."""
        if self.ppo.prompt_truncation == "error":
            return None
        return sum(prompt_key(ex.prompt) in self._cut_prompts for ex in prompts) / len(prompts)

    @staticmethod
    def _check_finite(record: Dict) -> None:
        bad = [k for k in ("actor/pg_loss", "critic/value_loss", "kl_divergence", "actor/grad_norm",
                           "critic/grad_norm", "reward_mean")
               if k in record and not math.isfinite(record[k])]
        if bad:
            raise TrainingDiverged(f"training diverged: non-finite {', '.join(bad)} "
                                   f"({', '.join(f'{k}={record[k]}' for k in bad)})")

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Held-out accuracy: pass@1 sampled at ppo.eval_temperature (and greedy)."""
        ppo = self.ppo
        out = {}
        modes = [("", ppo.eval_temperature, ppo.eval_samples_per_prompt)]
        if ppo.eval_temperature > 0:
            modes.append(("greedy_", 0.0, 1))
        for prefix, temperature, n in modes:
            sampling = SamplingParams.from_ppo(ppo, temperature)
            calls = math.ceil(len(self.eval_examples) * n / 64)
            batch = self.generate(self.eval_examples, sampling, (ppo.seed, SeedStream.EVAL, self.step), n, calls)
            scored = self.reward.score(batch, update=False)  # evaluation never moves the reward's running statistics
            out[f"eval/{prefix}accuracy"] = float(scored["correct"].float().mean())
            if "rm_scores" in scored:
                out[f"eval/{prefix}rm_score"] = float(scored["rm_scores"].mean())
            out[f"eval/{prefix}reward_mean"] = float(scored["scores"].mean())
            if not prefix:
                out["eval/response_length_mean"] = float(batch["response_mask"].float().sum(-1).mean())
                out["eval/rollout_success_rate"] = float((batch["finished"] & scored["well_formed"]).float().mean())
        return out

    # ----------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        return checkpoint.save_checkpoint(
            self.out / "checkpoints", self.step, actor=self.actor, critic=self.critic, tokenizer=self.tokenizer,
            trainer_state={"sampler": self.sampler.state_dict(), "kl_controller": self.kl_ctl.state_dict(),
                           "reward": self.reward.state_dict()},
            keep=self.ppo.keep_checkpoints)

    def restore(self, ckpt: Path) -> None:
        state = checkpoint.restore_training(ckpt, actor=self.actor, critic=self.critic)
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.reward.load_state_dict(state.get("reward", {}))
        self.step = checkpoint.load_state(ckpt)["step"]
        self.actor.sync_weights()

    def profiled_train_step(self, out_dir: Path) -> tuple[Dict, dict]:
        """`train_step` under torch.profiler, each phase a named range: (the step's record with
        `perf/profiled` = 1, the trace's summary by phase). The trace and the summary are written under
        `out_dir` (rlhf/profiling.py `profiled_iteration`)."""
        PhaseTimer.annotate = True
        try:
            with profiled_iteration(out_dir, self.step, log=self.log) as profiled:
                profiled["record"] = self.train_step()
        finally:
            PhaseTimer.annotate = False
        # The profiler's own cost is in this step's timings: tools that take medians leave it out.
        return {**profiled["record"], "perf/profiled": 1.0}, profiled["summary"]

    # ----------------------------------------------------------------- run
    def run(self, logger: MetricLogger, resume_from: Path | None = None, profile_step: int = 0) -> Dict:
        """The run to `ppo.total_steps`, from `resume_from` if given; `profile_step` > 0 profiles that
        iteration (`profiled_train_step`, into `<out>/profile/`)."""
        ppo = self.ppo
        started = time.time()
        if resume_from is not None:
            self.restore(resume_from)
            self.log(f"resumed from {resume_from} at step {self.step}")
            initial = {k: v for k, v in read_metrics(self.out / "metrics.jsonl")[0].items() if k.startswith("eval/")}
        else:
            initial = self.evaluate()
            logger.log({"step": 0, **initial})
        final = None
        # The heap the first iteration leaves (models, compiled graphs, the engine) lives as long as the run.
        with heap.FrozenAfterFirst(self.roles.freeze_heap) as long_lived:
            self.roles.device_report()  # the first step's window starts here, not at start-up
            while self.step < ppo.total_steps:
                self.step += 1
                if self.step == profile_step:
                    record = {"step": self.step, **self.profiled_train_step(self.out / PROFILE_DIR)[0]}
                else:
                    record = {"step": self.step, **self.train_step()}
                if self.step % ppo.eval_every == 0 or self.step == ppo.total_steps:
                    t = time.perf_counter()
                    final = self.evaluate()
                    record.update(final)
                    record["timing_s/eval"] = time.perf_counter() - t
                logger.log(record)
                if self.step % ppo.save_every == 0 or self.step == ppo.total_steps:
                    self.save()
                long_lived.settle()
                self.roles.device_report()  # the next step's window starts here (not in eval or save)
        history = [r for r in read_metrics(self.out / "metrics.jsonl") if r["step"] > 0]
        if final is None:  # resumed after the last step had been written
            final = {k: v for k, v in history[-1].items() if k.startswith("eval/")}
        means = window_means(history, ppo.final_window)
        summary = {
            "status": "completed", "steps": self.step, "seed": ppo.seed,
            "initial": initial, "final": final,
            "final_window": {k: v for k, v in means.items() if not is_machine_metric(k)},
            "final_window_steps": ppo.final_window,
        }
        # What the machine measured over the same window, beside the results (rlhf/metrics.py).
        write_json(self.out / PERF_SUMMARY, {"wall_time_s": time.time() - started,
                                             "final_window": {k: v for k, v in means.items() if is_machine_metric(k)}})
        if self.prompt_truncated:  # ppo.prompt_truncation allows cutting: the share of each split's prompts cut
            summary["prompt_truncated_fraction"] = self.prompt_truncated
        # Written last and atomically: a summary means the final checkpoint is complete.
        write_json(self.out / "summary.json", summary)
        return summary

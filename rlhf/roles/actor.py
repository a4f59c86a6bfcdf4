"""The actor: the policy being trained, and the engine that samples its rollouts.

It recomputes old log-probs, runs the clipped PPO update over `ppo_epochs` x mini-batches (each
accumulated over micro-batches), generates with the run's rollout backend and keeps that
backend's weights in step with the trained ones (`sync_weights`).

With LoRA (`ppo.lora_rank > 0`) the policy is a peft model over a frozen base; the reference
log-probs are the same model's with its adapter switched off (`compute_reference_logprobs`), and
a rollout engine that holds its own weights (vLLM, the HF replica) receives the base with the
adapters merged in.

Generation with the HF backend on a sharded policy runs on a full replica, not on the shards:
HF generate stops early when every sequence has ended, so ranks would run different numbers of
forward passes and the sharded model's all-gathers would wait on each other forever. The replica
is refreshed from the shards after every update, as a vLLM engine is. Unsharded (one process,
or one rank), the HF backend generates with the trained module itself.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from rlhf import algos, checkpoint
from rlhf.batch import Batch, to_device
from rlhf.config import PPOConfig
from rlhf.errors import ConfigError
from rlhf.models import (
    ADAPTER_CONFIG,
    adapter_files,
    add_lora,
    frozen_base_dtype,
    load_policy,
    load_tokenizer,
    lora_scaling,
    merged_weights,
)
from rlhf.packing import micro_batches
from rlhf.roles.dispatch import ALL, CALLS, ROWS, dispatch
from rlhf.roles.forward import on_device, response_logprobs
from rlhf.roles.minibatches import mini_batches, minibatch_indices
from rlhf.roles.optimizer import clip_grad, mean_grad_norm
from rlhf.roles.role import TrainedRole
from rlhf.roles.stats import StatAccumulator, global_stats
from rlhf.rollout import SamplingParams, backend_class

RATIO_BIN_EDGES = [round(0.05 * i, 2) for i in range(41)]  # 0.0 .. 2.0; ratios above 2 land in the last bin


def build_policy(ppo: PPOConfig, start_dir: str, model_dir: str, device: torch.device) -> torch.nn.Module:
    """The policy to train: the start checkpoint as it is (full fine-tuning), or with `ppo.lora_rank`
    the base `model_dir` in `frozen_base_dtype` wrapped with fresh adapters, or with the adapters of a
    LoRA start checkpoint (`ppo.init_from`). A LoRA start under full fine-tuning is merged into its base."""
    start_is_adapter = (Path(start_dir) / ADAPTER_CONFIG).is_file()
    if not ppo.lora_rank:
        if start_is_adapter:
            from peft import PeftModel
            return PeftModel.from_pretrained(load_policy(model_dir), start_dir).merge_and_unload().requires_grad_(True)
        return load_policy(start_dir)
    model = add_lora(load_policy(model_dir, frozen_base_dtype(device), device), ppo.lora_rank, ppo.lora_alpha,
                     ppo.lora_dropout, ppo.lora_target_modules, task_type="CAUSAL_LM", base_path=model_dir)
    if start_is_adapter:
        result = model.load_state_dict(checkpoint.read_trained_state(Path(start_dir).parent, "actor"), strict=False)
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        missing = [k for k in result.missing_keys if k in trained]
        if missing or result.unexpected_keys:
            raise ConfigError(f"ppo.init_from: the adapter in {start_dir} does not fit this model (missing "
                              f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}); check ppo.lora_target_modules")
    elif not Path(start_dir).samefile(model_dir):
        raise ConfigError(f"ppo.init_from = {str(Path(start_dir).parent)!r} holds a fully fine-tuned policy; "
                          f"LoRA (ppo.lora_rank = {ppo.lora_rank}) trains adapters on the base model: set "
                          f"ppo.lora_rank = 0, or start from a LoRA checkpoint")
    return model


class Actor(TrainedRole):
    name = "actor"
    learning_rate = "actor_learning_rate"

    def __init__(self, ctx, ppo: PPOConfig, start_dir: str, tokenizer_dir: str, total_updates: int, log=print,
                 model: torch.nn.Module | None = None, tokenizer=None, model_dir: str | None = None):
        """`model` / `tokenizer`: already built (in one process); by default loaded from the directories.
        `model_dir`: the base model (default `start_dir`), which LoRA adapts and the reference is."""
        torch.manual_seed(ppo.seed)
        # Checkpoints save Python's and numpy's global generators too: seeded, they are the same bits every run.
        random.seed(ppo.seed)
        np.random.seed(ppo.seed % 2**32)
        model_dir = model_dir or start_dir
        super().__init__(ctx, model if model is not None else build_policy(ppo, start_dir, model_dir, ctx.device),
                         ppo, total_updates)
        backend = backend_class(ppo.rollout_backend)
        # An engine with weights of its own starts from an HF checkpoint: the start itself, or for an
        # adapter start the base, brought up to the policy by a sync right away.
        engine_dir = model_dir if (Path(start_dir) / ADAPTER_CONFIG).is_file() else start_dir
        self.replica = None
        if backend.shares_module and ctx.sharded:
            self.replica = load_policy(engine_dir).to(self.device).eval().requires_grad_(False)
        self.replica_fresh = engine_dir == start_dir
        self.rollout = backend.from_config(ppo, model=self.replica if self.replica is not None else self.model,
                                           tokenizer=tokenizer or load_tokenizer(tokenizer_dir), device=self.device,
                                           model_dir=str(engine_dir), log=log)
        if not self.replica_fresh:
            self.sync_weights()

    def device_state(self) -> tuple[list, list]:
        modules, optimizers = super().device_state()
        return modules + ([self.replica] if self.replica is not None else []), optimizers

    def _logprobs(self, batch: Batch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.model.eval()
        max_tokens = self.cfg.forward_max_tokens
        logps, ents = [], []
        for micro in micro_batches(on_device(batch, self.device, max_tokens), self.cfg.forward_batch_size, max_tokens,
                                   self.ranks):
            logprobs, entropy = response_logprobs(self.model, micro, self.device, self.cfg.temperature,
                                                  self.autocast_dtype, with_entropy=with_entropy, fused=self.fused)
            logps.append(logprobs)
            ents.append(entropy)
        # One transfer to the host for the whole phase, after the last micro-batch.
        return torch.cat(logps).cpu(), (torch.cat(ents).cpu() if with_entropy else None)

    @dispatch(ROWS)
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the sampled response tokens and per-token entropy, [B, R] each."""
        logprobs, entropy = self._logprobs(batch, with_entropy=True)
        assert entropy is not None  # asked for
        return logprobs, entropy

    @dispatch(ROWS)
    @torch.no_grad()
    def compute_reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """LoRA: the reference policy's log-probs [B, R], the base's (the adapter switched off):
        one set of weights serves both."""
        with self.model.disable_adapter():
            return self._logprobs(batch, with_entropy=False)[0]

    @dispatch(ALL)
    def update(self, batch: Batch, shuffle_seed: int, kl_coef: float) -> Dict[str, object]:
        """The clipped PPO update on the rollout buffer: `ppo_epochs` x mini-batches x micro-batches
        (rlhf/roles/minibatches.py). Each micro-batch's loss is the policy loss (`ppo.clip_range`,
        `ppo.dual_clip`) minus `ppo.entropy_coef` x its entropy, plus, when the KL is a loss term
        (`ppo.kl_mode = 'loss'`), `kl_coef` x its KL to the reference (`ppo.kl_estimator`); after each
        mini-batch the gradients are clipped (`ppo.max_grad_norm`) and the optimizer and LR schedule
        step. `kl_coef`: the trainer's KL coefficient this step (`ppo.kl_coef`, adapted when
        `ppo.adaptive_kl`).

        `batch` carries old_logprobs, advantages, response_mask and, when the KL is a loss term,
        ref_logprobs. Without old_logprobs the update is on-policy (`ppo.on_policy_update`): each
        micro-batch's own log-probs are the old ones, and the result adds them and the entropy,
        [B, R] in the buffer's row order (`old_logprobs`, `entropy_old`), for the record."""
        cfg, ranks = self.cfg, self.ranks
        on_policy = "old_logprobs" not in batch
        if on_policy and not cfg.on_policy_update:
            raise ValueError("an update without old_logprobs must be on-policy (ppo.on_policy_update)")
        self.replica_fresh = False
        self.model.train()
        stats = StatAccumulator()
        grad_norms = []
        bins = len(RATIO_BIN_EDGES) - 1
        ratio_counts = torch.zeros(bins, dtype=torch.float32, device=self.device)  # read once, after the loop
        seen: List[tuple] = []  # on-policy: (log-probs, entropy) of each micro-batch, in the order they ran
        for mini in mini_batches(batch, cfg, shuffle_seed, self.device, ranks):
            normalizer = mini.loss_normalizer
            self.optimizer.zero_grad(set_to_none=True)
            for micro in mini.micro_batches:
                mask = to_device(micro.tensors["response_mask"], self.device).float()
                advantages = to_device(micro.tensors["advantages"], self.device)
                logprobs, entropy = response_logprobs(self.model, micro, self.device, cfg.temperature,
                                                      self.autocast_dtype, fused=self.fused)
                assert entropy is not None  # with_entropy is on
                old_logprobs = logprobs.detach() if on_policy else to_device(micro.tensors["old_logprobs"], self.device)
                if on_policy:
                    seen.append((old_logprobs, entropy.detach()))
                pg_loss, pg_stats = algos.policy_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_range,
                                                      cfg.dual_clip, cfg.loss_aggregation, normalizer)
                entropy_term = algos.aggregate(entropy, mask, cfg.loss_aggregation, normalizer)
                loss = pg_loss - cfg.entropy_coef * entropy_term
                if cfg.kl_mode == "loss":
                    ref_logprobs = to_device(micro.tensors["ref_logprobs"], self.device)
                    kl = algos.kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
                    loss = loss + kl_coef * algos.aggregate(kl, mask, cfg.loss_aggregation, normalizer)
                    pg_stats["kl_loss"] = algos.masked_mean(kl.detach(), mask)
                self.backward(loss)
                with torch.no_grad():
                    ratio = torch.exp(logprobs.detach() - old_logprobs)
                    pg_stats["entropy"] = algos.masked_mean(entropy.detach(), mask)
                    pg_stats["pg_loss"] = algos.masked_mean(-advantages * ratio, mask)
                    # Padding goes to -1, which histc leaves out: no boolean selection (a host wait).
                    ratio_counts.add_(torch.histc(torch.where(mask.bool(), ratio.clamp(0, 2), -1.0).float(),
                                                  bins=bins, min=0, max=2))
                stats.add(pg_stats, mask.sum())
            grad_norms.append(clip_grad(self.model.parameters(), cfg.max_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
        grad_norm = mean_grad_norm(grad_norms)
        ratio_counts = ranks.sum(ratio_counts.cpu().long())
        out: Dict[str, object] = {f"actor/{k}": v for k, v in global_stats(stats, ranks).items()}
        out["actor/grad_norm"] = grad_norm
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        out["policy_ratio_hist"] = {"bin_edges": RATIO_BIN_EDGES, "counts": ratio_counts.tolist()}
        if on_policy:  # one mini-batch: its rows are the buffer's in `minibatch_indices`' order
            order = minibatch_indices(len(batch), cfg.mini_batch_size, shuffle_seed)[0]
            for key, column in (("old_logprobs", 0), ("entropy_old", 1)):
                values = torch.cat([part[column] for part in seen]).cpu()
                out[key] = torch.empty_like(values).index_copy_(0, order, values)
        return out

    # ------------------------------------------------------------ rollouts
    @dispatch(CALLS)
    def generate(self, requests: Sequence[Tuple[List[str], int]], sampling: SamplingParams) -> List[Batch]:
        """One generation call per (prompts, seed): the seed is the call's, not the rank's, so which
        rank runs a call does not change what it samples. vLLM takes a rank's calls as one continuous
        batch (rlhf/rollout/vllm.py)."""
        return self.rollout.generate_calls(requests, sampling)

    @dispatch(ALL)
    def release_memory(self) -> None:
        """Lets the backend free what it holds until the next sync (vLLM: sleep mode)."""
        self.rollout.release_memory()

    @dispatch(ALL)
    def rollout_asleep_bytes(self) -> int:
        """What torch counts of the sleeping rollout engine but the device does not hold (`asleep_bytes`;
        the first rank's, as the ranks of one GPU each are alike)."""
        return self.rollout.asleep_bytes()

    @dispatch(ALL)
    def set_rollout_sleep(self, enabled: bool) -> None:
        """Whether the backend frees its memory between rollouts (the placement's memory plan)."""
        self.rollout.set_sleep(enabled)

    @dispatch(ALL)
    def sync_weights(self) -> None:
        """Brings the rollout backend up to the trained weights (gathering them, a collective, when
        sharded); LoRA adapters are merged into the base on the way (`models.merged_weights`)."""
        if self.rollout.shares_module and self.replica is None:
            return
        if self.replica is not None and self.replica_fresh:
            self.rollout.sync_weights(self.replica)
            return
        state = self.ctx.full_model_state(self.model, rank0_cpu=False) if self.ctx.sharded else self.model.state_dict()
        weights = merged_weights(state, lora_scaling(self.model)) if self.lora else state
        if self.replica is not None:
            self.replica.load_state_dict(dict(weights))
            self.rollout.sync_weights(self.replica)
        else:
            self.rollout.sync_weights(weights)
        self.replica_fresh = True

    # ------------------------------------------------------------ checkpoints (every rank calls these)
    @dispatch(ALL)
    def model_files(self) -> Dict[str, bytes]:
        """The policy's checkpoint files, from rank 0 ({} elsewhere), keyed by their path in the
        checkpoint: `actor/` as an HF checkpoint (`save_pretrained`'s files), or for LoRA as peft's
        adapter (`PeftModel.from_pretrained(base, 'actor')` loads it). Bytes, so the controller
        writes them wherever this rank runs."""
        if self.lora:
            state = self.ctx.full_model_state(self.model, rank0_cpu=True, only=self.trained_names)
            return {f"actor/{k}": v for k, v in adapter_files(self.model, state).items()} if self.ctx.is_rank0 else {}
        state = self.ctx.full_model_state(self.model, rank0_cpu=True) if self.ctx.sharded else None
        if not self.ctx.is_rank0:
            return {}
        template = self.replica if self.replica is not None else self.model
        with tempfile.TemporaryDirectory() as tmp:
            template.save_pretrained(tmp, state_dict=state, safe_serialization=True)  # pyright: ignore[reportCallIssue]
            return {f"actor/{p.name}": p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}

    @dispatch(ALL)
    def load_model_state(self, state: Dict[str, torch.Tensor], strict: bool = True) -> tuple[list, list]:
        self.replica_fresh = False
        return super().load_model_state(state, strict)

"""The critic: a value model trained on GAE returns with a clipped value loss."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, cast

import torch

from rlhf import algos, checkpoint
from rlhf.batch import Batch, to_device
from rlhf.config import PPOConfig
from rlhf.errors import ConfigError
from rlhf.models import ADAPTER_CONFIG, ValueModel, adapter_files, frozen_base_dtype, is_lora
from rlhf.packing import micro_batches
from rlhf.roles.dispatch import ALL, ROWS, dispatch
from rlhf.roles.forward import on_device, response_values
from rlhf.roles.minibatches import mini_batches
from rlhf.roles.optimizer import clip_grad, mean_grad_norm
from rlhf.roles.role import TrainedRole
from rlhf.roles.stats import StatAccumulator, global_stats
from rlhf.rollout import derive_seed


def load_critic_start(model: ValueModel, init_from: str) -> ValueModel:
    """`model` with the critic weights of checkpoint `init_from`: the same kind of critic loads them
    as they are (a LoRA critic: the same rank and lora_alpha, checked with the config); a LoRA critic
    under full fine-tuning is merged into its base (peft's merge)."""
    lora = is_lora(model)
    adapter_dir = Path(init_from) / "critic"
    if not lora and (adapter_dir / ADAPTER_CONFIG).is_file():
        from peft import PeftModel
        from safetensors.torch import load_file
        model.backbone = PeftModel.from_pretrained(model.backbone, str(adapter_dir)).merge_and_unload()
        model.value_head.load_state_dict({k[len("value_head."):]: v for k, v in
                                          load_file(str(adapter_dir / "value_head.safetensors")).items()})
        return model.requires_grad_(True)
    result = model.load_state_dict(checkpoint.read_trained_state(init_from, "critic"), strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = [k for k in result.missing_keys if k in trained or not lora]
    if missing or result.unexpected_keys:
        raise ConfigError(f"ppo.init_from = {init_from!r}: its critic does not fit this one (missing {missing[:3]}, "
                          f"unexpected {result.unexpected_keys[:3]}); a LoRA critic starts from a LoRA checkpoint "
                          f"of the same ppo.critic_lora_rank and ppo.lora_target_modules")
    return model


class Critic(TrainedRole):
    name = "critic"
    learning_rate = "critic_learning_rate"

    def __init__(self, ctx, ppo: PPOConfig, model_dir: str, random_init: bool, total_updates: int,
                 model: torch.nn.Module | None = None):
        """The policy's backbone with a value head; the same seed gives the same head on every
        placement. With `ppo.critic_lora_rank` (default the actor's rank) the backbone is a frozen
        base with adapters. `ppo.init_from` with a critic restores its weights. `model`: already built."""
        if model is None:
            rank = ppo.resolved_critic_lora_rank
            lora = dict(rank=rank, alpha=ppo.lora_alpha, dropout=ppo.lora_dropout,
                        target_modules=ppo.lora_target_modules) if rank else None
            model = ValueModel.from_policy_checkpoint(model_dir, seed=derive_seed(ppo.seed, 1), random_init=random_init,
                                                      dtype=frozen_base_dtype(ctx.device) if lora else torch.float32,
                                                      lora=lora, device=ctx.device if lora else None)
            if ppo.init_from and checkpoint.has_critic(ppo.init_from):
                model = load_critic_start(model, ppo.init_from)
        super().__init__(ctx, model, ppo, total_updates)
        self._stream = None  # the CUDA stream the update runs on (see `update`)

    @dispatch(ROWS)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """V(prompt + response[:t]) for every response position t, [B, R]."""
        self.model.eval()
        max_tokens = self.cfg.forward_max_tokens
        return torch.cat([response_values(self.model, m, self.device, self.autocast_dtype) for m in micro_batches(
            on_device(batch, self.device, max_tokens), self.cfg.forward_batch_size, max_tokens, self.ranks)]).cpu()

    @dispatch(ALL)
    def update(self, batch: Batch, shuffle_seed: int) -> Dict[str, float]:
        """Value regression on the rollout buffer (`_update`). On a GPU it runs on a CUDA stream of its
        own, so that in one process it overlaps the next rollout (`ppo.overlap_rollout`), whose
        engine works and waits on the default stream. Each stream waits for the other's earlier work
        (weights moved back from an offload, the new weights read by the next value pass)."""
        if self.device.type != "cuda":
            return self._update(batch, shuffle_seed)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            out = self._update(batch, shuffle_seed)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return out

    def _update(self, batch: Batch, shuffle_seed: int) -> Dict[str, float]:
        """`ppo_epochs` x mini-batches x micro-batches (rlhf/roles/minibatches.py): each micro-batch's
        clipped value loss (`ppo.value_clip_range`) is back-propagated, and after each mini-batch the
        gradients are clipped (`ppo.max_grad_norm`) and the optimizer and LR schedule step."""
        cfg = self.cfg
        self.model.train()
        stats = StatAccumulator()
        grad_norms = []
        for mini in mini_batches(batch, cfg, shuffle_seed, self.device, self.ranks):
            self.optimizer.zero_grad(set_to_none=True)
            for micro in mini.micro_batches:
                mask = to_device(micro.tensors["response_mask"], self.device).float()
                returns = to_device(micro.tensors["returns"], self.device)
                values = response_values(self.model, micro, self.device, self.autocast_dtype)
                loss, vstats = algos.value_loss(values, to_device(micro.tensors["values"], self.device), returns, mask,
                                                cfg.value_clip_range, cfg.loss_aggregation, mini.loss_normalizer)
                self.backward(loss)
                vstats["value_loss"] = algos.masked_mean(0.5 * (values.detach() - returns).square(), mask)
                stats.add(vstats, mask.sum())
            grad_norms.append(clip_grad(self.model.parameters(), cfg.max_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
        out = {f"critic/{k}": v for k, v in global_stats(stats, self.ranks).items()}
        out["critic/grad_norm"] = mean_grad_norm(grad_norms)
        out["critic/lr"] = cast(float, self.scheduler.get_last_lr()[0])
        return out

    @dispatch(ALL)
    def model_files(self) -> Dict[str, bytes]:
        """The critic's checkpoint files, keyed by their path in the checkpoint, from rank 0 ({}
        elsewhere): `critic.safetensors`, or for LoRA `critic/` with the backbone's adapter in peft's
        format (`PeftModel.from_pretrained(AutoModel.from_pretrained(base), 'critic')`) and
        `critic/value_head.safetensors`."""
        from safetensors.torch import save
        state = self.model_state()
        if not self.ctx.is_rank0:
            return {}
        if not self.lora:
            return {"critic.safetensors": save({k: v.contiguous() for k, v in state.items()})}
        head = {k: v.contiguous() for k, v in state.items() if k.startswith("value_head.")}
        adapter = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
        files = {f"critic/{k}": v for k, v in adapter_files(self.model.backbone, adapter).items()}
        files["critic/value_head.safetensors"] = save(head)
        return files

"""The roles' base classes: `Role` (where a role runs) and `TrainedRole` (the actor's and the
critic's model, optimizer, LR schedule and checkpoint state)."""

from __future__ import annotations

from typing import Dict

import torch

from rlhf.attention import use_packed_attention
from rlhf.config import PPOConfig
from rlhf.determinism import deterministic_backward
from rlhf.models import enable_gradient_checkpointing, is_lora
from rlhf.roles.compiled import compile_layers, fuse_lora
from rlhf.roles.dispatch import ALL, dispatch
from rlhf.roles.optimizer import build_optimizer, build_scheduler


class Role:
    """One role of the PPO loop, written once for every placement. `ctx` (rlhf/placement/context.py)
    says where it runs: its device, its ranks, bf16 autocast, and how models are placed (moved,
    or sharded with FSDP2) and their full states gathered. Methods a placement may call carry a
    `@dispatch` declaration (rlhf/roles/dispatch.py)."""

    name: str = ""

    def __init__(self, ctx):
        self.ctx = ctx
        self.device = ctx.device
        self.autocast_dtype = ctx.autocast_dtype
        self.ranks = ctx.ranks

    def device_state(self) -> tuple[list, list]:
        """(modules, optimizers) that live on the device: what offloading moves between phases."""
        return [], []


class TrainedRole(Role):
    """What the actor and critic share: the model (placed by the context), AdamW with the LR
    schedule, on a GPU with `ppo.torch_compile` its decoder layers compiled, and the checkpoint
    state in the single-process layout whatever the placement. Each subclass's `update` holds its
    own loop over the buffer (rlhf/roles/minibatches.py). A subclass names the learning rate it
    trains with (`actor_learning_rate`, ...)."""

    learning_rate: str

    def __init__(self, ctx, model: torch.nn.Module, cfg: PPOConfig, total_optimizer_steps: int):
        super().__init__(ctx)
        self.cfg = cfg
        self.lora = is_lora(model)
        """A LoRA model: only its adapters (and a value head) train, and only they are checkpointed."""
        self.trained_names = [name for name, p in model.named_parameters() if p.requires_grad]
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.model = ctx.place(use_packed_attention(model))
        if self.lora and self.device.type == "cuda":
            fuse_lora(self.model)
        self.fused = cfg.torch_compile and self.device.type == "cuda"
        if self.fused:
            compile_layers(self.model)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad],
                                         getattr(cfg, self.learning_rate), cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, total_optimizer_steps)

    def device_state(self) -> tuple[list, list]:
        return [self.model], [self.optimizer]

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, on a GPU with `ppo.deterministic` under strict deterministic algorithms."""
        with deterministic_backward(self.cfg.deterministic and self.device.type == "cuda"):
            loss.backward()

    # ------------------------------------------------ checkpoint state (every rank calls these)
    @dispatch(ALL)
    def model_state(self) -> Dict[str, torch.Tensor]:
        """The full (unsharded) model state on CPU, keyed like the one-process model ({} off rank 0);
        of a LoRA model only the trained parameters (the frozen base is its start checkpoint)."""
        return self.ctx.full_model_state(self.model, rank0_cpu=True, only=self.trained_names if self.lora else None)

    @dispatch(ALL)
    def load_model_state(self, state: Dict[str, torch.Tensor], strict: bool = True) -> tuple[list, list]:
        """Loads a full state; returns (missing, unexpected) keys. A LoRA model loads its trained
        parameters: every one must be in `state`, and the frozen base's names count as present."""
        if not self.lora:
            return self.ctx.load_model_state(self.model, state, strict)
        missing, unexpected = self.ctx.load_model_state(self.model, state, strict=False)
        trained = set(self.trained_names)
        return [k for k in missing if k in trained], unexpected

    @dispatch(ALL)
    def optimizer_state(self) -> dict:
        """The optimizer state in the one-process layout (parameter indices in `model.parameters()` order)."""
        return self.ctx.optimizer_state(self.model, self.optimizer)

    @dispatch(ALL)
    def load_optimizer_state(self, state: dict) -> None:
        self.ctx.load_optimizer_state(self.model, self.optimizer, state)

    @dispatch(ALL)
    def scheduler_state(self) -> dict:
        return self.scheduler.state_dict()

    @dispatch(ALL)
    def load_scheduler_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)

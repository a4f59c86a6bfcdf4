"""The reference policy: the frozen starting policy that the KL penalty measures against: a model
of its own (`Reference`), or with LoRA the actor's base with its adapter off (`AdapterOffReference`)."""

from __future__ import annotations

import torch

from rlhf.attention import use_packed_attention
from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.models import load_policy
from rlhf.packing import micro_batches
from rlhf.roles import ActorRole
from rlhf.roles.compiled import compile_layers
from rlhf.roles.dispatch import ROWS, dispatch
from rlhf.roles.forward import on_device, response_logprobs
from rlhf.roles.role import Role


class Reference(Role):
    name = "reference"

    def __init__(self, ctx, ppo: PPOConfig, model_dir: str, model: torch.nn.Module | None = None):
        super().__init__(ctx)
        model = model if model is not None else load_policy(model_dir)
        self.model = ctx.place(use_packed_attention(model)).eval().requires_grad_(False)
        self.temperature = ppo.temperature
        self.micro_batch_size = ppo.forward_batch_size
        self.max_tokens = ppo.forward_max_tokens
        self.fused = ppo.torch_compile and self.device.type == "cuda"  # as the actor's forward
        if self.fused:
            compile_layers(self.model)

    def device_state(self) -> tuple[list, list]:
        return [self.model], []

    @dispatch(ROWS)
    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        out = []
        for micro in micro_batches(on_device(batch, self.device, self.max_tokens), self.micro_batch_size,
                                   self.max_tokens, self.ranks):
            logprobs, _ = response_logprobs(self.model, micro, self.device, self.temperature, self.autocast_dtype,
                                            with_entropy=False, fused=self.fused)
            out.append(logprobs)
        return torch.cat(out).cpu()  # one transfer to the host, after the last micro-batch


class AdapterOffReference:
    """The reference of a LoRA run: the actor's own base weights with the adapter switched off, so
    there is no second copy of the policy. Runs wherever the actor runs (its ranks on Ray)."""

    name = "reference"

    def __init__(self, actor: ActorRole):
        self.actor = actor

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.actor.compute_reference_logprobs(batch)

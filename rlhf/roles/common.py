"""What the model-holding roles share: the `Role` base, the sequence forward, optimizers,
schedules, and `TrainedRole` (the actor's and critic's model, optimizer, LR schedule,
optimisation loop and checkpoint state)."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Iterable, List

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import get_scheduler

from rlhf.attention import use_packed_attention
from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.models import adamw, enable_gradient_checkpointing, is_lora, position_ids_from_mask
from rlhf.packing import micro_batches, packed_row
from rlhf.roles.compiled import compile_layers, logprobs_and_entropy
from rlhf.roles.dispatch import ALL, dispatch


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


FORWARD_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""What a forward pass over prompt + response reads from a batch."""


def on_device(batch: Batch, device, max_tokens: int, keys=FORWARD_KEYS) -> Batch:
    """The fields `keys` of `batch` (None: every tensor) on `device`, moved once for a whole phase.
    Moving each micro-batch's inputs as it comes would stall the GPU: a copy from pageable host
    memory waits for every kernel queued before it, so the device would drain before each
    micro-batch and again while the host launches the next. Slices of these tensors are views,
    so micro-batches then cost no copy and no synchronisation. A token budget (`max_tokens`)
    packs micro-batches on the host (rlhf/packing.py) and keeps the batch there. On a CPU this
    changes no value: the tensors are the same ones."""
    if max_tokens:
        return batch
    return batch.to(device, keys=list(batch.tensors) if keys is None else keys)


def sequence_inputs(batch: Batch, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """prompt + response ids and mask on `device`, and the prompt width P."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1).to(device)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1).to(device)
    return ids, mask, batch["prompt_ids"].shape[1]


LM_HEAD_CHUNK = 2048
"""Positions whose logits exist at once: the LM head and its log-softmax run over this many positions
at a time (`response_logprobs`), so a micro-batch never holds its full [positions, V] logits. At a
152k vocabulary a chunk's fp32 logits are 1.2 GiB; the memory plan counts one chunk
(rlhf/memory/formulas.py `lm_head_bytes`)."""


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, tokens: torch.Tensor, temperature: float,
                    with_entropy: bool, fused: bool, keep: int) -> torch.Tensor:
    """[b, k, H] hidden states -> [b, k, 2]: log p(tokens) and the entropy (0 without it) of the LM
    head's logits / temperature at the first `keep` positions (0 after them): the head applied as
    `nn.Linear` applies it, then `compiled.logprobs_and_entropy`."""
    logits = F.linear(hidden, weight, bias)[:, :keep]
    logprobs, entropy = logprobs_and_entropy(logits, tokens[:, :keep], temperature, with_entropy, fused)
    out = torch.stack([logprobs, entropy if entropy is not None else torch.zeros_like(logprobs)], -1)
    return F.pad(out, (0, 0, 0, hidden.shape[1] - keep)) if keep < hidden.shape[1] else out


def chunked_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, tokens: torch.Tensor,
                          temperature: float, with_entropy: bool, fused: bool, keep: int | None = None,
                          chunk: int = LM_HEAD_CHUNK) -> torch.Tensor:
    """[B, K, H] hidden states and [B, K] tokens -> [B, K, 2] (log-prob, entropy; 0 past the first `keep`
    positions of each row), about LM_HEAD_CHUNK positions at a time: whole rows of a padded micro-batch
    (B > 1), or spans of a packed row. With gradients each chunk is checkpointed: its logits are
    recomputed in the backward instead of kept, so the backward, too, holds one chunk's. One chunk is
    exactly the unchunked maths."""
    B, K, _ = hidden.shape
    keep = K if keep is None else keep
    if B * K <= chunk:
        return _chunk_logprobs(hidden, weight, bias, tokens, temperature, with_entropy, fused, keep)
    if B == 1 and keep < K:
        raise ValueError("a single row is chunked along its positions: score all of them (keep = None)")
    dim, step = (0, max(1, chunk // K)) if B > 1 else (1, chunk)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    outs = []
    for h, t in zip(hidden.split(step, dim), tokens.split(step, dim)):
        k = keep if dim == 0 else h.shape[1]
        if grad:
            outs.append(checkpoint(_chunk_logprobs, h, weight, bias, t, temperature, with_entropy, fused, k,
                                   use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(h, weight, bias, t, temperature, with_entropy, fused, k))
    return torch.cat(outs, dim)


@contextlib.contextmanager
def head_returns_logprobs(model, tokens: torch.Tensor, temperature: float, with_entropy: bool, fused: bool,
                          keep: int | None = None):
    """While open, the model's LM head returns (log-prob, entropy) [B, K, 2] of `tokens` [B, K] instead of
    [B, K, V] logits (`chunked_head_logprobs`; `keep`: only each row's first `keep` positions are
    scored). The head is swapped inside the model's own forward, so whatever wraps the model (peft's
    adapters, FSDP2's gathering of the root's weights) runs as usual."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear LM head to compute log-probs with")

    def forward(hidden):
        return chunked_head_logprobs(hidden, head.weight, head.bias, tokens, temperature, with_entropy, fused, keep)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def response_logprobs(model, batch: Batch, device, temperature: float = 1.0, autocast_dtype=None,
                      with_entropy: bool = True, fused: bool = False):
    """Log-probs of the response tokens [B, R] and, if asked, the entropy [B, R] (else None), under the
    sampling temperature (the distribution the rollout sampled from). Only the positions that predict
    response tokens go through the LM head (`logits_to_keep`: the last R + 1 of a padded row, the
    response positions of a packed one), and only LM_HEAD_CHUNK of them at a time. `fused` (GPU,
    ppo.torch_compile) computes each chunk's log-softmax and entropy in compiled kernels. A micro-batch
    that runs packed (rlhf/packing.py) is one row of its real tokens, scattered back to [B, R]."""
    row = packed_row(batch, device)
    if row is not None:
        inputs, keep, tokens = row.forward_kwargs(), row.index, row.tokens
    else:
        ids, mask, P = sequence_inputs(batch, device)
        R = batch["response_ids"].shape[1]
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
        # The last R + 1 positions go through the head; position P - 1 + t predicts response token t, and
        # the last one predicts nothing (scored as 0 and dropped).
        keep, tokens = R + 1, F.pad(batch["response_ids"].to(device), (0, 1))
    with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None), \
            head_returns_logprobs(model, tokens, temperature, with_entropy, fused,
                                  None if row is not None else keep - 1):
        out = model(**inputs, use_cache=False, logits_to_keep=keep).logits
    if row is None:
        out = out[:, :-1]
    logprobs, entropy = out[..., 0], (out[..., 1] if with_entropy else None)
    if row is not None:  # back to the padded [B, R]
        logprobs, entropy = row.unpack(logprobs), entropy if entropy is None else row.unpack(entropy)
    return logprobs, entropy


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, cfg) -> torch.optim.Optimizer:
    return adamw(params, lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer, cfg, total_optimizer_steps: int):
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.lr_warmup_steps,
                         num_training_steps=max(total_optimizer_steps, 1))


class TrainedRole(Role):
    """What the actor and critic share: the model (placed by the context), AdamW with the LR
    schedule, on a GPU with `ppo.torch_compile` its decoder layers compiled, the optimisation
    loop, and the checkpoint state in the single-process layout whatever the placement.
    A subclass names the learning rate it trains with (`actor_learning_rate`, ...)."""

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
        self.fused = cfg.torch_compile and self.device.type == "cuda"
        if self.fused:
            compile_layers(self.model)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad],
                                         getattr(cfg, self.learning_rate), cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, total_optimizer_steps)

    def device_state(self) -> tuple[list, list]:
        return [self.model], [self.optimizer]

    def optimize(self, batch: Batch, shuffle_seed: int, micro_step: Callable[[Batch, float], None]) -> float:
        """`ppo_epochs` x shuffled mini-batches x micro-batches, one clipped optimizer step per
        mini-batch; `micro_step(micro, normalizer)` computes and back-propagates one micro-batch's
        loss. With several ranks each takes its share of every mini-batch and the normalizer is
        the global one divided by the world size: FSDP averages the ranks' gradients, so the
        average of the shares is the one-process gradient. Returns the mean pre-clip grad norm."""
        cfg = self.cfg
        self.model.train()
        grad_norms = []
        # Every tensor of the buffer on the device once; the mini-batches are selected there by a
        # device index, so the loop below never waits for the GPU (the statistics stay on the
        # device until the callers read them once, after the loop).
        resident = on_device(batch, self.device, cfg.max_tokens_per_micro_batch, keys=None)
        for epoch in range(cfg.ppo_epochs):
            indices = minibatch_indices(len(batch), cfg.mini_batch_size, shuffle_seed + epoch)
            placed = torch.cat(indices).to(resident["response_mask"].device).split([len(i) for i in indices])
            for mb_index, mb_placed in zip(indices, placed):
                mini = self.ranks.share(resident.select(mb_placed))
                # The normalizer from the host copy of the mask: a number the host needs now.
                host_mask = Batch({"response_mask": batch["response_mask"][mb_index]})
                normalizer = loss_normalizer(self.ranks.share(host_mask), cfg.loss_aggregation, self.ranks)
                self.optimizer.zero_grad(set_to_none=True)
                for micro in micro_batches(mini, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, self.ranks):
                    micro_step(micro, normalizer)
                grad_norms.append(clip_grad(self.model.parameters(), cfg.max_grad_norm))
                self.optimizer.step()
                self.scheduler.step()
        norms = [float(n) for n in grad_norms]  # one wait for the GPU, after the last step
        return sum(norms) / max(len(norms), 1)

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


def loss_normalizer(mini: Batch, aggregation: str, ranks) -> float:
    """The mini-batch's token count (token_mean) or non-empty sequence count (seq_mean), summed
    over ranks and divided by the world size (FSDP averages the ranks' gradients), so that the
    micro-batch losses of all ranks add up to the one-process mini-batch loss."""
    mask = mini["response_mask"].float()
    count = mask.sum() if aggregation == "token_mean" else (mask.sum(-1) > 0).sum()
    return ranks.sum(count).clamp(min=1).item() / ranks.world_size


def minibatch_indices(n: int, mini_batch_size: int, seed: int) -> List[torch.Tensor]:
    """A seeded shuffle of range(n) cut into mini-batches."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    return [perm[i:i + mini_batch_size] for i in range(0, n, mini_batch_size)]


class StatAccumulator:
    """Token-weighted means of per-micro-batch statistics. Values and weights may be tensors on
    the device: they are kept as they are and read in one transfer when the sums are first
    needed (reading each as it comes would make the host wait for the GPU every micro-batch).
    The sums are then formed on the host in float64, in the order the values were added."""

    def __init__(self):
        self._pending: List[tuple] = []
        self._sums: Dict[str, float] = {}
        self._weights: Dict[str, float] = {}

    def add(self, stats: Dict[str, object], weight) -> None:
        keep = (lambda v: v.detach() if isinstance(v, torch.Tensor) else v)  # never an autograd graph
        self._pending.append(({k: keep(v) for k, v in stats.items()}, keep(weight)))

    def _settle(self) -> None:
        if not self._pending:
            return
        tensors = [v for stats, w in self._pending for v in (*stats.values(), w) if isinstance(v, torch.Tensor)]
        by_device: Dict[torch.device, list] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        host = {}
        for group in by_device.values():  # one transfer per device
            values = torch.stack([t.reshape(()).double() for t in group]).tolist()
            host.update({id(t): v for t, v in zip(group, values)})
        read = (lambda v: host[id(v)] if isinstance(v, torch.Tensor) else float(v))
        for stats, weight in self._pending:
            weight = read(weight)
            for k, v in stats.items():
                self._sums[k] = self._sums.get(k, 0.0) + read(v) * weight
                self._weights[k] = self._weights.get(k, 0.0) + weight
        self._pending = []

    @property
    def sums(self) -> Dict[str, float]:
        self._settle()
        return self._sums

    @property
    def weights(self) -> Dict[str, float]:
        self._settle()
        return self._weights

    def means(self) -> Dict[str, float]:
        sums, weights = self.sums, self.weights
        return {k: sums[k] / weights[k] if weights[k] else math.nan for k in sums}


def global_stats(stats: StatAccumulator, ranks) -> Dict[str, float]:
    """Token-weighted means over every rank's micro-batches."""
    if ranks.world_size == 1:
        return stats.means()
    keys = sorted(stats.sums)
    packed = ranks.sum(torch.tensor([[stats.sums[k] for k in keys], [stats.weights[k] for k in keys]],
                                    dtype=torch.float64))
    return {k: float(packed[0, i] / packed[1, i]) if packed[1, i] else math.nan for i, k in enumerate(keys)}


def clip_grad(params, max_norm: float) -> torch.Tensor:
    """Clips to `max_norm` (0: no clipping) and returns the gradient norm before clipping, a 0-d
    tensor on the gradients' device (read it with float() when the value is needed: reading it
    makes the host wait for the GPU). With FSDP2 the gradients are DTensor shards and the norm is
    the global one over every rank."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    if max_norm > 0:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        total = torch.norm(torch.stack([p.grad.detach().norm() for p in params]))
    if isinstance(total, DTensor):  # sharded gradients: reduce the partial norms over the ranks
        total = total.full_tensor()
    return total.detach()

"""The actor on one rank: its FSDP2 shard of the policy (trained by the local `ActorWorker`) and
a full replica of the policy that generates rollouts.

Generation runs on the replica, not on the sharded model: HF generate stops early when every
sequence has ended, so ranks would run different numbers of forward passes and the sharded
model's all-gathers would wait on each other forever. The replica is refreshed from the shards
after every update (the `sync_weights` phase), as a vLLM engine would be.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from rlhf.batch import Batch
from rlhf.config import PPOConfig
from rlhf.distributed import fsdp
from rlhf.distributed.trainable import TrainableShard
from rlhf.models import load_policy, load_tokenizer
from rlhf.rollout import SamplingParams, build_rollout, rollout_options
from rlhf.workers.actor import ActorWorker


class ActorRole(TrainableShard):
    def __init__(self, ranks, device: torch.device, ppo: PPOConfig, start_dir: str, tokenizer_dir: str,
                 total_updates: int, autocast_dtype=None):
        self.ranks = ranks
        self.device = device
        torch.manual_seed(ppo.seed)
        model = fsdp.shard(load_policy(start_dir).to(device), device.type, ranks.world_size)
        self.worker = ActorWorker(model, ppo, device, total_updates, autocast_dtype, ranks=ranks)
        self.replica = load_policy(start_dir).to(device).eval().requires_grad_(False)
        self.replica_fresh = True
        self.rollout = build_rollout(ppo.rollout_backend, self.replica, load_tokenizer(tokenizer_dir), device,
                                     model_dir=start_dir, seed=ppo.seed,
                                     max_model_len=ppo.max_prompt_length + ppo.max_response_length,
                                     **rollout_options(ppo, device))

    # ------------------------------------------------------------ the local worker's methods
    def compute_logprobs(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.worker.compute_logprobs(batch)

    def update(self, batch: Batch, shuffle_seed: int, kl_coef: float) -> Dict:
        self.replica_fresh = False
        return self.worker.update(batch, shuffle_seed=shuffle_seed, kl_coef=kl_coef)

    # ------------------------------------------------------------ rollouts
    def generate(self, requests: Sequence[Tuple[List[str], int]], sampling: SamplingParams) -> List[Batch]:
        """One generation call per (prompts, seed): the seed is the call's, not the rank's, so which
        rank runs a call does not change what it samples."""
        return [self.rollout.generate(prompts, sampling, seed) for prompts, seed in requests]

    def release_memory(self) -> None:
        """Lets the backend free what it holds until the next sync (vLLM: sleep mode)."""
        getattr(self.rollout, "release_memory", lambda: None)()

    def sync_weights(self) -> None:
        """Gathers the full weights (a collective: every rank calls it) into the replica."""
        if not self.replica_fresh:
            self.replica.load_state_dict(fsdp.full_model_state(self.worker.model, rank0_cpu=False))
            self.replica_fresh = True
        self.rollout.sync_weights(self.replica)

    # ------------------------------------------------------------ checkpoints (every rank calls these)
    def model_files(self) -> Dict[str, bytes]:
        """The policy as an HF checkpoint (`save_pretrained`'s files), from rank 0; {} elsewhere.
        Returned as bytes so the controller writes them, wherever this rank runs."""
        self.sync_weights()
        if self.ranks.rank != 0:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            self.replica.save_pretrained(tmp, safe_serialization=True)
            return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}

    def load_model_state(self, state: Dict[str, torch.Tensor], strict: bool):
        self.replica_fresh = False
        return super().load_model_state(state, strict)

    # ------------------------------------------------------------ colocated offloading
    def offload(self) -> None:
        super().offload()
        self.replica.to("cpu")

    def onload(self) -> None:
        super().onload()
        self.replica.to(self.device)

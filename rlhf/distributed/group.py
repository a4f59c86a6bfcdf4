"""What the trainer calls: each group has the local worker's methods and answers them by splitting
the Batch over its ranks and gathering the results in order.

Forward-only phases (log-probs, values) send each rank a contiguous share of the rows. Updates send
every rank the whole rollout buffer (one object in Ray's store) so that each draws the same shuffled
mini-batches as one process would and takes its share of each (`ranks.ProcessGroupRanks.share`);
the ranks' results are identical after their all-reduces, and rank 0's is returned.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import ray
import torch

from rlhf.batch import Batch
from rlhf.distributed.checkpointing import ModelStandIn, OptimizerStandIn, SchedulerStandIn
from rlhf.distributed.ranks import even_shares
from rlhf.rollout import SamplingParams


class RoleGroup:
    def __init__(self, role: str, hosts: list):
        self.role = role
        self.hosts = hosts
        self.world_size = len(hosts)

    def on_all(self, method: str, *args, **kwargs) -> list:
        """Runs `method` on every rank (required for anything that gathers or updates)."""
        return ray.get([h.call.remote(self.role, method, *args, **kwargs) for h in self.hosts])

    def scatter(self, method: str, batch: Batch, *args) -> list:
        shares = even_shares(len(batch), self.world_size, f"{self.role}.{method}")
        return ray.get([h.call.remote(self.role, method, batch.select(rows), *args)
                        for h, rows in zip(self.hosts, shares)])


class TrainedGroup(RoleGroup):
    """A group whose model trains: checkpoints reach it through `model`, `optimizer`, `scheduler`."""

    def __init__(self, role: str, hosts: list):
        super().__init__(role, hosts)
        self.model = ModelStandIn(self)
        self.optimizer = OptimizerStandIn(self)
        self.scheduler = SchedulerStandIn(self)

    def update(self, batch: Batch, **kwargs) -> Dict:
        return self.on_all("update", ray.put(batch), **kwargs)[0]


class ActorGroup(TrainedGroup):
    def __init__(self, hosts: list):
        super().__init__("actor", hosts)

    def compute_logprobs(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        parts = self.scatter("compute_logprobs", batch)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class CriticGroup(TrainedGroup):
    def __init__(self, hosts: list):
        super().__init__("critic", hosts)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return torch.cat(self.scatter("compute_values", batch))


class ReferenceGroup(RoleGroup):
    def __init__(self, hosts: list):
        super().__init__("reference", hosts)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return torch.cat(self.scatter("compute_logprobs", batch))


class RolloutGroup(RoleGroup):
    """Generation on the actor ranks' full replicas: call i runs on rank i mod world_size with
    call i's own seed, so the samples do not depend on the world size."""

    def __init__(self, hosts: list):
        super().__init__("actor", hosts)

    def generate_calls(self, requests: Sequence[Tuple[List[str], int]], sampling: SamplingParams) -> List[Batch]:
        per_rank = [list(range(r, len(requests), self.world_size)) for r in range(self.world_size)]
        refs = [h.call.remote("actor", "generate", [requests[i] for i in calls], sampling)
                for h, calls in zip(self.hosts, per_rank) if calls]
        out: List[Batch] = [None] * len(requests)
        for calls, results in zip([c for c in per_rank if c], ray.get(refs)):
            for i, result in zip(calls, results):
                out[i] = result
        return out

    def generate(self, prompts: List[str], sampling: SamplingParams, seed: int) -> Batch:
        return self.generate_calls([(prompts, seed)], sampling)[0]

    def release_memory(self) -> None:
        self.on_all("release_memory")

    def sync_weights(self, model=None) -> None:
        """Every actor rank gathers the new full weights into its replica (the argument, the
        actor's model in one process, is not needed: the ranks hold it)."""
        self.on_all("sync_weights")


class RewardClient:
    """The reward role, hosted beside actor rank 0; it needs only the decoded text."""

    def __init__(self, host):
        self.host = host

    def score(self, batch: Batch) -> dict:
        slim = Batch({"finished": batch["finished"]}, {"responses": batch["responses"], "answers": batch["answers"]})
        return ray.get(self.host.call.remote("reward", "score", slim))

"""Where a run's ranks go: one placement group per run, one bundle per rank (and per role in split
placement), and a host actor on each bundle.

The controller (the trainer's process) holds no Ray resources: a study runs each run as a Ray
task, and a driver that held CPUs while its ranks waited for more would deadlock a small machine.
Everything a run places lives in its one placement group, reserved all at once or not at all.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Dict, List, Optional

from rlhf import numerics
from rlhf.config import ConfigError, PPOConfig

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# Environment the ranks need wherever they run (a joined cluster does not inherit this process's).
FORWARDED_ENV = ("RLHF_CACHE", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_OFFLINE",
                 "WANDB_MODE", *numerics.FORWARDED_ENV)
PLACEMENT_TIMEOUT_S = 300
PROBE_TIMEOUT_S = 5.0
"""How long a cluster's address may take to accept a connection (ray.init would retry for minutes)."""


def check_address(address: Optional[str]) -> None:
    """A ConfigError naming the address (`address`, else RAY_ADDRESS) when nothing accepts a
    connection there within PROBE_TIMEOUT_S; nothing to check without one, or for 'auto' and
    'local' (Ray resolves those itself, at once)."""
    given = address or os.environ.get("RAY_ADDRESS") or None
    if not given or given in ("auto", "local"):
        return
    source = "--ray-address" if address else "RAY_ADDRESS"
    host, sep, port = given.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        return  # not HOST:PORT: Ray's own error says what it expects
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise ConfigError(f"{source} {given!r}: no Ray cluster answers there ({reason}, within "
                          f"{PROBE_TIMEOUT_S:g} s); start one (`ray start --head`), fix the address, or leave "
                          f"it out to start a local instance") from None


def connect(address: Optional[str], num_cpus: Optional[float] = None, num_gpus: Optional[float] = None,
            private: bool = False) -> bool:
    """Joins `address` (or RAY_ADDRESS), or else starts a local Ray instance (`private`: one of its
    own even when other Ray clusters run on this machine; `num_cpus` / `num_gpus`: its resources).
    No dashboard, no log forwarding. Returns True when it started a local instance, False when it
    joined one or Ray was already up: the one Ray start-up of the engine and the manager. An
    address where no cluster answers is a ConfigError within seconds (`check_address`)."""
    import ray
    if ray.is_initialized():
        return False
    check_address(address)
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
        return False
    ray.init(address="local" if private else None, num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)
    return True


def device_type(ppo: PPOConfig) -> str:
    """'cuda' or 'cpu' for the ranks; 'auto' asks the cluster, not this (resource-less) process."""
    import ray
    gpus = ray.cluster_resources().get("GPU", 0)
    if ppo.device == "cuda" and gpus < 1:
        raise ConfigError("ppo.device = 'cuda' is invalid: the Ray cluster has no GPUs; use 'cpu' or 'auto'")
    if ppo.device == "auto":
        return "cuda" if gpus >= 1 else "cpu"
    return ppo.device


def plan_bundles(ppo: PPOConfig, roles: List[str], device: str) -> Dict[str, List[int]]:
    """Bundle index of each rank of each role: shared in colocated placement, disjoint in split."""
    n = ppo.world_size
    if ppo.resolved_placement == "colocated":
        return {role: list(range(n)) for role in roles}
    return {role: [i * n + r for r in range(n)] for i, role in enumerate(roles)}


def reserve(ppo: PPOConfig, num_bundles: int, device: str):
    """The run's placement group, with a clear error (before any compute) if it cannot fit."""
    import ray
    from ray.util.placement_group import placement_group
    bundle = {"CPU": ppo.cpus_per_rank, **({"GPU": 1} if device == "cuda" else {})}
    total = ray.cluster_resources()
    need = {k: v * num_bundles for k, v in bundle.items()}
    short = [f"{need[k]:g} {k} (the cluster has {total.get(k, 0):g})" for k in need if need[k] > total.get(k, 0) + 1e-9]
    if short:
        raise ConfigError(
            f"ppo.world_size = {ppo.world_size} with ppo.placement = '{ppo.resolved_placement}' needs "
            f"{num_bundles} bundles of {bundle}: {', '.join(short)}; lower ppo.world_size or ppo.cpus_per_rank, "
            f"use placement 'colocated', or join a larger cluster (--ray-address)")
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"the run's placement group ({num_bundles} x {bundle}) was not granted within "
                           f"{PLACEMENT_TIMEOUT_S} s: other work holds the cluster's resources")
    return pg


def rank_env() -> dict:
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def start_hosts(pg, bundles: List[int], ppo: PPOConfig, device: str) -> list:
    """One host actor per bundle index in `bundles` (rank r on bundles[r]), joined into one world."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from rlhf.placement.host import RankHost
    remote = ray.remote(RankHost)
    threads = ppo.torch_threads or max(1, int(ppo.cpus_per_rank))
    # On a GPU a host takes two calls at once: the next rollout beside the critic's update
    # (ppo.overlap_rollout; colocated, both roles live in this one process). The controller starts
    # no other call while one runs, so calls still run in the order they are made.
    concurrency = 2 if device == "cuda" else 1
    hosts = []
    for rank, bundle in enumerate(bundles):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        hosts.append(remote.options(
            num_cpus=ppo.cpus_per_rank, num_gpus=1 if device == "cuda" else 0, scheduling_strategy=strategy,
            runtime_env={"env_vars": rank_env()}, max_concurrency=concurrency,
        ).remote(rank, ppo.world_size, device, threads, ppo.bf16_autocast))
    where = ray.get([h.where.remote() for h in hosts])
    master = where[0]
    ray.get([h.init_world.remote(master["ip"], master["port"]) for h in hosts])
    return hosts, where

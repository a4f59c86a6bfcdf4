"""Where a run's ranks go: one placement group per run, one bundle per rank (and per role in split
placement), and a host actor on each bundle.

The controller (the trainer's process) holds no Ray resources: a study runs each run as a Ray
task, and a driver that held CPUs while its ranks waited for more would deadlock a small machine.
Everything a run places lives in its one placement group, reserved all at once or not at all.

How this process comes to Ray (`connect`), the engine's and the manager's alike: a local instance,
or a cluster given by address (`ray start --head`), checked within seconds first (`check_address`:
a Ray GCS answers there, its token authentication is met, and this machine is one of its nodes).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from rlhf import numerics
from rlhf.config import PPOConfig
from rlhf.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# Environment the ranks need wherever they run (a joined cluster does not inherit this process's).
FORWARDED_ENV = ("RLHF_CACHE", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "TRANSFORMERS_OFFLINE",
                 "WANDB_MODE", "PYTORCH_CUDA_ALLOC_CONF", *numerics.FORWARDED_ENV)
PLACEMENT_TIMEOUT_S = 300
PROBE_TIMEOUT_S = 5.0
"""How long a cluster's address may take to accept a connection, and then to answer as a Ray cluster's
GCS (ray.init would retry for minutes, and wait without end on a port that is not Ray's)."""
NODE_CHECK_TIMEOUT_S = 60.0
"""How long each node of a joined cluster may take to say which paths it sees (`paths_missing_on_nodes`)."""
TOKEN_HELP = ("set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head node prints it), or copy "
              "the head node's ~/.ray/auth_token to this machine (RAY_AUTH_TOKEN_PATH names another file)")


def given_address(address: Optional[str]) -> Optional[Tuple[str, str, int]]:
    """(where, host, port) of the cluster address to join: `address` (`--ray-address`), else RAY_ADDRESS;
    None to start a local instance (neither given, an empty RAY_ADDRESS, or 'auto' / 'local', which Ray
    resolves itself). Checks the address's form, without the network: a ConfigError of one line naming
    the flag or variable for an empty `--ray-address`, a Ray Client address, or anything but HOST:PORT
    with a port in 1..65535 (Ray's own errors for these are tracebacks, or a local instance started)."""
    if address is not None and not address.strip():
        raise ConfigError("--ray-address '' is empty: give the cluster's HOST:PORT (the one `ray start --head` "
                          "prints), or leave the flag out to start a local instance")
    given = address or os.environ.get("RAY_ADDRESS", "").strip() or None
    if not given or given in ("auto", "local"):
        return None
    where = f"{'--ray-address' if address else 'RAY_ADDRESS'} {given!r}"
    if given.startswith("ray://"):
        raise ConfigError(f"{where} is a Ray Client address; give the cluster's GCS address HOST:PORT (the one "
                          f"`ray start --head` prints, port 6379 by default) and run this on a node of the cluster")
    rest = given.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")  # an IPv6 host, as [fd00::5]:6379
    host = host[1:-1] if bracketed else host
    if not sep or not host or (":" in host and not bracketed):
        raise ConfigError(f"{where} is not HOST:PORT: give the cluster's address as `ray start --head` prints it "
                          f"(e.g. 10.0.0.5:6379, [fd00::5]:6379 for IPv6), 'auto', or leave it out to start a "
                          f"local instance")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where}: the port {port!r} is not a port number (1..65535); Ray's head listens on "
                          f"6379 unless `ray start --head --port` said otherwise")
    return where, host, int(port)


def check_address(address: Optional[str]) -> None:
    """Checks, within seconds, that this process can join the Ray cluster at `address` (else RAY_ADDRESS);
    nothing to check without one, or for 'auto' and 'local' (Ray resolves those itself, at once).

    In turn: the address is HOST:PORT (`given_address`); something accepts a TCP connection there
    (PROBE_TIMEOUT_S); it answers a Ray GCS handshake
    (PROBE_TIMEOUT_S: an HTTP server or any other service fails here); when the cluster requires token
    authentication (`ray start --head` turns it on whenever a token exists) and RAY_AUTH_MODE is unset,
    this process turns token mode on (Ray does the same for address 'auto', never for an explicit one)
    and the token must be accepted; and this machine runs a node of that cluster (ray.init attaches a
    driver to a node on its own machine). Each failure is a ConfigError of one line saying what to set,
    start or fix."""
    parsed = given_address(address)
    if parsed is None:
        return
    where, host, port = parsed
    given = address or os.environ["RAY_ADDRESS"].strip()
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise ConfigError(f"{where}: no Ray cluster answers there ({reason}, within {PROBE_TIMEOUT_S:g} s); "
                          f"start one (`ray start --head`), fix the address, or leave it out to start a local "
                          f"instance") from None
    nodes = _gcs_handshake(where, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    _check_local_node(where, given, nodes)


def _gcs_nodes(gcs_address: str) -> list:
    """The cluster's nodes (GcsNodeInfo) as its GCS lists them, after the handshake Ray's own clients
    begin with (GetClusterId); grpc.RpcError when it does not answer within PROBE_TIMEOUT_S."""
    from ray._private.gcs_utils import create_gcs_channel  # token auth and TLS as Ray's own clients set them
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = create_gcs_channel(gcs_address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(),  # pyright: ignore[reportAttributeAccessIssue] (protobuf-generated)
                          timeout=PROBE_TIMEOUT_S)
        request = gcs_service_pb2.GetAllNodeInfoRequest()  # pyright: ignore[reportAttributeAccessIssue] (protobuf-generated)
        reply = stub.GetAllNodeInfo(request, timeout=PROBE_TIMEOUT_S)
        return list(reply.node_info_list)
    finally:
        channel.close()


def _gcs_handshake(where: str, gcs_address: str) -> list:
    """`_gcs_nodes`, turning token authentication on when the cluster asks for it and a token is here; a
    one-line ConfigError for a service that is not a Ray GCS, or a token that is missing or refused."""
    import grpc
    from ray._private.authentication import authentication_token_setup as token_setup
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray._raylet import AuthenticationTokenLoader  # pyright: ignore[reportAttributeAccessIssue] (compiled, no stub)
    from ray.exceptions import AuthenticationError

    try:
        try:
            return _gcs_nodes(gcs_address)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAUTHENTICATED or is_token_auth_enabled():
                raise
            mode = os.environ.get(token_setup.AUTH_MODE_ENV_VAR)
            if mode is not None:
                raise ConfigError(f"{where}: the Ray cluster there requires token authentication, but "
                                  f"{token_setup.AUTH_MODE_ENV_VAR}={mode} here; unset it (or set it to "
                                  f"'token')") from None
            if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
                raise ConfigError(f"{where}: the Ray cluster there requires token authentication and this machine "
                                  f"has no token; {TOKEN_HELP}") from None
            token_setup._enable_token_auth()  # what ray.init does for 'auto': this process and its children
            return _gcs_nodes(gcs_address)
    except AuthenticationError as err:  # a token file named but unreadable
        raise ConfigError(f"{where}: {err.message}; {TOKEN_HELP}") from None
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ConfigError(f"{where}: the Ray cluster there refused this machine's token (from {_token_source()}); "
                              f"{TOKEN_HELP}") from None
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            reason = f"no answer within {PROBE_TIMEOUT_S:g} s"
        else:  # gRPC's details end with what the other side did wrong, e.g. 'Failed parsing HTTP/2 (...)'
            reason = f"its answer: {(err.details() or err.code().name).rsplit(': ', 1)[-1].split(' (')[0]}"
        raise ConfigError(f"{where}: accepts connections but is not a Ray cluster's GCS ({reason}); give the "
                          f"address `ray start --head` printed (port 6379 by default, not the dashboard's 8265), or "
                          f"leave it out to start a local instance") from None


def _token_source() -> str:
    """Where Ray reads this process's token from (its order: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    return "~/.ray/auth_token"


def _check_local_node(where: str, given: str, nodes: list) -> None:
    """A ConfigError unless a live node of the cluster (`nodes`, from its GCS) runs on this machine: a
    Ray driver attaches to a node of its own machine (ray.init would look for one for a minute)."""
    from ray._private.services import find_node_ids  # the raylets running here, as ray.init finds them
    alive = [n for n in nodes if n.state == 0]  # GcsNodeInfo.ALIVE
    if not alive or {n.node_id.hex() for n in alive} & set(find_node_ids()):
        return
    ips = sorted({n.node_manager_address for n in alive})
    raise ConfigError(f"{where}: this machine runs no node of the Ray cluster there (its nodes: {', '.join(ips)}); "
                      f"run this on one of them, or join this machine first: `ray start --address {given}` (with "
                      f"RAY_AUTH_MODE=token when the cluster uses token authentication)")


def connect(address: Optional[str], num_cpus: Optional[float] = None, num_gpus: Optional[float] = None,
            private: bool = False) -> bool:
    """Joins `address` (or RAY_ADDRESS), or else starts a local Ray instance (`private`: one of its
    own even when other Ray clusters run on this machine; `num_cpus` / `num_gpus`: its resources).
    No dashboard of its own (a joined `ray start` cluster has one), no log forwarding. Returns True
    when it started a local instance, False when it joined one or Ray was already up: the one Ray
    start-up of the engine and the manager. An address where no Ray cluster this process can join
    answers is a ConfigError within seconds (`check_address`); an interrupt while connecting leaves
    nothing started."""
    import ray
    if ray.is_initialized():
        return False
    check_address(address)
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: Dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        if address:
            ray.init(address=address, **kwargs)
            return False
        # A local instance turns token authentication on by default: Ray's notice of it is not this run's news.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(address="local" if private else None, num_cpus=num_cpus,  # pyright: ignore[reportArgumentType]
                 num_gpus=num_gpus, **kwargs)  # pyright: ignore[reportArgumentType]  (Ray takes fractions)
        return True
    except KeyboardInterrupt:
        ray.shutdown()
        raise


def paths_missing_on_nodes(paths: List[str]) -> Dict[str, List[str]]:
    """{node: the paths of `paths` it does not see} for each live node of the cluster with CPUs or GPUs,
    other than this process's (the node's address and the start of its id); {} on a one-node cluster.
    Every node that runs work must see the same code, recipes, working directory and results at the
    same absolute paths. A node that does not answer within NODE_CHECK_TIMEOUT_S is not reported."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != here
             and (n["Resources"].get("CPU", 0) > 0 or n["Resources"].get("GPU", 0) > 0)]
    if not nodes:
        return {}

    def missing_paths(paths: List[str]) -> List[str]:  # nested: pickled by value, needs no code of this checkout
        import os
        return [p for p in paths if not os.path.exists(p)]

    probe = ray.remote(missing_paths)
    refs = {probe.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(list(paths)): n for n in nodes}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=NODE_CHECK_TIMEOUT_S)
    out = {}
    for ref in ready:
        lost = ray.get(ref)
        if lost:
            out[f"{refs[ref]['NodeManagerAddress']} ({refs[ref]['NodeID'][:8]})"] = lost
    return out


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


def forwarded_env(environ: Mapping[str, str] = os.environ) -> dict:
    """The variables of FORWARDED_ENV set (non-empty) here: Ray workers on the nodes of a joined cluster
    start with their node's environment, not this process's."""
    return {k: environ[k] for k in FORWARDED_ENV if environ.get(k)}


def rank_env() -> dict:
    env = forwarded_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def start_hosts(pg, bundles: List[int], ppo: PPOConfig, device: str) -> Tuple[list, list]:
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

"""Ray clusters as their users start them: `ray start --head`, then `ray start --address` for a second
node, with Ray's token authentication on (Ray turns it on for `ray start --head` whenever a token
exists, and a local `ray.init()` writes one to ~/.ray/auth_token). The manager and the engine join
with --ray-address, the token found as Ray finds it; a study's runs land on both nodes and compute
what the same run computes alone; `ray list tasks` (ray[default]) shows where they ran. An address
where no Ray cluster this process can join answers (a closed port, an HTTP server, a socket that never
answers, a token missing or refused) is one line and exit 2 within seconds; Ctrl-C while connecting
is one line and exit 130.

Each cluster is two `ray start --block` processes on free ports with a temp dir of their own, stopped
by pid (SIGTERM, then SIGKILL for their descendants still running): never `ray stop`, which stops
every Ray instance of the machine. The cluster's token is a file of the test's (RAY_AUTH_TOKEN_PATH),
so the user's ~/.ray is neither read nor written.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import secrets
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from experiments.run_records import last_attempt
from rlhf.metrics import read_metrics
from tests.conftest import REPO, assert_same_metrics

STUDY = """
study.name = 'cluster'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 2', 'ppo.eval_every = 2', 'ppo.save_every = 2', 'ppo.final_window = 2',
                           'task.eval_size = 16']
study.variants = {'kl_up': 'ppo.kl_coef = 0.1'}
study.seeds = 1
study.cpus_per_run = 1
"""
RAY_VARIABLES = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""The user's own Ray settings: no test depends on them."""
SECOND_NODE = "second_node"
"""A custom resource only the second node has: it tells the two apart in `ray list nodes`."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in RAY_VARIABLES}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", **extra}


def ray_cli(*args: str) -> list:
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


class RayNode:
    """One `ray start --block` process (and the Ray daemons it starts), in a session of its own."""

    def __init__(self, args: list, env: dict, log: Path):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(ray_cli("start", "--block", "--disable-usage-stats", *args), env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_started(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while "will now block" not in self.log.read_text():
            assert self.proc.poll() is None, f"ray start exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start is not up: {self.log.read_text()[-3000:]}"
            time.sleep(0.5)

    def stop(self) -> None:
        """`ray start --block` stops its daemons on SIGTERM; whatever of them still runs 30 s later is killed."""
        try:
            parent = psutil.Process(self.proc.pid)
            family = [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        parent.terminate()
        _, alive = psutil.wait_procs(family, timeout=30)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()


class TokenCluster:
    """A head node (1 CPU) and a second node (1 CPU and SECOND_NODE), with token authentication."""

    def __init__(self, root: Path):
        self.root, self.token = root, root / "token"
        self.token.write_text(secrets.token_hex(32))
        self.env = clean_env(RAY_AUTH_TOKEN_PATH=str(self.token))
        self.nodes, self.address = [], None

    def start(self) -> None:
        head = RayNode(["--head", "--port", str(free_port()), "--num-cpus", "1", "--temp-dir", str(self.root / "head"),
                        "--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port()),
                        "--dashboard-agent-listen-port", str(free_port())], self.env, self.root / "head.log")
        self.nodes.append(head)
        head.wait_started()
        # The address `ray start --head` tells users to join with.
        self.address = re.search(r"ray start --address='([^']+)'", head.log.read_text()).group(1)
        # A node joining with an explicit address turns token mode on only when told (Ray does not detect it).
        # Ray gives a joining node 5 s to reach the head's GCS (`gcs_rpc_server_connect_timeout_s`); on a
        # loaded 2-core machine, with the head's daemons still starting, that was too little once.
        second = RayNode(["--address", self.address, "--num-cpus", "1", "--resources", json.dumps({SECOND_NODE: 1}),
                          "--temp-dir", str(self.root / "second"), "--dashboard-agent-listen-port", str(free_port())],
                         {**self.env, "RAY_AUTH_MODE": "token", "RAY_gcs_rpc_server_connect_timeout_s": "60"},
                         self.root / "second.log")
        self.nodes.append(second)
        second.wait_started()

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()

    def ray_list(self, what: str) -> list:
        """`ray list WHAT` through the head's dashboard, as a user with the cluster's token runs it."""
        proc = subprocess.run(ray_cli("list", what, "--address", self.address, "--format", "json", "--limit", "1000"),
                              env={**self.env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="rayc-"))  # short: Ray's socket paths must fit in 107 bytes
    made = TokenCluster(root)
    try:
        made.start()
        yield made
    finally:
        made.stop()
        shutil.rmtree(root, ignore_errors=True)


def manager(args: list, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def engine(args: list, env: dict, out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf.train", "recipes/tiny.gin", *map(str, args), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == code and len(lines) == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


COLOCATED_1_STEP = ["-b", "ppo.placement = 'colocated'", "-b", "ppo.total_steps = 1", "-b", "ppo.eval_every = 1",
                    "-b", "task.eval_size = 16", "--quiet"]


@pytest.mark.slow
def test_a_study_joins_a_token_cluster_and_its_runs_land_on_both_nodes(cluster, workdir):
    study = workdir / "cluster.gin"
    study.write_text(STUDY)
    results = workdir / "results"
    proc = manager(["run", study, "--results", results, "--ray-address", cluster.address], cluster.env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 completed" in proc.stdout and "Traceback" not in proc.stderr

    # Two runs of 1 CPU on two nodes of 1 CPU: one each; `ray list` (the dashboard of ray[default]) says where.
    second = next(n["node_id"] for n in cluster.ray_list("nodes") if SECOND_NODE in n["resources_total"])
    tasks = {t["name"]: t for t in cluster.ray_list("tasks") if t["name"].startswith("cluster:")}
    assert set(tasks) == {"cluster:baseline/seed0", "cluster:kl_up/seed0"}
    assert {t["state"] for t in tasks.values()} == {"FINISHED"}
    assert second in {t["node_id"] for t in tasks.values()} and len({t["node_id"] for t in tasks.values()}) == 2

    # The run on the second node computes what its engine command computes alone, off the cluster.
    on_second = next(key.split(":")[1] for key, t in tasks.items() if t["node_id"] == second)
    run_dir = results / "cluster" / "runs" / on_second
    command = last_attempt(run_dir)["command"]
    alone = workdir / "alone"
    argv = command[:command.index("--out")] + ["--out", str(alone), "--quiet"]
    local = subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stderr[-3000:]
    assert_same_metrics(read_metrics(run_dir / "metrics.jsonl"), read_metrics(alone / "metrics.jsonl"))


@pytest.mark.slow
def test_the_engine_joins_a_token_cluster_with_the_token_ray_finds(cluster, workdir):
    proc = engine([*COLOCATED_1_STEP, "--ray-address", cluster.address], cluster.env, workdir / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "placing 3 roles x 1 ranks (colocated, cpu)" in proc.stderr
    assert (workdir / "run" / "summary.json").exists()


def without_home_token(tmp: Path) -> dict:
    """This process's environment with a HOME that holds no ~/.ray/auth_token (and the same user site)."""
    return {"HOME": str(tmp), "PYTHONUSERBASE": site.getuserbase()}


@pytest.mark.parametrize("env, message", [
    ({"RAY_AUTH_TOKEN": "not-the-cluster-token"}, "the Ray cluster there refused this machine's token (from "
                                                  "RAY_AUTH_TOKEN); set RAY_AUTH_TOKEN to the cluster's token"),
    ({"RAY_AUTH_TOKEN_PATH": "/no/such/token"}, "RAY_AUTH_TOKEN_PATH is set but file cannot be opened or is empty: "
                                                "/no/such/token; set RAY_AUTH_TOKEN to the cluster's token"),
    ({"RAY_AUTH_MODE": "disabled"}, "requires token authentication, but RAY_AUTH_MODE=disabled here; unset it"),
    ("no token", "requires token authentication and this machine has no token; set RAY_AUTH_TOKEN to the "
                 "cluster's token (`ray get-auth-token` on its head node prints it), or copy the head node's "
                 "~/.ray/auth_token"),
])
def test_a_token_missing_or_refused_is_one_line_naming_what_to_set(cluster, tmp_path, env, message):
    env = without_home_token(tmp_path) if env == "no token" else env
    start = time.monotonic()
    line = one_error_line(engine([*COLOCATED_1_STEP, "--ray-address", cluster.address], clean_env(**env),
                                 tmp_path / "run", timeout=120))
    assert time.monotonic() - start < 60
    assert line.startswith(f"error: --ray-address '{cluster.address}': ") and message in line, line
    assert not (tmp_path / "run").exists()


def test_every_node_is_asked_whether_it_sees_the_paths_the_runs_need(cluster):
    """The manager asks each other node for the paths its runs need (`launch.check_nodes_see`): on one
    machine every node sees this checkout; a path no node has is reported for the second node."""
    code = ("import json, sys; from rlhf.placement.cluster import connect, paths_missing_on_nodes; "
            "connect(sys.argv[1]); print(json.dumps(paths_missing_on_nodes([sys.argv[2], '/no/such/results'])))")
    proc = subprocess.run([sys.executable, "-c", code, cluster.address, str(REPO / "rlhf" / "train.py")], cwd=REPO,
                          env=cluster.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = next(n for n in cluster.ray_list("nodes") if SECOND_NODE in n["resources_total"])
    missing = json.loads(proc.stdout.strip().splitlines()[-1])
    assert list(missing.values()) == [["/no/such/results"]]  # the head is this process's own node: not asked
    assert list(missing) == [f"{second['node_ip']} ({second['node_id'][:8]})"]


@contextlib.contextmanager
def listening(kind: str):
    """A loopback port: 'closed' (nothing listens), 'http' (an HTTP server), or 'silent' (it accepts
    connections and never sends a byte); yields (port, an Event set on each accepted connection)."""
    accepted = threading.Event()
    if kind == "closed":
        yield free_port(), accepted
    elif kind == "http":
        server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield server.server_address[1], accepted
        finally:
            server.shutdown()
            server.server_close()
    else:
        server, conns = socket.create_server(("127.0.0.1", 0)), []

        def accept() -> None:
            while True:
                try:
                    conns.append(server.accept()[0])
                except OSError:
                    return
                accepted.set()
        threading.Thread(target=accept, daemon=True).start()
        try:
            yield server.getsockname()[1], accepted
        finally:
            server.close()
            for conn in conns:
                conn.close()


def _connects_to(proc: subprocess.Popen, port: int, timeout: float) -> bool:
    """Whether `proc` (or a thread of it) opens a TCP connection to loopback `port` within `timeout` s."""
    import psutil
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if any(c.raddr and c.raddr.port == port for c in psutil.Process(proc.pid).net_connections("tcp")):
                return True
        except psutil.Error:
            pass
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("kind", ["closed", "http"])
def test_an_address_that_is_not_a_ray_cluster_is_one_line_within_seconds(kind, workdir, write_study):
    """A closed port, or an HTTP server, which accepts the connection and then answers what Ray's GCS
    never does (where ray.init waited more than ten minutes)."""
    study = write_study(STUDY)
    with listening(kind) as (port, _):
        start = time.monotonic()
        line = one_error_line(manager(["run", study, "--results", workdir, "--ray-address", f"127.0.0.1:{port}"],
                                      clean_env(), timeout=180))
        took = time.monotonic() - start
    assert took < 90, took  # the manager's planning before it included, on a loaded 2-core machine
    where = f"error: --ray-address '127.0.0.1:{port}'"
    if kind == "closed":
        assert line.startswith(f"{where}: no Ray cluster answers there (Connection refused"), line
    else:
        assert line.startswith(f"{where}: accepts connections but is not a Ray cluster's GCS (its answer: "), line
        assert "give the address `ray start --head` printed (port 6379 by default" in line
    assert not (workdir / "cluster" / "runs").exists()


def test_a_socket_that_never_answers_is_one_line_and_ctrl_c_while_connecting_is_exit_130(tmp_path):
    study = tmp_path / "cluster.gin"
    study.write_text(STUDY)
    with listening("silent") as (port, _):
        address = f"127.0.0.1:{port}"
        line = one_error_line(engine([*COLOCATED_1_STEP, "--ray-address", address], clean_env(), tmp_path / "a",
                                     timeout=120))
        assert line.startswith(f"error: --ray-address '{address}': accepts connections but is not a Ray cluster's "
                               f"GCS (no answer within 5 s)"), line

        for argv in ([sys.executable, "-m", "rlhf.train", "recipes/tiny.gin", *COLOCATED_1_STEP, "--ray-address",
                      address, "--out", str(tmp_path / "b")],
                     [sys.executable, "-m", "experiments", "run", str(study), "--results", str(tmp_path / "results"),
                      "--ray-address", address]):
            # Started as a shell script's background job is (`cmd &`): SIGINT ignored, which Python
            # keeps unless told otherwise (rlhf.errors.honour_interrupts).
            proc = subprocess.Popen(argv, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
            try:
                # Its own connection, not one an earlier process left in the listener's queue.
                assert _connects_to(proc, port, timeout=120), "it never connected"
                time.sleep(0.5)  # in the handshake now, which waits up to 5 s for an answer
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
            finally:
                proc.kill()
                proc.wait()
            lines = [line for line in err.strip().splitlines() if line.strip()]
            assert proc.returncode == 130 and len(lines) == 1 and lines[0].startswith("interrupted"), \
                f"{' '.join(argv[1:3])}: {out}{err}"

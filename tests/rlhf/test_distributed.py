"""The engine on Ray: world size 2 (two FSDP2 ranks over gloo, one per node of a two-node
`ray.cluster_utils.Cluster`) computes what one process computes; a single-process checkpoint
resumes in split placement; placement errors come before any compute.

Every distributed run joins the same two-node cluster (1 CPU each), so a two-rank run cannot fit
on one node and its roles land on both.
"""

import json
import shutil

import pytest
from safetensors.torch import load_file

from rlhf.metrics import read_metrics
from tests.conftest import REPO, assert_same_metrics, run_train, side_by_side

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

RECIPE = str(REPO / "recipes" / "tiny.gin")
SHORT = ["-b", "ppo.total_steps = 3", "-b", "ppo.eval_every = 3", "-b", "ppo.save_every = 1",
         "-b", "ppo.keep_checkpoints = 0", "-b", "task.eval_size = 32", "--quiet"]
@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def train(args, out, cwd, **kw):
    # cwd outside the repo: the engine must not depend on where it is started from.
    return run_train([RECIPE, *SHORT, *args, "--out", out], cwd=cwd, **kw)


def assert_same_checkpoint(a, b):
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in ("actor/model.safetensors", "critic.safetensors", "actor_optim.safetensors",
                 "critic_optim.safetensors"):
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        assert ta.keys() == tb.keys(), name
        for key in ta:
            assert ta[key].shape == tb[key].shape and ta[key].dtype == tb[key].dtype, (name, key)
            assert (ta[key].double() - tb[key].double()).abs().max() <= 1e-5, (name, key)
    sa, sb = (json.loads((d / "state.json").read_text()) for d in (a, b))
    assert sa["trainer"] == sb["trainer"] and sa["actor_scheduler"] == sb["actor_scheduler"]
    assert sa["actor_optim"]["param_groups"] == sb["actor_optim"]["param_groups"]


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The run in one process and the same run as two ranks on the cluster, side by side: their run dirs."""
    single, two_ranks = tmp_path_factory.mktemp("ws1"), tmp_path_factory.mktemp("ws2")
    side_by_side(lambda: train([], single, cwd=single),
                 lambda: train(["-b", "ppo.world_size = 2", "--ray-address", cluster.address], two_ranks,
                               cwd=two_ranks))
    return single, two_ranks


@pytest.fixture(scope="module")
def single(runs):
    return runs[0]


@pytest.fixture(scope="module")
def two_ranks(runs):
    return runs[1]


def test_world_size_2_on_two_nodes_equals_world_size_1(single, two_ranks):
    assert_same_metrics(read_metrics(single / "metrics.jsonl"), read_metrics(two_ranks / "metrics.jsonl"))
    for step in (1, 3):
        assert_same_checkpoint(single / "checkpoints" / f"step_{step}", two_ranks / "checkpoints" / f"step_{step}")
    placed = json.loads((two_ranks / "provenance.json").read_text())["placement"]
    assert placed["placement"] == "colocated" and placed["world_size"] == 2
    for role in ("actor", "critic", "reference"):
        assert [r["rank"] for r in placed["roles"][role]] == [0, 1]
        assert len({r["node_id"] for r in placed["roles"][role]}) == 2, f"{role} ranks share a node"
    summary = json.loads((two_ranks / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final"] == json.loads(
        (single / "summary.json").read_text())["final"]


RANK_PHASES = ("generate", "reference", "old_logprobs", "values", "update_actor", "update_critic")


def test_each_phase_s_time_on_the_ranks_is_within_the_controllers(two_ranks):
    """The ranks time the calls they run for each phase (`perf/rank_s/<phase>`, the slowest rank's)
    and how busy their host thread was (`perf/host_busy/<phase>`): within what the controller waited
    for the phase; the phases the controller runs itself (reward, advantages) have no rank time."""
    steps = [r for r in read_metrics(two_ranks / "metrics.jsonl") if "timing_s/step" in r]  # not step 0's eval
    assert len(steps) == 3
    for record in steps:
        for phase in RANK_PHASES:
            assert 0 < record[f"perf/rank_s/{phase}"] <= record[f"timing_s/{phase}"], (phase, record["step"])
            assert 0 <= record[f"perf/host_busy/{phase}"] <= 1
        assert "perf/rank_s/reward" not in record and "perf/rank_s/advantages" not in record


def test_single_process_checkpoint_resumes_in_split_placement(single, cluster, tmp_path):
    """Restores actor, critic, optimizers and schedulers into ranks through the checkpoint
    stand-ins, then finishes the run as one process would."""
    out = tmp_path / "resumed"
    shutil.copytree(single, out)
    for later in ("step_2", "step_3"):
        shutil.rmtree(out / "checkpoints" / later)
    (out / "summary.json").unlink()
    train(["-b", "ppo.placement = 'split'", "-b", "ppo.cpus_per_rank = 0.5", "--ray-address", cluster.address,
           "--resume"], out, cwd=tmp_path)
    assert_same_metrics(read_metrics(single / "metrics.jsonl"), read_metrics(out / "metrics.jsonl"))
    placed = json.loads((out / "provenance.json").read_text())["placement"]
    assert placed["placement"] == "split"
    pids = [placed["roles"][role][0]["pid"] for role in ("actor", "critic", "reference")]
    assert len(set(pids)) == 3, "split placement gives each role processes of its own"


def test_distributed_checkpoint_starts_a_single_process_run(two_ranks, tmp_path):
    ckpt = two_ranks / "checkpoints" / "step_3"
    run_train([RECIPE, "-b", "ppo.total_steps = 1", "-b", "task.eval_size = 32", "--quiet",
               "-b", f"ppo.init_from = '{ckpt}'", "--out", tmp_path / "next"], cwd=tmp_path)
    first = read_metrics(tmp_path / "next" / "metrics.jsonl")[0]
    assert first["eval/greedy_accuracy"] == read_metrics(two_ranks / "metrics.jsonl")[-1]["eval/greedy_accuracy"]


def test_placement_that_cannot_fit_fails_before_compute(cluster, tmp_path):
    big, local = side_by_side(
        lambda: train(["-b", "ppo.world_size = 2", "-b", "ppo.cpus_per_rank = 4", "--ray-address", cluster.address],
                      tmp_path / "run", cwd=tmp_path, check=False),
        lambda: train(["-b", "ppo.world_size = 2", "-b", "ppo.placement = 'local'"], tmp_path / "run2", cwd=tmp_path,
                      check=False))
    assert big.returncode == 2, big.stderr[-2000:]
    assert "ppo.world_size = 2" in big.stderr and "8 CPU (the cluster has 2)" in big.stderr
    assert local.returncode == 2 and "ppo.placement = 'local' is invalid" in local.stderr


LORA = ["-b", "ppo.lora_rank = 8", "-b", "ppo.actor_learning_rate = 1e-3", "-b", "ppo.critic_learning_rate = 3e-3"]


def assert_same_adapters(a, b):
    for name in ("actor/adapter_model.safetensors", "critic/adapter_model.safetensors", "critic/value_head.safetensors",
                 "actor_optim.safetensors", "critic_optim.safetensors"):
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        assert ta.keys() == tb.keys(), name
        for key in ta:
            assert (ta[key].double() - tb[key].double()).abs().max() <= 1e-5, (name, key)


@pytest.mark.parametrize("placement", ["world_size_2", "split"])
def test_lora_on_ray_equals_one_process(cluster, tmp_path_factory, placement):
    """LoRA in every placement: two FSDP2 ranks over gloo (frozen base and adapters sharded), or
    each role in processes of its own; the reference is the actor's base with the adapter off."""
    single = tmp_path_factory.getbasetemp() / "lora-ws1"
    out = tmp_path_factory.mktemp(f"lora-{placement}")
    where = (["-b", "ppo.world_size = 2"] if placement == "world_size_2" else
             ["-b", "ppo.placement = 'split'", "-b", "ppo.cpus_per_rank = 0.5"])
    runs = [lambda: train([*LORA, *where, "--ray-address", cluster.address], out, cwd=out)]
    if not (single / "summary.json").is_file():  # the one-process run, beside the first placement's
        runs.append(lambda: train(LORA, single, cwd=tmp_path_factory.getbasetemp()))
    side_by_side(*runs)
    assert_same_metrics(read_metrics(single / "metrics.jsonl"), read_metrics(out / "metrics.jsonl"))
    assert_same_adapters(single / "checkpoints" / "step_3", out / "checkpoints" / "step_3")
    roles = json.loads((out / "provenance.json").read_text())["placement"]["roles"]
    assert "reference" not in roles, "LoRA needs no reference weights of its own"

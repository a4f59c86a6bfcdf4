"""The distributed roles on GPUs, without Ray: one spawned process per GPU hosts a rank
(`RankHost`), joined over NCCL. Skipped without CUDA. It checks what the CPU tests cannot: the
NCCL backend, offloading idle models to CPU in colocated placement, and that world size N
matches world size 1 on the same GPU kernels.

    python -m pytest -q tests/rlhf/test_distributed_gpu.py     # on the GPU machine

RLHF_TEST_DEVICE=cpu runs the same checks over gloo (for developing this file on a CPU machine).
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

DEVICE = os.environ.get("RLHF_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rank_main(rank, ws, port, model_dir, offload, out):
    if DEVICE == "cuda" and torch.cuda.device_count() > 1:
        # CUDA is already initialised in this child (the module's skip check), so
        # CUDA_VISIBLE_DEVICES would come too late: pick the rank's device as Ray's isolation would.
        torch.cuda.set_device(rank)
    import torch.distributed as dist

    from rlhf.batch import Batch
    from rlhf.config import PPOConfig
    from rlhf.placement.host import RankHost
    from rlhf.roles import RoleSpec
    from rlhf.rollout import SamplingParams

    ppo = PPOConfig(rollout_micro_batch_size=16, num_rollout_batches=2, mini_batch_size=16, micro_batch_size=8,
                    device=DEVICE, actor_learning_rate=1e-3, critic_learning_rate=1e-3, max_response_length=8,
                    world_size=ws, placement="colocated")
    host = RankHost(rank, ws, DEVICE, 1 if DEVICE == "cpu" else 4, bf16=False)
    host.init_world("127.0.0.1", port)
    host.set_offload(offload)
    host.add_role(RoleSpec("actor", "rlhf.roles.actor:Actor",
                           dict(ppo=ppo, start_dir=model_dir, tokenizer_dir=model_dir, total_updates=4)))
    host.add_role(RoleSpec("critic", "rlhf.roles.critic:Critic",
                           dict(ppo=ppo, model_dir=model_dir, random_init=False, total_updates=4)))
    host.add_role(RoleSpec("reference", "rlhf.roles.reference:Reference", dict(ppo=ppo, model_dir=model_dir)))
    sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=8, max_prompt_length=8))
    prompts = [f"{i}+{i % 7}=" for i in range(32)]
    # Every rank generates both calls here, so every rank holds the whole buffer.
    parts = host.call("actor", "generate", [(prompts[:16], 1), (prompts[16:], 2)], sampling)
    batch = Batch.concat(parts, pad_values={"prompt_ids": 0, "response_ids": 0}, left_pad=("prompt_ids", "prompt_mask"))
    mine = batch.select(range(rank * 32 // ws, (rank + 1) * 32 // ws))
    memory = {}
    gathered = {}
    for key, role, method in (("ref_logprobs", "reference", "compute_logprobs"),
                              ("old_logprobs", "actor", "compute_logprobs"), ("values", "critic", "compute_values")):
        result = host.call(role, method, mine)
        result = result[0] if isinstance(result, tuple) else result
        if DEVICE == "cuda":
            memory[role] = torch.cuda.memory_allocated()
        parts = [torch.zeros_like(result) for _ in range(ws)]
        dist.all_gather(parts, result)
        gathered[key] = torch.cat(parts)
    for key, value in gathered.items():
        batch[key] = value
    gen = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(batch["old_logprobs"].shape, generator=gen) * batch["response_mask"]
    batch["returns"] = torch.randn(batch["old_logprobs"].shape, generator=gen) * batch["response_mask"]
    critic_stats = host.call("critic", "update", batch, shuffle_seed=3)
    actor_stats = host.call("actor", "update", batch, shuffle_seed=4, kl_coef=0.1)
    host.call("actor", "sync_weights")
    files = host.call("actor", "model_files")
    states = [host.call("actor", "optimizer_state"), host.call("critic", "model_state")]
    # What a rank returns leaves it on the host (a one-rank optimizer state holds the live moments).
    on_host = all(t.device.type == "cpu" for state in (states[0].get("state", {}).values()) for t in state.values()
                  if isinstance(t, torch.Tensor))
    dist.broadcast_object_list(states, src=0)  # rank 0's full states, loaded back on every rank
    host.call("actor", "load_optimizer_state", states[0])
    host.call("critic", "load_model_state", states[1], True)
    again = host.call("actor", "update", batch, shuffle_seed=5, kl_coef=0.1)
    if rank == 0:
        actor_stats.pop("policy_ratio_hist")
        with open(out, "w") as f:
            json.dump({"critic": critic_stats, "actor": actor_stats, "again": again["actor/pg_loss"],
                       "files": sorted(files), "optimizer_params": len(states[0]["state"]), "memory": memory,
                       "on_host": on_host,
                       "old_logprobs_sum": float(gathered["old_logprobs"].double().sum())}, f)
    host.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlhf.config import TinyModelConfig
    from rlhf.tiny import build_char_tokenizer, build_tiny_model
    path = tmp_path_factory.mktemp("model")
    tok = build_char_tokenizer(path)
    build_tiny_model(TinyModelConfig(), tok, seed=0).save_pretrained(str(path))
    return str(path)


def spawn(ws, offload, model_dir, out, port):
    mp.spawn(rank_main, args=(ws, port, model_dir, offload, str(out)), nprocs=ws, join=True)
    return json.loads(out.read_text())


def test_ranks_match_one_rank_and_offload_frees_the_device(model_dir, tmp_path):
    ws = max(2, torch.cuda.device_count()) if DEVICE == "cuda" else 2
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        ws = 1
    one = spawn(1, True, model_dir, tmp_path / "one.json", 29611)
    many = spawn(ws, True, model_dir, tmp_path / "many.json", 29612)
    resident = spawn(ws, False, model_dir, tmp_path / "resident.json", 29613)
    for run in (one, many, resident):
        assert "actor/model.safetensors" in run["files"] and "actor/config.json" in run["files"]  # checkpoint paths
        assert run["on_host"] and run["optimizer_params"] > 0
        assert all(torch.isfinite(torch.tensor(v)) for v in run["critic"].values())
    assert many["old_logprobs_sum"] == pytest.approx(one["old_logprobs_sum"], rel=1e-4)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/clip_fraction", "actor/entropy"):
        assert many["actor"][key] == pytest.approx(one["actor"][key], rel=1e-3, abs=1e-5), key
    assert many["critic"]["critic/value_loss"] == pytest.approx(one["critic"]["critic/value_loss"], rel=1e-3)
    assert resident["actor"]["actor/pg_loss"] == pytest.approx(many["actor"]["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert many["again"] == pytest.approx(resident["again"], rel=1e-5, abs=1e-7)
    if DEVICE == "cuda":  # offloading: with the critic at work, the actor's and reference's weights left the GPU
        assert many["memory"]["critic"] < resident["memory"]["critic"]

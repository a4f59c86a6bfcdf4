"""Token-budget micro-batches packed into one row (`ppo.max_tokens_per_micro_batch`, rlhf/packing.py):
the partition, packed forwards equal to padded ones (Llama and Qwen2), updates equal to the padded
path's, the engine with a budget against the engine without, and world size 2 against world size 1.
"""

import copy
import itertools
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf import algos
from rlhf.batch import Batch
from rlhf.config import PPOConfig, TinyModelConfig
from rlhf.errors import ConfigError
from rlhf.metrics import read_metrics
from rlhf.models import ValueModel
from rlhf.packing import PackedBatch, balanced_partition, budget_partition, micro_batches, pack, real_lengths
from rlhf.placement.context import DeviceContext
from rlhf.roles.actor import Actor
from rlhf.roles.critic import Critic
from rlhf.roles.forward import response_logprobs
from rlhf.roles.reference import Reference
from rlhf.tiny import build_char_tokenizer, build_tiny_model
from tests.conftest import REPO, assert_same_metrics, run_train, side_by_side

CPU = DeviceContext(torch.device("cpu"))
P, R = 30, 40  # prompt and response widths of the uneven batch


class FakeRanks:
    """Ranks whose largest micro-batch count is `count` (what the all-reduce would give)."""

    rank, world_size = 0, 2

    def __init__(self, count):
        self.count = count

    def max(self, tensor):
        return torch.maximum(tensor, torch.tensor(self.count))


# ---------------------------------------------------------------- the partition

def test_budget_partition_keeps_order_and_budget_and_isolates_a_long_sequence():
    lengths = [5, 7, 3, 30, 2, 2, 9, 1, 12]
    parts = budget_partition(lengths, 12)
    assert [i for r in parts for i in r] == list(range(len(lengths)))  # in order, each once
    assert all(len(r) for r in parts)
    assert range(3, 4) in parts  # longer than the budget: alone
    assert all(sum(lengths[i] for i in r) <= 12 for r in parts if r != range(3, 4))
    assert parts == [range(0, 2), range(2, 3), range(3, 4), range(4, 6), range(6, 8), range(8, 9)]
    assert budget_partition([], 8) == [] and budget_partition([3], 8) == [range(0, 1)]


def test_balanced_partition_is_exact_contiguous_and_minimal():
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lengths = torch.randint(1, 20, (n,), generator=g).tolist()
        for k in range(1, n + 1):
            parts = balanced_partition(lengths, k)
            assert len(parts) == k and all(len(r) for r in parts)
            assert [i for r in parts for i in r] == list(range(n))
            best = min(max(sum(lengths[a:b]) for a, b in zip((0,) + cuts, cuts + (n,)))
                       for cuts in itertools.combinations(range(1, n), k - 1))
            assert max(sum(lengths[i] for i in r) for r in parts) == best
    with pytest.raises(ValueError):
        balanced_partition([1, 2], 3)


def uneven_batch(vocab, n=12, seed=0, empty_response=True):
    """Prompts of 3 to 30 real tokens (left-padded to P), responses of 1 to 40 (right-padded to R);
    with `empty_response`, one sequence has none."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(3, P + 1, (n,), generator=g)
    response_len = torch.randint(1, R + 1, (n,), generator=g)
    prompt_len[0], response_len[0], prompt_len[1], response_len[1] = P, R, 3, 1
    if empty_response:
        response_len[2] = 0
    prompt_mask = (torch.arange(P)[None] >= P - prompt_len[:, None]).long()
    response_mask = (torch.arange(R)[None] < response_len[:, None]).long()
    prompt_ids = torch.randint(4, vocab, (n, P), generator=g) * prompt_mask
    response_ids = torch.randint(4, vocab, (n, R), generator=g) * response_mask
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask,
                  "old_logprobs": -torch.rand(n, R, generator=g) * 3 * response_mask,
                  "advantages": torch.randn(n, R, generator=g) * response_mask,
                  "ref_logprobs": -torch.rand(n, R, generator=g) * 3 * response_mask,
                  "values": torch.randn(n, R, generator=g) * response_mask,
                  "returns": torch.randn(n, R, generator=g) * response_mask})


def test_micro_batches_by_count_budget_and_ranks():
    batch = uneven_batch(50)
    lengths = real_lengths(batch).tolist()
    assert [len(m) for m in micro_batches(batch, 5)] == [5, 5, 2]
    assert not any(isinstance(m, PackedBatch) for m in micro_batches(batch, 5))
    budget = P + R
    micros = micro_batches(batch, 5, budget)
    assert all(isinstance(m, PackedBatch) for m in micros)
    assert torch.equal(torch.cat([m["response_ids"] for m in micros]), batch["response_ids"])
    assert [len(m) for m in micros] == [len(r) for r in budget_partition(lengths, budget)]
    assert all(int(real_lengths(m).sum()) <= budget for m in micros)
    # Another rank needs more micro-batches: this one cuts its rows into as many, still within the budget.
    more = len(micros) + 2
    micros = micro_batches(batch, 5, budget, FakeRanks(more))
    assert len(micros) == more and all(int(real_lengths(m).sum()) <= budget for m in micros)
    assert torch.equal(torch.cat([m["prompt_ids"] for m in micros]), batch["prompt_ids"])


def _rank_micro_batches(rank, init_file, out_dir):
    import torch.distributed as dist

    from rlhf.placement.context import ProcessGroupRanks

    torch.set_num_threads(1)  # a forked child: no inherited thread pools
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        batch = uneven_batch(50, seed=rank)
        if rank == 0:  # short sequences: fewer micro-batches by the greedy count
            batch["response_mask"][:, 1:] = 0
            batch["prompt_mask"][:, :-3] = 0
        micros = micro_batches(batch, 4, P + R, ProcessGroupRanks(rank, 2, torch.device("cpu")))
        greedy = len(budget_partition(real_lengths(batch).tolist(), P + R))
        sizes = [int(real_lengths(m).sum()) for m in micros]
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"count": len(micros), "greedy": greedy,
                                                               "sizes": sizes}))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_largest_micro_batch_count(tmp_path):
    """Over gloo: the rank with the shorter sequences runs as many micro-batches as the other."""
    torch.multiprocessing.start_processes(_rank_micro_batches, args=(str(tmp_path / "init"), tmp_path), nprocs=2,
                                          start_method="fork")  # fork: no second import of torch and the engine
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["greedy"] < r1["greedy"]
    assert r0["count"] == r1["count"] == r1["greedy"]
    assert all(n <= P + R for n in r0["sizes"] + r1["sizes"])


def test_pack_lays_out_one_row_and_unpacks_to_the_padded_shape():
    batch = uneven_batch(50, n=4)
    row = pack(batch)
    lengths = real_lengths(batch)
    T, N = int(lengths.sum()), int(batch["response_mask"].sum())
    assert row.input_ids.shape == row.position_ids.shape == (1, T)
    assert row.position_ids[0].tolist() == [p for n in lengths.tolist() for p in range(n)]
    assert row.index.shape == (N,) and row.tokens.shape == (1, N)
    start = 0
    for b, n in enumerate(lengths.tolist()):  # each sequence's real tokens, in order
        real = torch.cat([batch["prompt_ids"][b][batch["prompt_mask"][b].bool()],
                          batch["response_ids"][b][batch["response_mask"][b].bool()]])
        assert torch.equal(row.input_ids[0, start:start + n], real)
        start += n
    # The output at index[j] is that of the token before response token j.
    assert torch.equal(row.input_ids[0, row.index + 1], row.tokens[0])
    assert torch.equal(row.unpack(row.tokens.float()), batch["response_ids"].float() * batch["response_mask"])
    with pytest.raises(ValueError, match="no prompt token"):
        bad = Batch({k: v.clone() for k, v in batch.tensors.items()})
        bad["prompt_mask"][0] = 0
        pack(bad)


def test_budget_below_the_longest_sequence_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"ppo.max_tokens_per_micro_batch = 39 is invalid: .* = 40"):
        PPOConfig(max_prompt_length=32, max_response_length=8, max_tokens_per_micro_batch=39)
    PPOConfig(max_prompt_length=32, max_response_length=8, max_tokens_per_micro_batch=40)
    PPOConfig(max_tokens_per_micro_batch=0)
    proc = run_train(["recipes/tiny.gin", "-b", "ppo.max_tokens_per_micro_batch = 10", "--out", tmp_path / "run"],
                     check=False)
    assert proc.returncode == 2 and "ppo.max_tokens_per_micro_batch = 10 is invalid" in proc.stderr
    assert "ppo.max_prompt_length + ppo.max_response_length = 14" in proc.stderr


# ---------------------------------------------------------------- packed forwards equal padded ones

@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def tiny_qwen2(tok):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                                        tie_word_embeddings=False))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def policy(request, tok):
    if request.param == "llama":
        return build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64),
                                tok, seed=0)
    return tiny_qwen2(tok)


def value_model(policy, seed=0):
    torch.manual_seed(seed)
    model = ValueModel(copy.deepcopy(policy).base_model, policy.config.hidden_size)
    torch.nn.init.normal_(model.value_head.weight, std=0.3)
    return model


def forward_cfg(budget, **kw):
    kw = {"mini_batch_size": 12, "micro_batch_size": 4, **kw}
    return PPOConfig(rollout_micro_batch_size=12, num_rollout_batches=1, max_prompt_length=P, max_response_length=R,
                     max_tokens_per_micro_batch=budget, **kw)


def assert_equal_on_mask(packed, padded, mask, tol=1e-5):
    assert packed.shape == padded.shape
    torch.testing.assert_close(packed * mask, padded * mask, rtol=0, atol=tol)
    assert not (packed * (1 - mask)).any()  # padding positions are 0


def test_packed_forward_equals_padded_forward(policy, tok):
    batch = uneven_batch(len(tok))
    mask = batch["response_mask"].float()
    model = policy.eval()
    with torch.no_grad():
        lp, ent = response_logprobs(model, batch, torch.device("cpu"), temperature=0.7)
        plp, pent = response_logprobs(model, PackedBatch.of(batch), torch.device("cpu"), temperature=0.7)
    assert_equal_on_mask(plp, lp, mask)
    assert_equal_on_mask(pent, ent, mask)
    # Through the roles: several packed micro-batches against padded ones of 4 sequences.
    budget = P + R + 20
    assert len(micro_batches(batch, 4, budget)) >= 4
    for role_budget in (0, budget):
        cfg = forward_cfg(role_budget, temperature=0.7)
        actor = Actor(CPU, cfg, start_dir="", tokenizer_dir="", total_updates=1, model=copy.deepcopy(model),
                      tokenizer=tok)
        alp, aent = actor.compute_logprobs(batch)
        rlp = Reference(CPU, cfg, model_dir="", model=copy.deepcopy(model)).compute_logprobs(batch)
        values = Critic(CPU, cfg, model_dir="", random_init=False, total_updates=1,
                        model=value_model(model)).compute_values(batch)
        if role_budget == 0:
            padded = alp, aent, rlp, values
    for got, want in zip((alp, aent, rlp, values), padded):
        assert_equal_on_mask(got, want, mask)
    assert_equal_on_mask(alp, lp, mask)


# ---------------------------------------------------------------- updates equal the padded path's

def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def recorded(monkeypatch, name):
    """Sums the losses `algos.<name>` returns over the micro-steps."""
    seen = []
    fn = getattr(algos, name)

    def wrapper(*args, **kw):
        loss, stats = fn(*args, **kw)
        seen.append(loss.detach())
        return loss, stats

    monkeypatch.setattr(algos, name, wrapper)
    return seen


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_actor_update_with_a_budget_equals_the_padded_update(policy, tok, monkeypatch, aggregation):
    batch = uneven_batch(len(tok), seed=1, empty_response=False)
    budget = P + R + 10  # 2 to 3 sequences a micro-batch
    results = []
    for micro_budget in (0, budget):
        # lr 0 and no clipping: the gradients left in the model are the mini-batch's.
        cfg = forward_cfg(micro_budget, actor_learning_rate=0.0, max_grad_norm=0.0, loss_aggregation=aggregation,
                          kl_mode="loss", entropy_coef=0.01, ppo_epochs=1)
        actor = Actor(CPU, cfg, start_dir="", tokenizer_dir="", total_updates=1, model=copy.deepcopy(policy),
                      tokenizer=tok)
        losses = recorded(monkeypatch, "policy_loss")
        stats = actor.update(batch, shuffle_seed=3, kl_coef=0.1)
        monkeypatch.undo()
        results.append((sum(losses), flat_grads(actor.model), stats, len(losses)))
    (loss0, grad0, stats0, n0), (loss1, grad1, stats1, n1) = results
    assert n0 == 3 and n1 >= 4  # 12 sequences: 3 of 4 padded; 2 to 3 a packed micro-batch
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-5)
    assert rel(grad1, grad0) < 1e-5
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/approx_kl"):
        assert stats1[key] == pytest.approx(stats0[key], rel=1e-5), key


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_critic_update_with_a_budget_equals_the_padded_update(policy, tok, monkeypatch, aggregation):
    batch = uneven_batch(len(tok), seed=2, empty_response=False)
    budget = P + R + 10
    results = []
    for micro_budget in (0, budget):
        cfg = forward_cfg(micro_budget, critic_learning_rate=0.0, max_grad_norm=0.0, loss_aggregation=aggregation,
                          ppo_epochs=1)
        critic = Critic(CPU, cfg, model_dir="", random_init=False, total_updates=1, model=value_model(policy))
        losses = recorded(monkeypatch, "value_loss")
        stats = critic.update(batch, shuffle_seed=5)
        monkeypatch.undo()
        results.append((sum(losses), flat_grads(critic.model), stats))
    (loss0, grad0, stats0), (loss1, grad1, stats1) = results
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-5)
    assert rel(grad1, grad0) < 1e-5
    for key in ("critic/value_loss", "critic/grad_norm"):
        assert stats1[key] == pytest.approx(stats0[key], rel=1e-5), key


def test_training_with_a_budget_follows_the_padded_training(tok):
    """Real steps (two mini-batches, two epochs, the shuffle) land on the same weights."""
    policy = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64),
                              tok, seed=0)
    batch = uneven_batch(len(tok), seed=3)
    params = []
    for micro_budget in (0, P + R):
        cfg = forward_cfg(micro_budget, mini_batch_size=6, micro_batch_size=3, ppo_epochs=2,
                          actor_learning_rate=1e-3)
        actor = Actor(CPU, cfg, start_dir="", tokenizer_dir="", total_updates=4, model=copy.deepcopy(policy),
                      tokenizer=tok)
        actor.update(batch, shuffle_seed=7, kl_coef=0.0)
        params.append(torch.cat([p.detach().flatten() for p in actor.model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in policy.parameters()])
    assert rel(params[1] - start, params[0] - start) < 1e-4


# ---------------------------------------------------------------- the engine

SHORT = ["-b", "ppo.total_steps = 3", "-b", "ppo.eval_every = 3", "-b", "ppo.save_every = 3",
         "-b", "task.eval_size = 32", "--quiet"]
BUDGET = ["-b", "ppo.max_tokens_per_micro_batch = 40"]  # the tiny recipe: 14 tokens at most a sequence
@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """The short run without a budget and with one, side by side: their run dirs."""
    padded, budget = tmp_path_factory.mktemp("padded"), tmp_path_factory.mktemp("budget")
    side_by_side(lambda: run_train([REPO / "recipes" / "tiny.gin", *SHORT, "--out", padded], cwd=padded),
                 lambda: run_train([REPO / "recipes" / "tiny.gin", *SHORT, *BUDGET, "--out", budget], cwd=budget))
    return padded, budget


@pytest.fixture(scope="module")
def padded_run(engine_runs):
    return engine_runs[0]


@pytest.fixture(scope="module")
def budget_run(engine_runs):
    return engine_runs[1]


def test_engine_with_a_budget_matches_the_engine_without(padded_run, budget_run):
    assert_same_metrics(read_metrics(padded_run / "metrics.jsonl"), read_metrics(budget_run / "metrics.jsonl"))
    assert "ppo.max_tokens_per_micro_batch = 40" in (budget_run / "config.gin").read_text()


def test_world_size_2_with_a_budget_equals_world_size_1(budget_run, tmp_path):
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        out = tmp_path / "ws2"
        run_train([REPO / "recipes" / "tiny.gin", *SHORT, *BUDGET, "-b", "ppo.world_size = 2",
                   "--ray-address", cluster.address, "--out", out], cwd=tmp_path)
    finally:
        cluster.shutdown()
    assert_same_metrics(read_metrics(budget_run / "metrics.jsonl"), read_metrics(out / "metrics.jsonl"))
    placed = json.loads((out / "provenance.json").read_text())["placement"]
    assert placed["world_size"] == 2

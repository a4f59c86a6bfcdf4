"""The GPU benchmarks' inputs and presets, checked on the CPU: the 7B shape's tensor-by-tensor
writer gives what `from_config` + `save_pretrained` give, the shapes have the published sizes,
the full-vocabulary tokenizer covers the 7B vocabulary, and every preset's bindings (GPU and
--tiny) and the peers' LoRA bindings validate against the engine's config."""

import json
import sys

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "peers"))

import gpu_assets  # noqa: E402


def small_7b_config():
    """The 7B architecture (untied embeddings, q/k/v bias, GQA) at a size the CPU builds in seconds."""
    from transformers import Qwen2Config
    shape = dict(gpu_assets.QWEN2_5_7B, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=256, vocab_size=1024)
    return Qwen2Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def test_shapes_have_the_published_sizes():
    assert gpu_assets.parameter_count(gpu_assets.model_config(shape="7b")) == 7_615_616_512
    assert gpu_assets.parameter_count(gpu_assets.model_config(shape="0.5b")) == 494_032_768
    c = gpu_assets.model_config(shape="7b")
    assert ((c.vocab_size, c.tie_word_embeddings, c.num_key_value_heads, c.intermediate_size)
            == (152064, False, 4, 18944))
    with pytest.raises(ValueError):
        gpu_assets.model_config(shape="70b")


def test_direct_writer_matches_from_config(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    config = small_7b_config()
    monkeypatch.setattr(gpu_assets, "SHARD_BYTES", 200_000)  # several shards and an index
    index = gpu_assets.write_random_model(config, tmp_path / "direct", seed=0, device="cpu")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ref.save_pretrained(str(tmp_path / "ref"))
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "direct" / name).read_text()) == json.loads((tmp_path / "ref" / name).read_text())
    shards = sorted(p.name for p in (tmp_path / "direct").glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert not (tmp_path / "direct.partial").exists()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "direct"), dtype=torch.bfloat16)
    got, want = model.state_dict(), ref.state_dict()
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert index["metadata"]["total_size"] == sum(2 * v.numel() for v in got.values())
    for k, v in got.items():
        v = v.float()
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
        elif k.endswith(".bias"):
            assert torch.equal(v, torch.zeros_like(v)), k
        else:
            assert abs(v.std().item() - config.initializer_range) < 0.002, k
    assert torch.equal(got["model.embed_tokens.weight"][0], torch.zeros_like(got["model.embed_tokens.weight"][0]))
    assert not torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])  # untied
    logits = model(torch.randint(0, config.vocab_size, (2, 8))).logits
    assert logits.shape == (2, 8, config.vocab_size) and torch.isfinite(logits).all()


def test_build_assets_reuses_only_the_same_shape(tmp_path):
    gpu_assets.build_assets(tmp_path, tiny=True)
    gpu_assets.build_assets(tmp_path, tiny=True)  # reused
    with pytest.raises(SystemExit, match="another shape"):
        gpu_assets.build_assets(tmp_path, shape="7b")


def test_full_vocabulary_tokenizer_covers_the_7b_vocabulary(tmp_path):
    import common
    tok = common.build_full_vocab_tokenizer(tmp_path, gpu_assets.model_config(shape="7b").vocab_size)
    assert len(tok) == 152064
    assert tok.decode([152063]) != "" and len(tok("abc", add_special_tokens=True)["input_ids"]) == 3


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("preset", ["lora7b", "long2k"])
def test_preset_bindings_validate(preset, tiny):
    import gpu_ppo

    from rlhf import configurable
    p = gpu_ppo.PRESETS[preset]
    assets = {"model_dir": "/nonexistent/model", "tokenizer_dir": "/nonexistent/tokenizer"}
    base = gpu_ppo.base_bindings(assets, "/nonexistent/prompts.jsonl") + p["bindings"]
    if tiny:
        base += gpu_ppo.TINY_BINDINGS + p["tiny_bindings"]
    for spec in gpu_ppo.preset_variant_specs(p, tiny):
        extra = [b.strip() for b in spec.partition("=")[2].split(";") if b.strip()]
        cfg, _ = configurable.resolve(None, base + extra + ["ppo.total_steps = 3"])
        if preset == "lora7b":
            assert cfg.ppo.lora_rank == (8 if tiny else 64) and cfg.ppo.gradient_checkpointing
            assert cfg.ppo.max_response_length == (8 if tiny else 512)
        else:
            assert cfg.ppo.max_response_length == (8 if tiny else 2048) and cfg.ppo.lora_rank == 0
        assert cfg.ppo.device == ("cpu" if tiny else "cuda")


def test_peer_lora_bindings_validate():
    import engine
    import trl_grpo

    from rlhf import configurable
    inputs = {"model_dir": "/nonexistent/model", "tokenizer_dir": "/nonexistent/tok", "prompts_jsonl": "/nonexistent/p"}
    b = engine.bindings(inputs, "grpo", "local", lora_rank=64)
    cfg, _ = configurable.resolve(None, b + ["ppo.total_steps = 3"])
    assert (cfg.ppo.lora_rank, cfg.ppo.lora_alpha, cfg.ppo.gradient_checkpointing, cfg.ppo.torch_compile) == \
        (64, 128.0, True, False)
    lora = trl_grpo.lora_config(type("A", (), {"lora_rank": 64, "lora_alpha": 0.0})())
    assert (lora.r, lora.lora_alpha, lora.target_modules, lora.lora_dropout) == (64, 128, "all-linear", 0.0)


def test_peer_work_on_the_shipped_lora_recipe():
    """`bench/peers/engine.py --recipe models/lora.gin`: TRL's GRPO work computed as the shipped 7B recipe
    computes (no checkpointing, packed budgets, compiled, vLLM asleep), and the plan fits it on an H200."""
    import engine

    from rlhf import configurable, memory
    inputs = {"model_dir": "/nonexistent/model", "tokenizer_dir": "/nonexistent/tok", "prompts_jsonl": "/nonexistent/p"}
    b = engine.bindings(inputs, "grpo", "local", lora_rank=64, recipe="models/lora.gin")
    cfg, _ = configurable.resolve(REPO / "recipes" / "models" / "lora.gin", b + ["ppo.total_steps = 3"])
    ppo = cfg.ppo
    assert (ppo.lora_rank, ppo.lora_alpha, ppo.gradient_checkpointing, ppo.torch_compile, ppo.vllm_sleep) == \
        (64, 128.0, False, True, True)
    assert ppo.max_tokens_per_micro_batch == 12288 and ppo.forward_max_tokens == 49152
    assert (ppo.adv_estimator, ppo.kl_mode, ppo.kl_coef, ppo.actor_learning_rate, ppo.max_response_length,
            ppo.rollout_batch_size) == ("grpo", "loss", 0.04, 1e-6, 256, 256)
    plan = memory.predict(cfg, memory.KNOWN_SHAPES["qwen2.5-7b"], available=int(139 * memory.GIB),
                          device_total=int(139 * memory.GIB))
    assert plan.fits


@pytest.mark.parametrize("algo, recipe, extra", [
    ("grpo", "models/lora.gin", ["--lora-rank", "16"]),          # the 7B GRPO row (bench/peers/run_h200.sh lora7b)
    ("ppo", "models/instruct.gin", []),                           # the 0.5B PPO row beside verl (run_h200.sh ppo)
])
def test_the_peers_engine_row_is_the_users_command(tmp_path, algo, recipe, extra):
    """`bench/peers/engine.py --recipe <a shipped model recipe>` on the CPU (tiny shape, HF rollouts): the work
    is a recipe file that includes the shipped recipe, run by `python -m rlhf.train`; a -b binding reaches the
    run, the JSON's iterations are the run's metrics.jsonl, and the median leaves out the warm-up."""
    import statistics
    import subprocess
    run = tmp_path / "runs" / algo
    args = [sys.executable, str(REPO / "bench" / "peers" / "engine.py"), "--tiny", "--algo", algo,
            "--recipe", recipe, *extra, "--assets", str(tmp_path / "assets"),
            "--json", str(tmp_path / "engine.json"), "--steps", "2", "--out", str(run), "-b", "ppo.seed = 3"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "engine.json").read_text())
    assert result["exit_code"] == 0 and not result["partial"]
    assert result["train_command"].startswith(f"python -m rlhf.train {algo}.gin --out {algo}")
    assert result["recipe_file"].startswith(f"include '{recipe}'\n")
    estimator = {"grpo": "'grpo'", "ppo": "'gae'"}[algo]
    assert f"ppo.adv_estimator = {estimator}" in result["recipe_file"]
    assert "ppo.total_steps = 3" in result["recipe_file"]
    assert (run.parent / f"{algo}.gin").read_text().replace(str((tmp_path / "assets").resolve()), "$ASSETS") == \
        result["recipe_file"]
    config = (run / "config.gin").read_text()
    assert "ppo.seed = 3" in config and f"ppo.adv_estimator = {estimator}" in config
    assert ("ppo.lora_rank = 16" in config) == (algo == "grpo")
    from rlhf.metrics import read_metrics
    steps = [r for r in read_metrics(run) if r["step"] > 0]
    assert [s["timing_s/step"] for s in result["steps"]] == [r["timing_s/step"] for r in steps]
    assert result["median_step_s"] == statistics.median(r["timing_s/step"] for r in steps[1:])
    assert "eval" not in result["median_phases_s"] and result["median_phases_s"]["update_actor"] > 0
    assert result["timed_steps"] == 2 and result["setup_s"] > 0
    from experiments.plan import code_version
    assert result["versions"]["engine_sha256"] == code_version()["engine_sha256"]  # the engine's files, not .git
    seen = [s["seen_at_s"] for s in result["steps"]]  # when each iteration landed, from the command's start
    # (both to 0.1 s: a tiny iteration shorter than that lands at its setup's figure)
    assert all(t is not None for t in seen) and seen == sorted(seen) and seen[0] >= result["setup_s"]
    if result["gpu_memory_used_peak_gb"] is None:  # no GPU to sample: no peak, so no time or processes for it
        assert result["gpu_memory_peak_at_s"] is None and result["gpu_memory_peak_processes"] == []
    # the run's recorded plan (a CPU run: no GPU figures, prompts measured in the data)
    assert result["gpu_total_gib"] is None and result["longest_prompt"] > 0
    assert result["memory_plan_verdict"].startswith("needs ")


def test_the_device_peak_names_its_processes():
    """What the peers' GPU sampler notes at a peak: nvidia-smi's compute apps as (pid, MiB), rows the
    driver leaves blank skipped, and each pid's command line where this process can read it."""
    import os

    import common
    assert common.parse_compute_apps("1234, 40960\n77, [N/A]\n\n5, 512\n") == [(1234, 40960.0), (5, 512.0)]
    assert common.parse_compute_apps("") == []
    me = common.process_name(os.getpid())
    assert me is not None and "python" in me.lower()
    assert common.process_name(2**22 + 7) is None  # above Linux's pid limit: no such process
    sampler = common.GPUMemorySampler()
    sampler.peak_mib, sampler.peak_at, sampler.peak_processes = 5.0, 1.0, [{"pid": 1}]
    sampler.reset()
    assert (sampler.peak_mib, sampler.peak_at, sampler.peak_processes) == (0.0, None, [])


def test_recipe_run_times_a_shipped_recipe_through_the_users_command(tmp_path):
    """bench/recipe_run.py on the CPU (the tiny shape, HF rollouts): the recipe file a user writes, run by
    `python -m rlhf.train`, resumed on a second call, summarised with the plan beside each phase; the
    profiled iteration (`--profile`) is in the JSON and not in the medians."""
    import subprocess
    script = REPO / "bench" / "recipe_run.py"
    args = [sys.executable, str(script), "--tiny", "--shape", "0.5b", "--assets", str(tmp_path / "assets"),
            "--out", str(tmp_path / "run"), "--json", str(tmp_path / "run.json"), "--steps", "3", "--prompts", "32",
            "--profile", "3",
            "-b", "ppo.device = 'cpu'", "-b", "ppo.rollout_backend = 'hf'", "-b", "ppo.max_response_length = 8",
            "-b", "task.eval_size = 8", "-b", "ppo.save_every = 1",
            # the tiny shape's key/value projections are 32 wide: the recipe's rank 64 is refused there
            "-b", "ppo.lora_rank = 16", "-b", "ppo.lora_alpha = 32.0"]
    first = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["steps_completed"] == 3 and result["exit_code"] == 0
    assert result["profile"]["step"] == 3 and result["profile"]["phases"]["update_actor"]["wall_s"] > 0
    # the median leaves out the first iteration and the profiled one
    assert result["iteration_s_median"] == round(result["steps"][1]["timing_s/step"], 3)
    assert result["steps"][2]["perf/profiled"] == 1.0
    assert "include 'models/lora.gin'" in result["recipe_file"] and "task.train_path" in result["recipe_file"]
    # the run's own resolved config: every setting as measured, no includes left to read from recipes/
    assert "include" not in result["config_gin"] and "ppo.lora_rank = 16" in result["config_gin"]
    import recipe_run
    unread = {**result, "recipe_file": "include 'models/not_shipped_any_more.gin'"}
    assert recipe_run.result_config(unread).ppo.lora_rank == 16 == recipe_run.result_config(result).ppo.lora_rank
    assert result["command"].startswith("python -m rlhf.train run.gin --out run")
    assert "--profile 3" in result["command"]
    assert set(result["phase_s_median"]) >= {"generate", "reference", "old_logprobs", "update_actor"}
    assert {"generate", "update_actor"} <= set(result["host_busy_median"]) <= set(result["phase_s_median"])
    assert all(0.0 <= v <= 1.0 for v in result["host_busy_median"].values())
    assert result["tokens_per_s"] > 0 and result["iteration_s_median"] > 0
    if result["gpu_memory_used_peak_gb"] is None:  # no GPU to sample: no device peak, no processes at it
        assert result["gpu_memory_peak_processes"] == []
    again = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert again.returncode == 0 and "--resume" in again.stdout  # a run dir with checkpoints is resumed


def test_recipe_run_replans_committed_measurements_with_this_code():
    import recipe_run
    result = json.loads((REPO / "bench" / "results" / "lora7b_recipe_h200.json").read_text())
    replanned = recipe_run.replan(result)
    assert {k: v["measured_gb"] for k, v in replanned["memory_by_phase"].items()} == \
        {k: v["measured_gb"] for k, v in result["memory_by_phase"].items()}
    assert replanned["memory_by_phase"]["update_actor"]["planned_gb"] > 0


def test_recipe_run_plans_the_trainers_share_when_vllm_has_its_own_process():
    """With ppo.vllm_own_process the engine's memory is another process's: the bench compares what torch
    measured in the trainer with the plan less the engine (vLLM's 0.3 of an 80 GB card, awake in every
    phase of this run), and the trainer's update phases land within the plan's 10%."""
    import recipe_run
    result = json.loads((REPO / "bench" / "results" / "instruct05b_recipe_mb12k_own_process_h100.json").read_text())
    own = recipe_run.replan(result)["memory_by_phase"]
    bindings = [b for b in result["bindings"] if "vllm_own_process" not in b]
    assert len(bindings) == len(result["bindings"]) - 1
    same = recipe_run.replan({**result, "bindings": bindings})["memory_by_phase"]
    engine = {name: same[name]["planned_gb"] - own[name]["planned_gb"]
              for name in ("generate", "update_actor", "update_critic")}
    assert all(23 < gib < 25 for gib in engine.values()), engine
    for name in ("update_actor", "update_critic", "reference", "values"):
        p = own[name]
        assert p["reserved_gb"] <= p["planned_reserved_gb"] <= 1.10 * p["reserved_gb"], (name, p)


def test_lora_layers_cuts_a_mini_batch_as_the_engine_does():
    """bench/lora_layers.py prices a token budget by the micro-batches the engine's packing cuts a
    mini-batch of 32 x 768-token sequences into: 8192 leaves a 2-sequence tail, 12288 none."""
    import lora_layers
    assert lora_layers.greedy_cuts(32, 8192) == [7680, 7680, 7680, 1536]
    assert lora_layers.greedy_cuts(32, 12288) == [12288, 12288]
    assert lora_layers.greedy_cuts(32, 768) == [768] * 32
    assert sum(lora_layers.greedy_cuts(32, 16384)) == 32 * 768
    assert lora_layers.token_counts("8192,1536") == [8192, 1536]
    for bad in ("abc", "8192,", "0", "-5"):
        with pytest.raises(SystemExit) as exit_:
            lora_layers.main(["--json", "x.json", "--update-tokens", bad])
        assert exit_.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU gets")
def test_cublas_workspace_bench_refuses_without_a_gpu_in_one_line():
    import subprocess
    out = subprocess.run([sys.executable, str(REPO / "bench" / "cublas_workspace.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "bench/cublas_workspace.py needs a CUDA GPU: none is visible here"]


@pytest.mark.parametrize("bad, named", [(["--threads", "-1"], "--threads -1"), (["--json", "."], "--json ."),
                                        (["--json", "no/such/dir/x.json"], "--json no/such/dir/x.json")])
def test_cublas_workspace_bench_refuses_bad_arguments_before_any_gpu_work(bad, named, capsys):
    import cublas_workspace
    with pytest.raises(SystemExit) as exit_:
        cublas_workspace.main(bad)
    assert exit_.value.code == 2 and f"error: {named} is invalid" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU gets")
def test_memory_snapshot_bench_refuses_without_a_gpu_in_one_line(tmp_path):
    import subprocess
    out = subprocess.run([sys.executable, str(REPO / "bench" / "memory_snapshot.py"), "--assets", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "bench/memory_snapshot.py needs a CUDA GPU: none is visible here"]
    assert not any(tmp_path.iterdir())  # nothing built before the refusal


@pytest.mark.parametrize("bad, named", [(["--steps", "0"], "--steps 0 is invalid"),
                                        (["--recipe", "models/none.gin"], "--recipe models/none.gin: no such recipe"),
                                        (["--json", "."], "--json . is invalid"),
                                        (["--prompts", "12"], "--prompts 12 is invalid"),
                                        (["--assets", str(REPO / "README.md")], "--assets "),
                                        ])
def test_memory_snapshot_bench_refuses_bad_arguments_before_any_gpu_work(bad, named, capsys):
    import memory_snapshot
    with pytest.raises(SystemExit) as exit_:
        memory_snapshot.main(["--assets", "/nonexistent"] + bad)
    assert exit_.value.code == 2 and f"error: {named}" in capsys.readouterr().err


@pytest.mark.parametrize("bad, named", [(["--recipe", "models/none.gin"], "--recipe models/none.gin: no such recipe"),
                                        (["--out", "README.md"], "--out README.md: a file"),
                                        (["--out", "bench"], "--out bench: not empty"),
                                        (["--assets", "README.md"], "--assets README.md: a file")])
def test_the_peers_engine_refuses_bad_arguments_before_building_inputs(bad, named, tmp_path, capsys, monkeypatch):
    import engine
    monkeypatch.chdir(REPO)
    args = ["--algo", "grpo", "--tiny", "--json", str(tmp_path / "x.json"), "--assets", str(tmp_path / "assets")]
    with pytest.raises(SystemExit) as exit_:
        engine.main(args + bad)
    assert exit_.value.code == 2 and f"error: {named}" in capsys.readouterr().err
    assert not (tmp_path / "assets").exists()  # nothing built


def test_the_peers_engine_refuses_a_bad_binding_in_one_line(tmp_path, capsys):
    import engine
    with pytest.raises(SystemExit) as exit_:
        engine.main(["--algo", "grpo", "--tiny", "--json", str(tmp_path / "x.json"), "--assets", str(tmp_path / "a"),
                     "-b", "ppo.seed = 'x'"])
    assert exit_.value.code == 2 and "error: -b: ppo.seed = 'x' is invalid" in capsys.readouterr().err


def test_memory_snapshot_groups_live_blocks_by_where_they_were_allocated():
    """The allocator's snapshot format (torch.cuda.memory._snapshot()): live blocks grouped by their
    innermost frame under rlhf/, free bytes per segment, the counters in MiB."""
    import memory_snapshot
    mib = 2 ** 20
    here = {"filename": "/x/rlhf/roles/actor.py", "line": 12, "name": "update"}
    torch_frame = {"filename": "/site/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
    snapshot = {"segments": [
        {"total_size": 100 * mib, "stream": 0, "segment_type": "large", "blocks": [
            {"size": 32 * mib, "state": "active_allocated", "frames": [torch_frame, here]},
            {"size": 32 * mib, "state": "active_allocated", "frames": [torch_frame, here]},
            {"size": 36 * mib, "state": "inactive"}]},
        {"total_size": 2 * mib, "stream": 7, "segment_type": "small", "blocks": [
            {"size": mib, "state": "active_allocated", "frames": [torch_frame]},
            {"size": mib, "state": "active_allocated"}]}]}
    stats = {"allocated_bytes.all.current": 66 * mib, "reserved_bytes.all.current": 102 * mib,
             "inactive_split_bytes.all.current": 36 * mib}
    out = memory_snapshot.summarize(snapshot, stats)
    assert (out["allocated_mib"], out["reserved_mib"], out["inactive_split_mib"], out["segments"]) == (66, 102, 36, 2)
    assert out["free_in_segments_mib"] == 36 and out["segments_most_free"][0]["free_mib"] == 36
    assert out["allocated_by_origin"] == [
        {"origin": "rlhf/roles/actor.py:12 update", "mib": 64.0, "sizes_mib": {"32.00": 2}},
        {"origin": "linear.py:125 forward", "mib": 1.0, "sizes_mib": {"1.00": 1}},
        {"origin": "not recorded", "mib": 1.0, "sizes_mib": {"1.00": 1}}]

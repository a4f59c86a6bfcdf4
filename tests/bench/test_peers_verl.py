"""The verl peer benchmark's command line, checked on the CPU (verl itself runs on the GPU
machine only): the GRPO + LoRA work is the TRL and engine rows' work in verl's own settings, the
PPO work keeps its critic, and the table puts a verl row beside TRL's and the engine's."""

import argparse
import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench" / "peers"))

import make_table  # noqa: E402
import verl_ppo  # noqa: E402

FILES = {k: f"/assets/verl/{k}" for k in ("train", "val", "reward", "ckpt", "log")}


def args(**kw):
    base = dict(algo="ppo", shape="0.5b", lora_rank=0, lora_alpha=0, lora_merge=False, gradient_checkpointing=False,
                trainer="v1")
    return argparse.Namespace(**{**base, **kw})


def parsed(a) -> dict:
    ovr = verl_ppo.overrides({"model_dir": "/assets/model"}, FILES, 3, a)
    keys = [o.split("=", 1)[0].lstrip("+") for o in ovr]
    assert len(keys) == len(set(keys)), "an override given twice (the last would win silently)"
    return dict(o.lstrip("+").split("=", 1) for o in ovr)


def test_grpo_lora_is_the_peers_work_in_verls_own_settings(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    a = args(algo="grpo", shape="7b", lora_rank=64, gradient_checkpointing=True)
    o = parsed(a)
    trl_work = {"prompts_per_step": 32, "num_generations": 8, "max_new_tokens": 256, "beta": 0.04, "micro_batch": 32}
    assert {k: verl_ppo.work(a)[k] for k in trl_work} == trl_work
    expect = {
        "algorithm.adv_estimator": "grpo", "data.train_batch_size": "32", "actor_rollout_ref.rollout.n": "8",
        "data.max_prompt_length": "256", "data.max_response_length": "256",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "32",  # prompts: x 8 = 256 sequences, one optimizer step
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "32",
        "actor_rollout_ref.actor.use_kl_loss": "True", "actor_rollout_ref.actor.kl_loss_coef": "0.04",
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl", "algorithm.use_kl_in_reward": "False",
        "actor_rollout_ref.model.lora_rank": "64", "actor_rollout_ref.model.lora_alpha": "128",
        "actor_rollout_ref.model.target_modules": "all-linear",
        "actor_rollout_ref.rollout.load_format": "safetensors",
        "actor_rollout_ref.model.enable_gradient_checkpointing": "True",
        "actor_rollout_ref.rollout.max_model_len": "512", "actor_rollout_ref.rollout.max_num_seqs": "256",
        "actor_rollout_ref.actor.optim.lr": "1e-06",
    }
    assert {k: o.get(k) for k in expect} == expect
    assert not any(k.startswith("critic.") for k in o)  # GRPO has no critic
    assert "actor_rollout_ref.model.lora.merge" not in o
    assert verl_ppo.variant(a) == "lora64_gc_v1" and o["trainer.experiment_name"] == "verl_grpo_7b_lora64"
    merged = args(algo="grpo", shape="7b", lora_rank=64, gradient_checkpointing=True, lora_merge=True)
    assert parsed(merged)["actor_rollout_ref.model.lora.merge"] == "True"
    assert verl_ppo.variant(merged) == "lora64_merged_gc_v1"
    assert make_table.setting({"work": verl_ppo.work(a)}) == ("7b", 64)  # the section of TRL's and the engine's rows


def test_ppo_keeps_its_critic_and_kl_in_the_reward(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site-verl:/tmp/site")
    a = args()
    o = parsed(a)
    assert o["algorithm.adv_estimator"] == "gae" and o["algorithm.use_kl_in_reward"] == "True"
    assert o["critic.model.path"] == "/assets/model" and o["data.train_batch_size"] == "256"
    assert o["actor_rollout_ref.actor.ppo_mini_batch_size"] == "64"
    assert not any("lora" in k for k in o)
    assert o["ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH"] == "'/tmp/site-verl:/tmp/site'"
    assert verl_ppo.variant(a) == "fsdp_vllm_v1" and make_table.setting({"work": verl_ppo.work(a)}) == ("0.5b", 0)
    assert any("critic loader" in h for h in verl_ppo.handicaps(a))
    assert not any("critic" in h for h in verl_ppo.handicaps(args(algo="grpo", lora_rank=64)))


def result(system, variant, step_s, **kw):
    work = {"shape": "7b", "lora_rank": 64}
    return {"system": system, "algorithm": "grpo", "variant": variant, "work": work, "median_step_s": step_s,
            "timed_steps": 2, "steps": [{}], "command": f"python {system}.py", **kw}


def test_table_puts_verl_beside_trl_and_the_engine(tmp_path):
    for r in (result("trl", "lora64_gc", 30.0), result("verl", "lora64_gc_v1", 45.0),
              result("engine", "local_lora64", 25.0)):
        (tmp_path / f"{r['system']}.json").write_text(json.dumps(r))
    out = tmp_path / "table.md"
    assert make_table.main([str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ") and " | " in line}
    assert "| 1 (reference) |" in rows["| TRL GRPOTrainer (lora64_gc)"]  # the GRPO work's peer is TRL
    assert "| 0.67 |" in rows["| verl main_ppo (lora64_gc_v1)"]
    assert "| **1.20x** |" in rows["| this engine (local_lora64)"]
    assert "1.20x TRL GRPOTrainer (lora64_gc); 1.80x verl main_ppo (lora64_gc_v1)" in text


def test_table_leaves_out_a_work_nobody_ran(tmp_path):
    """verl's PPO work beside the engine, no GRPO rows: the table has the PPO section only."""
    work = {"shape": "0.5b", "lora_rank": 0}
    for system, variant, step_s in (("verl", "fsdp_vllm_v1", 50.0), ("engine", "local", 5.0)):
        (tmp_path / f"{system}.json").write_text(json.dumps(
            {**result(system, variant, step_s), "algorithm": "ppo", "work": work}))
    out = tmp_path / "table.md"
    assert make_table.main([str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## PPO: verl's work" in text and "GRPO" not in text and "No results yet" not in text
    assert "| **10.00x** |" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_table.main([str(empty), "--out", str(out)]) == 0  # nothing run yet: every work, no rows
    assert out.read_text().count("No results yet.") == 2


def test_bad_lora_rank_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        verl_ppo.main(["--assets", str(tmp_path), "--json", str(tmp_path / "r.json"), "--lora-rank", "-1"])
    assert e.value.code == 2 and "--lora-rank" in capsys.readouterr().err


STUB = '''
import json, os, sys, time
time.sleep(1.5)  # start-up
with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
    for step in (1, 2, 3):
        t = 0.5 if step == 1 else 0.25
        time.sleep(t)
        data = {"timing_s/step": t, "timing_s/gen": t / 2, "timing_s/update_actor": t / 4,
                "perf/throughput": 1000.0 * step, "response_length/mean": 16.0, "perf/max_memory_allocated_gb": 1.5}
        f.write(json.dumps({"step": step, "data": data}) + "\\n")
        f.flush()
print("args:", len(sys.argv) - 1)
'''


def test_runner_reads_verls_file_logger(tmp_path, monkeypatch):
    """The plumbing around verl's process, with a stand-in `verl.trainer.main_ppo` that logs three
    steps the way verl's file logger does: medians over the steps after the warm-up, the phases,
    the start-up before the first step, and the exact command."""
    stub = tmp_path / "stub" / "verl" / "trainer"
    stub.mkdir(parents=True)
    for d in (stub.parent, stub):
        (d / "__init__.py").write_text("")
    (stub / "main_ppo.py").write_text(STUB)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stub"))
    out = tmp_path / "verl.json"
    rc = verl_ppo.main(["--assets", str(tmp_path / "assets"), "--json", str(out), "--tiny", "--steps", "2",
                        "--algo", "grpo", "--lora-rank", "8", "--gradient-checkpointing", "--timeout", "120"])
    r = json.loads(out.read_text())
    assert rc == 0 and r["returncode"] == 0 and not r.get("error") and r["partial"] is False
    assert r["all_step_s"] == [0.5, 0.25, 0.25] and r["median_step_s"] == 0.25 and r["timed_steps"] == 2
    assert r["median_phases_s"] == {"gen": 0.125, "step": 0.25, "update_actor": 0.0625}
    assert r["tokens_per_s"] == 2500.0 and r["generated_tokens_per_s"] == 32 * 8 * 16.0 / 0.125
    assert 1.0 < r["setup_s"] < 30  # the stand-in's 1.5 s sleep, seen within a second
    assert r["variant"] == "lora8_gc_v1" and "actor_rollout_ref.model.lora_rank=8" in r["verl_command"]
    assert "$ASSETS/model" in r["verl_command"] and str(tmp_path / "assets") not in r["verl_command"]

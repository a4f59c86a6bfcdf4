"""A LoRA run gives the same bytes as every other run: peft keeps `target_modules` as a set, whose
order follows the process's string hashing, so two runs of one config wrote different
adapter_config.json and manifest.json files until the list was sorted. And a LoRA start continues
its adapter only at the rank and lora_alpha it was trained with."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import run_train

LORA = ["-b", "ppo.lora_rank = 8", "-b", "ppo.total_steps = 2", "-b", "ppo.eval_every = 2", "-b", "ppo.save_every = 2",
        "-b", "task.eval_size = 16", "--quiet"]
FILES = ("actor/adapter_config.json", "critic/adapter_config.json", "actor/adapter_model.safetensors",
         "critic/adapter_model.safetensors", "manifest.json")


def test_two_lora_runs_write_the_same_bytes_and_an_adapter_restarts_at_its_own_alpha(tmp_path):
    def run(hash_seed):
        out = tmp_path / f"run{hash_seed}"
        run_train(["recipes/tiny.gin", *LORA, "-b", "ppo.lora_target_modules = ['v_proj', 'q_proj', 'o_proj']",
                   "--out", out], env=dict(os.environ, PYTHONHASHSEED=hash_seed))
        return out / "checkpoints" / "step_2"

    with ThreadPoolExecutor(max_workers=2) as pool:  # two processes whose set orders differ, side by side
        runs = list(pool.map(run, ("1", "2")))
    for name in FILES:
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name
    config = json.loads((runs[0] / "actor" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["o_proj", "q_proj", "v_proj"] and config["lora_alpha"] == 16

    # Another lora_alpha would rescale the saved update: refused, naming the binding and the saved value.
    proc = run_train(["recipes/tiny.gin", *LORA, "-b", "ppo.lora_target_modules = ['v_proj', 'q_proj', 'o_proj']",
                      "-b", "ppo.lora_alpha = 32.0", "-b", f"ppo.init_from = '{runs[0]}'", "--out", tmp_path / "bad"],
                     check=False)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "ppo.lora_alpha = 32 is invalid" in lines[0] and "set ppo.lora_alpha = 16" in lines[0], lines[0]

"""A model and data given by path take the same code path as the default: a locally saved Qwen2
checkpoint, prompts from JSONL and parquet, the GSM8K-style reward."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf.metrics import read_metrics
from rlhf.rewards import REWARD_FUNCTIONS, extract_gsm8k_answer
from rlhf.tiny import build_char_tokenizer
from tests.conftest import REPO, run_train


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    tok = build_char_tokenizer(root / "tokenizer")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(root / "model")
    rows = [{"question": f"Q: {a} plus {b}?", "solution": f"{a}+{b}={a + b} #### {a + b}"}
            for a in range(12) for b in range(12)]
    with open(root / "train.jsonl", "w") as f:
        for r in rows[:120]:
            f.write(json.dumps(r) + "\n")
    pq.write_table(pa.Table.from_pylist(rows[120:]), root / "eval.parquet")
    return root


def test_local_checkpoint_with_file_prompts_runs(local_model, tmp_path):
    root = local_model
    bindings = ["-b", f"model.name_or_path = '{root / 'model'}'",
                "-b", f"model.tokenizer_path = '{root / 'tokenizer'}'", "-b", "task.name = 'file'",
                "-b", f"task.train_path = '{root / 'train.jsonl'}'",
                "-b", f"task.eval_path = '{root / 'eval.parquet'}'",
                "-b", "task.prompt_key = 'question'", "-b", "task.answer_key = 'solution'",
                "-b", "task.reward_fn = 'gsm8k'", "-b", "ppo.max_prompt_length = 24",
                "-b", "ppo.max_response_length = 12", "-b", "task.eval_size = 16"]
    run_train(["recipes/tiny.gin", *bindings, "-b", "ppo.total_steps = 2", "--quiet", "--out", tmp_path])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[-1]["step"] == 2 and records[-1]["response_length_mean"] > 0
    assert (tmp_path / "checkpoints" / "step_2" / "actor" / "config.json").read_text().count("qwen2") >= 1
    # The memory plan's sequences: the data's longest prompt ("Q: 11 plus 11?"), measured at the run's
    # start and recorded; `python -m rlhf.memory` measures the same data the same way.
    planned = json.loads((tmp_path / "provenance.json").read_text())["placement"]["memory_predicted"]["settings"]
    assert 14 <= planned["prompt_tokens"] < 24
    plan = subprocess.run([sys.executable, "-m", "rlhf.memory", "recipes/tiny.gin", *bindings],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert f"prompts: measured in the task's data, the longest {planned['prompt_tokens']} tokens" in plan.stdout
    assert f"prompt {planned['prompt_tokens']} (the longest; ppo.max_prompt_length 24) + response 12" in plan.stdout


def test_missing_prompt_key_is_a_clear_error(local_model, tmp_path):
    proc = run_train(["recipes/tiny.gin", "-b", f"model.name_or_path = '{local_model / 'model'}'",
                      "-b", f"model.tokenizer_path = '{local_model / 'tokenizer'}'", "-b", "task.name = 'file'",
                      "-b", f"task.train_path = '{local_model / 'train.jsonl'}'", "-b", "task.reward_fn = 'gsm8k'",
                      "--out", tmp_path], check=False)
    assert proc.returncode == 2 and "task.prompt_key='prompt'" in proc.stderr


@pytest.mark.parametrize("text, expected", [
    ("so 3+4=7 #### 7", "7"), ("#### 1,234", "1234"), ("the answer is 12.0", "12"), ("no number", None),
    ("#### -5", "-5"), ("first 3 then 9", "9")])
def test_gsm8k_extractor(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_reward_registry_scores():
    arith = REWARD_FUNCTIONS["arithmetic"]
    assert arith("12", "12", True).reward == pytest.approx(1.1)
    assert arith("13", "12", True).reward == pytest.approx(0.1)
    assert arith("12", "12", False).reward == pytest.approx(-0.5)  # cut without EOS: not well formed
    assert REWARD_FUNCTIONS["gsm8k"]("... #### 42", "#### 42", True).correct
    assert not REWARD_FUNCTIONS["exact_match"]("a", "b", True).correct

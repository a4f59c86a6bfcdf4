"""The engine with real RLHF inputs: PPO against a learned reward model on the embedded default
(its score rises; gold accuracy is logged beside it; the running normalisation is checkpointed),
and verl-format chat prompts through a chat template, end to end."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.metrics import read_metrics
from tests.conftest import REPO, run_train
from tests.rlhf.test_reward_model import rm_data, train_rm  # noqa: F401

RECIPE = str(REPO / "recipes" / "tiny.gin")


@pytest.fixture(scope="module")
def tiny_rm(rm_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    train_rm(rm_data, out)
    return out


def test_ppo_against_the_learned_reward_model_raises_its_score(tiny_rm, tmp_path):
    out = tmp_path / "run"
    proc = run_train([RECIPE, "--out", out, "--quiet", "-b", "reward.kind = 'model'",
                      "-b", f"reward.model_path = '{tiny_rm}'", "-b", "reward.normalize = 'running'",
                      "-b", "ppo.total_steps = 30", "-b", "ppo.eval_every = 15", "-b", "ppo.save_every = 15"])
    assert "each conversation is encoded as in reward-model training" in proc.stderr
    rows = read_metrics(out / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    # Measured: eval/rm_score 0.50 -> 1.38 after 25 steps with the shipped recipe's reward model.
    assert last["eval/rm_score"] > first["eval/rm_score"] + 0.2, (first, last)
    for r in (first, last):  # gold accuracy beside the model's score
        assert 0.0 <= r["eval/accuracy"] <= 1.0 and "eval/greedy_rm_score" in r
    steps = [r for r in rows if r["step"] > 0]
    assert all("rollout/rm_score_mean" in r and "timing_s/reward_model" in r and "accuracy" in r for r in steps)
    state = json.loads((out / "checkpoints" / "step_30" / "state.json").read_text())
    assert state["trainer"]["reward"]["running"]["count"] == 30 * 64


def test_verl_chat_prompts_through_a_chat_template_end_to_end(tmp_path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlhf.tiny import build_char_tokenizer
    tok = build_char_tokenizer(tmp_path / "tok")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}a:{% endif %}")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{a} plus {b}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"index": i}} for i, (a, b) in enumerate((a, b) for a in range(10) for b in range(10))]
    pq.write_table(pa.Table.from_pylist(rows[:80]), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[80:]), tmp_path / "test.parquet")
    out = tmp_path / "run"
    proc = run_train([RECIPE, "--out", out, "--quiet", "-b", f"model.name_or_path = '{tmp_path / 'model'}'",
                      "-b", f"model.tokenizer_path = '{tmp_path / 'tok'}'", "-b", "task.name = 'file'",
                      "-b", f"task.train_path = '{tmp_path / 'train.parquet'}'",
                      "-b", f"task.eval_path = '{tmp_path / 'test.parquet'}'", "-b", "task.reward_fn = 'gsm8k'",
                      "-b", f"task.chat_template = '{template}'", "-b", "task.system_prompt = 'Add.'",
                      "-b", "ppo.max_prompt_length = 40", "-b", "ppo.total_steps = 2", "-b", "ppo.eval_every = 2",
                      "-b", "ppo.save_every = 2", "-b", "task.eval_size = 20"])
    assert f"prompts use '{template}' chat template" in proc.stderr
    assert len(read_metrics(out / "metrics.jsonl")) == 3
    # What the rollout encodes is exactly apply_chat_template's ids.
    from rlhf.chat import PromptRenderer
    from rlhf.rollout import encode_prompts
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    renderer = PromptRenderer(tok, str(template), system_prompt="Add.")
    msgs = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3 plus 4?"}]
    want = tok.apply_chat_template(msgs, chat_template=template.read_text(), add_generation_prompt=True)["input_ids"]
    ids, mask = encode_prompts(tok, [renderer.ids(rows[34]["prompt"])], 40)
    assert ids[0][mask[0].bool()].tolist() == list(want)


def test_resume_with_running_normalisation_equals_uninterrupted(tiny_rm, tmp_path):
    from rlhf import checkpoint, configurable
    from rlhf.metrics import JsonlSink, MetricLogger
    from rlhf.trainer import PPOTrainer

    cfg, _ = configurable.resolve(RECIPE, ["reward.kind = 'model'", f"reward.model_path = '{tiny_rm}'",
                                           "reward.normalize = 'running'", "ppo.total_steps = 6",
                                           "ppo.eval_every = 3", "ppo.save_every = 2", "task.eval_size = 32"])
    quiet = dict(log=lambda m: None)
    for name in ("whole", "cut"):
        (tmp_path / name).mkdir()
    whole = PPOTrainer(cfg, tmp_path / "whole", **quiet)
    whole.run(MetricLogger([JsonlSink(tmp_path / "whole" / "metrics.jsonl")]))

    class StopAt:  # the run is interrupted as it logs step 5 (its last checkpoint: step 4)
        def write(self, record):
            if record["step"] == 5:
                raise KeyboardInterrupt

        def close(self):
            pass
    cut = PPOTrainer(cfg, tmp_path / "cut", **quiet)
    with pytest.raises(KeyboardInterrupt):
        cut.run(MetricLogger([StopAt(), JsonlSink(tmp_path / "cut" / "metrics.jsonl")]))
    ckpt = checkpoint.latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert ckpt.name == "step_4"
    resumed = PPOTrainer(cfg, tmp_path / "cut", **quiet)
    resumed.run(MetricLogger([JsonlSink(tmp_path / "cut" / "metrics.jsonl", truncate_after_step=4)]), resume_from=ckpt)
    assert resumed.reward.state_dict() == whole.reward.state_dict()

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows]
    assert comparable(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == \
        comparable(read_metrics(tmp_path / "whole" / "metrics.jsonl"))


def test_real_model_recipes_need_only_the_two_paths(tmp_path):
    """recipes/gsm8k.gin (instruct model + reward model + verl GSM8K): unset, each path is a one-line
    error naming it; with the two paths set (local checkpoints here, on the CPU) it builds."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from rlhf import configurable
    from rlhf.errors import ConfigError
    from rlhf.tiny import build_char_tokenizer
    tok = build_char_tokenizer(tmp_path / "policy")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, num_labels=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "policy")
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    recipe = REPO / "recipes" / "gsm8k.gin"
    cpu = ["ppo.device = 'cpu'", "ppo.dtype = 'float32'", "ppo.rollout_backend = 'hf'"]
    with pytest.raises(ConfigError, match="model.name_or_path, reward.model_path are required") as e:
        configurable.resolve(recipe, cpu)
    assert "\n" not in str(e.value)
    cfg, _ = configurable.resolve(recipe, cpu + [f"model.name_or_path = '{tmp_path / 'policy'}'",
                                                 f"reward.model_path = '{tmp_path / 'rm'}'"])
    assert (cfg.task.format, cfg.task.reward_fn, cfg.reward.kind) == ("verl", "gsm8k", "model")
    assert cfg.task.chat_template == "auto" and cfg.reward.normalize == "running"

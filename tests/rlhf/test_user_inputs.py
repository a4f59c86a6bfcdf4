"""What users feed the engine, checked where it enters: a reward model scores exactly the ids it
was trained on (shared Qwen-style template, its own tokenizer, the demo's raw text), prompts that
do not fit are refused or cut and counted, rows are scored by their data_source, and bad rows or
bindings are one line before any compute."""

import json
import re

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlhf import configurable
from rlhf.batch import Batch
from rlhf.chat import PromptRenderer, check_rows
from rlhf.config import PPOConfig, RewardConfig, TaskConfig
from rlhf.data import Example, check_prompt_lengths, load_task
from rlhf.errors import ConfigError
from rlhf.reward_model.bradley_terry import RewardModelTrainer
from rlhf.reward_model.config import RMTrainConfig
from rlhf.reward_model.score import RewardModelScorer, encode_conversation
from rlhf.rewards import RewardCombiner
from rlhf.rollout import decode_responses, encode_prompts
from rlhf.tiny import CHARACTERS, build_char_tokenizer
from tests.conftest import REPO, run_train
from tests.rlhf.test_chat_data import _write_parquet, random_policy  # noqa: F401
from tests.rlhf.test_faults import one_error_line
from tests.rlhf.test_reward_model import other_tokenizer, save_rm

RECIPE = str(REPO / "recipes" / "tiny.gin")

# Qwen2.5's chat template without tools: a default system turn, '<|im_end|>\n' closing every turn.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>'"
    " + '\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def qwen_style_tokenizer(path):
    """A character tokenizer with Qwen's special tokens and template: EOS '<|im_end|>', pad '<|endoftext|>'."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(special + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|\w+\|>|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  additional_special_tokens=special[1:])
    tok.chat_template = QWEN_TEMPLATE
    tok.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def rollout_batch(tok, prompts, responses, max_prompt_length=64):
    """A rollout batch as the trainer builds it: the policy's prompt ids (left-padded, cut to
    max_prompt_length) and generated response ids (`responses`: ids, EOS-ended when finished)."""
    renderer = PromptRenderer(tok, "auto")
    prompt_ids, prompt_mask = encode_prompts(tok, [renderer.ids(p) for p in prompts], max_prompt_length)
    width = max(map(len, responses)) + 2
    ids = torch.full((len(responses), width), tok.pad_token_id)
    mask = torch.zeros((len(responses), width), dtype=torch.long)
    for i, r in enumerate(responses):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    finished = torch.tensor([r[-1] == tok.eos_token_id for r in responses])
    batch = Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": ids, "response_mask": mask,
                   "finished": finished})
    batch["prompts"] = prompts
    batch["responses"] = decode_responses(tok, batch)
    return batch


def policy_ids(batch):
    """The policy's own ids per row (prompt then response, padding removed)."""
    return [p[pm.bool()].tolist() + r[rm.bool()].tolist() for p, pm, r, rm in
            zip(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])]


def training_encoding(tmp_path, rm_dir, prompts, texts):
    """Reward-model training (RewardModelTrainer) on pairs of these (prompt, response text): its
    encoded chosen sequences, in order, and the trainer."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": t, "rejected": t + "0"}) + "\n"
                             for p, t in zip(prompts, texts)))
    cfg = RMTrainConfig(train_path=str(pairs), eval_path=str(pairs), base_model=str(rm_dir), device="cpu",
                        steps=1, batch_size=1, micro_batch_size=1)
    trainer = RewardModelTrainer(cfg, tmp_path / "rm_out", log=lambda m: None)
    return [chosen for chosen, _, _ in trainer.train], trainer


PROMPTS = ["3+4=", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12-15="}], "7+8="]


@pytest.mark.parametrize("case", ["shared_qwen_template", "own_tokenizer", "raw_text"])
def test_reward_model_scores_what_it_was_trained_on(tmp_path, case):
    if case == "shared_qwen_template":
        tok = rm_tok = qwen_style_tokenizer(tmp_path / "tok")
    else:
        tok = build_char_tokenizer(tmp_path / "tok")
        rm_tok = other_tokenizer(tmp_path / "rm_tok") if case == "own_tokenizer" else tok
    save_rm(tmp_path / "rm", rm_tok, seed=3)

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    responses = [enc("7") + [eos], enc("-3") + [eos], enc("15 and")]  # the last one is cut off (no EOS)
    if case == "raw_text":  # special tokens the policy may sample mid-response are read back as they were
        responses[1] = enc("-") + [tok.bos_token_id, tok.pad_token_id, tok.unk_token_id] + enc("3") + [eos]
    batch = rollout_batch(tok, PROMPTS, responses)
    scorer = RewardModelScorer(str(tmp_path / "rm"), policy_tokenizer=tok, log=lambda m: None)
    scored = scorer.sequences(batch)

    texts = [tok.decode(r[:-1] if r[-1] == eos else r, skip_special_tokens=False) for r in responses]
    trained, trainer = training_encoding(tmp_path, tmp_path / "rm", PROMPTS, texts)
    if case == "raw_text":
        # The demo's encoding, unchanged: raw prompt + response tokens + EOS when finished, i.e. the
        # policy's own ids; training encodes a pair the same way (finished: training pairs end with EOS).
        assert scored == policy_ids(batch)
        assert scored[:2] == trained[:2]
        assert scored[2] == encode_conversation(trainer.renderer, PROMPTS[2], texts[2], finished=False)
    else:
        assert scored == trained  # finished or cut off: the whole conversation through the template
        if case == "shared_qwen_template":
            assert all(s != p for s, p in zip(scored, policy_ids(batch)))  # the policy's ids end at '<|im_end|>'
            assert tok.decode(scored[2]).endswith("<|im_start|>assistant\n15 and<|im_end|>\n")
        with torch.no_grad():
            trainer.model.eval()
            torch.testing.assert_close(scorer.score_batch(batch), trainer._scores(trained), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chat_template", ["none", "file"])
def test_a_trained_reward_model_carries_its_template_to_ppo(tmp_path, chat_template):
    """rm.chat_template travels with the checkpoint: PPO's default reward.chat_template = 'auto'
    then encodes a rollout as training encoded its pairs."""
    tok = qwen_style_tokenizer(tmp_path / "tok")
    save_rm(tmp_path / "base", tok)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "3+4=", "chosen": "7", "rejected": "8"}) + "\n")
    cfg = RMTrainConfig(train_path=str(pairs), eval_path=str(pairs), base_model=str(tmp_path / "base"), device="cpu",
                        steps=1, batch_size=1, micro_batch_size=1,
                        chat_template=str(template) if chat_template == "file" else "none")
    trainer = RewardModelTrainer(cfg, tmp_path / "out", log=lambda m: None)
    trainer.save_model(tmp_path / "out")
    scorer = RewardModelScorer(str(tmp_path / "out"), policy_tokenizer=tok, log=lambda m: None)
    batch = rollout_batch(tok, ["3+4="], [tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
    assert scorer.renderer.uses_template == (chat_template == "file")
    assert scorer.sequences(batch) == [trainer.train[0][0]]


def test_reward_model_reads_a_cut_prompt_whole(tmp_path):
    tok = build_char_tokenizer(tmp_path / "tok")
    save_rm(tmp_path / "rm", tok)
    batch = rollout_batch(tok, ["123456789+1="], [tok("9", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]],
                          max_prompt_length=4)
    assert batch["prompt_mask"].sum() == 4
    scorer = RewardModelScorer(str(tmp_path / "rm"), policy_tokenizer=tok, log=lambda m: None)
    assert tok.decode(scorer.sequences(batch)[0]) == "123456789+1=9<eos>"


# ----------------------------------------------------------------------------- prompt length
def _rows_file(path, prompts, answer="1"):
    path.write_text("".join(json.dumps({"prompt": p, "answer": answer}) + "\n" for p in prompts))
    return path


def _trainer(policy, bindings):
    from rlhf.trainer import PPOTrainer
    cfg, _ = configurable.resolve(RECIPE, [f"model.name_or_path = '{policy / 'model'}'",
                                           f"model.tokenizer_path = '{policy / 'tok'}'", "task.name = 'file'",
                                           *bindings])
    return PPOTrainer(cfg, policy / "unused", log=lambda m: None)


def test_prompt_longer_than_max_prompt_length_is_one_line_before_compute(tmp_path, random_policy):  # noqa: F811
    data = _rows_file(tmp_path / "long.jsonl", [f"{i}+1=" for i in range(30)] + ["1234567890+1="])
    with pytest.raises(ConfigError) as e:
        _trainer(random_policy, [f"task.train_path = '{data}'", "task.eval_fraction = 0.5"])
    msg = str(e.value)
    assert "\n" not in msg and "long.jsonl row 30" in msg and "is 13 tokens, over ppo.max_prompt_length = 8" in msg
    assert "ppo.prompt_truncation = 'left'" in msg
    with pytest.raises(ConfigError, match="ppo.prompt_truncation = 'middle' is invalid: must be one of 'error'"):
        PPOConfig(prompt_truncation="middle")
    # The embedded task's prompts fit its recipe (the default 'error' never stops the demo).
    from rlhf.data import arithmetic_examples
    renderer = PromptRenderer(AutoTokenizer.from_pretrained(str(random_policy / "tok")), "auto")
    assert max(check_rows(arithmetic_examples(20), renderer.ids, "task.chat_template")) <= 8


def test_cut_prompts_are_counted_where_cutting_is_allowed(tmp_path, random_policy):  # noqa: F811
    examples = [Example("1+1=", "2", where="f row 0"), Example("123456+1=", "3", where="f row 1")]
    logged = []
    fractions = check_prompt_lengths({"train": (examples, [4, 9]), "eval": (examples[:1], [4])}, 8, "left",
                                     logged.append)
    assert fractions == {"train": 0.5, "eval": 0.0}
    assert logged == ["ppo.prompt_truncation = 'left': 1 of 3 prompts (1 train, 0 eval) are longer than "
                      "ppo.max_prompt_length = 8 and lose their first tokens (the longest: 9 tokens, f row 1)"]
    tok = build_char_tokenizer(tmp_path / "tok")
    ids = tok("123456+1=")["input_ids"]
    assert encode_prompts(tok, [ids], 4, "right")[0][0].tolist() == ids[:4]
    assert encode_prompts(tok, [ids], 4)[0][0].tolist() == ids[-4:]
    # A run that cuts: the notice, the per-step fraction and summary.json's line.
    data = _rows_file(tmp_path / "d.jsonl", [f"{i}+1=" for i in range(20)] + [f"12345{i}+1=" for i in range(20)])
    out = tmp_path / "run"
    proc = run_train([RECIPE, "--out", out, "--quiet", "-b", f"model.name_or_path = '{random_policy / 'model'}'",
                      "-b", f"model.tokenizer_path = '{random_policy / 'tok'}'", "-b", "task.name = 'file'",
                      "-b", f"task.train_path = '{data}'", "-b", "ppo.prompt_truncation = 'left'",
                      "-b", "ppo.total_steps = 1", "-b", "ppo.rollout_micro_batch_size = 8",
                      "-b", "ppo.mini_batch_size = 16", "-b", "ppo.micro_batch_size = 16", "-b", "task.eval_size = 8"])
    assert "are longer than ppo.max_prompt_length = 8 and lose their first tokens" in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < rows[1]["rollout/prompt_truncated_fraction"] < 1
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["prompt_truncated_fraction"]) == {"train", "eval"}
    assert 0 < summary["prompt_truncated_fraction"]["train"] < 1


# ----------------------------------------------------------------------------- data_source routing
TWO_SOURCES = [
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2+3?"}],
     "reward_model": {"style": "rule", "ground_truth": "5"}},
    {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "2+3="}],
     "reward_model": {"style": "rule", "ground_truth": "5"}},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_rows_are_scored_by_their_data_source(tmp_path, suffix):
    path = tmp_path / f"two{suffix}"
    rows = TWO_SOURCES * 5
    if suffix == ".parquet":
        _write_parquet(path, rows)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held = load_task(TaskConfig(name="file", train_path=str(path), eval_path=str(path), reward_fn="auto"))
    sources = [ex.data_source for ex in train[:2]]
    assert sources == ["openai/gsm8k", "arithmetic"]
    # '#### 5' is right for gsm8k, not for arithmetic (one integer); '5' is right for both.
    responses, answers, finished = ["#### 5", "#### 5", "5", "5"], ["5"] * 4, [True] * 4
    for reward_fn in ("auto", {"openai/gsm8k": "gsm8k", "arithmetic": "arithmetic"}):
        out = RewardCombiner(TaskConfig(reward_fn=reward_fn), RewardConfig()).combine(
            responses, answers, finished, data_sources=sources * 2)
        assert out["correct"].tolist() == [True, False, True, True]
    mapped = RewardCombiner(TaskConfig(reward_fn={"openai/gsm8k": "exact_match", "arithmetic": "gsm8k"}),
                            RewardConfig()).combine(responses, answers, finished, data_sources=sources * 2)
    assert mapped["correct"].tolist() == [False, True, True, True]
    # One named reward scores every row, as always (the data_source is not read).
    one = RewardCombiner(TaskConfig(reward_fn="gsm8k"), RewardConfig()).combine(
        responses, answers, finished, data_sources=sources * 2)
    assert one["correct"].tolist() == [True, True, True, True]


def test_a_source_without_scorer_is_one_line_at_load(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = TWO_SOURCES + [{**TWO_SOURCES[0], "data_source": "lighteval/MATH"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as e:
        load_task(TaskConfig(name="file", train_path=str(path), reward_fn="auto"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path} row 2: data_source 'lighteval/MATH' has no scorer")
    assert "'arithmetic', 'exact_match', 'gsm8k'" in msg and "'openai/gsm8k' (gsm8k)" in msg
    with pytest.raises(ConfigError, match=r"row 1: data_source 'arithmetic' has no scorer .* the mapping's sources "
                                          r"'openai/gsm8k'"):
        load_task(TaskConfig(name="file", train_path=str(path), reward_fn={"openai/gsm8k": "gsm8k"}))
    plain = _rows_file(tmp_path / "plain.jsonl", ["1+1="] * 5, answer="2")
    assert len(sum(load_task(TaskConfig(name="file", train_path=str(plain), reward_fn="gsm8k")), [])) == 5
    with pytest.raises(ConfigError, match="plain.jsonl row 0: the row has no data_source to pick its scorer "
                                          "under task.reward_fn = 'auto'"):
        load_task(TaskConfig(name="file", train_path=str(plain), reward_fn="auto"))
    cfg, operative = configurable.resolve(RECIPE, ["task.reward_fn = {'openai/gsm8k': 'gsm8k'}"])
    assert cfg.task.reward_fn == {"openai/gsm8k": "gsm8k"} and "task.reward_fn = {'openai/gsm8k': 'gsm8k'}" in operative
    with pytest.raises(ConfigError, match=r"task.reward_fn = \{'a': 'nope'\} is invalid: a mapping takes each"):
        TaskConfig(reward_fn={"a": "nope"})


# ----------------------------------------------------------------------------- rows and bindings
@pytest.mark.parametrize("row, message", [
    ({"prompt": [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "image_url",
                                                                                  "image_url": {"url": "x"}}]}],
      "answer": "2"}, "row 1: message 0: content part 1 is of type 'image_url'; only text parts"),
    ({"prompt": "1+1=", "answer": None}, "row 1: task.answer_key='answer' is null"),
    ({"prompt": "  ", "answer": "2"}, "row 1: the prompt is empty"),
    ({"prompt": [{"role": "user", "content": ""}], "answer": "2"}, "row 1: every message of the prompt is empty"),
])
def test_bad_rows_are_one_line_naming_the_row(tmp_path, row, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as e:
        load_task(TaskConfig(name="file", train_path=str(path)))
    assert str(e.value).startswith(f"{path} ") and message in str(e.value) and "\n" not in str(e.value)


def test_text_content_parts_are_joined(tmp_path):
    path = tmp_path / "parts.parquet"
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+3?"}]
    _write_parquet(path, [{"prompt": [{"role": "user", "content": parts}], "answer": "5"}] * 3)
    train, held = load_task(TaskConfig(name="file", train_path=str(path)))
    assert (train + held)[0].prompt == [{"role": "user", "content": "What is\n2+3?"}]


@pytest.mark.parametrize("bindings, message", [
    (["task.train_path = 'data.jsonl'"], "task.train_path = 'data.jsonl' is invalid: is set but task.name = "
                                         "'arithmetic' trains on the embedded task and ignores it; "
                                         "set task.name = 'file'"),
    (["reward.model_path = 'models/rm'"], "reward.model_path = 'models/rm' is invalid: is set but reward.kind = "
                                          "'rule' trains on task.reward_fn and ignores it; set reward.kind = 'model'"),
    (["reward.normalize = 'batch'"], "reward.normalize = 'batch' is invalid: is set but reward.kind = 'rule' trains "
                                     "on task.reward_fn and ignores it; set reward.kind = 'model'"),
    (["reward.clip = 5.0"], "reward.clip = 5.0 is invalid: is set but reward.kind = 'rule'"),
    (["ppo.lora_alpha = 32.0"], "ppo.lora_alpha = 32.0 is invalid: is set but no model has LoRA adapters "
                                "(ppo.lora_rank = 0); set ppo.lora_rank > 0"),
    (["ppo.lora_target_modules = ['q_proj']"], "ppo.lora_target_modules = ['q_proj'] is invalid: is set but no "
                                               "model has LoRA adapters"),
    (["ppo.adv_estimator = 'grpo'", "ppo.samples_per_prompt = 4", "ppo.lora_rank = 4", "ppo.critic_lora_rank = 4"],
     "ppo.critic_lora_rank = 4 is invalid: is set but ppo.adv_estimator = 'grpo' has no critic"),
])
def test_ignored_bindings_are_one_line_exit_2(tmp_path, bindings, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        configurable.resolve(RECIPE, bindings)
    line = one_error_line(run_train([RECIPE, "--out", tmp_path / "run", *[a for b in bindings for a in ("-b", b)]],
                                    check=False))
    assert message in line


# A template that refuses roles it does not know, as many real ones do (raise_exception).
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                   "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
                   "{{ m['role'][0] }}:{{ m['content'] }}\n"
                   "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")


def test_rows_a_template_or_raw_text_rejects_are_one_line_before_compute(tmp_path, random_policy):  # noqa: F811
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT_TEMPLATE)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(20)]
    rows[7] = {"prompt": [{"role": "tool", "content": "7+1="}], "answer": "8"}
    path = tmp_path / "roles.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [f"task.train_path = '{path}'", "task.eval_path = ''", "ppo.max_prompt_length = 16"]
    with pytest.raises(ConfigError) as e:
        _trainer(random_policy, base + [f"task.chat_template = '{template}'"])
    assert str(e.value) == (f"{path} row 7: the chat template (task.chat_template) rejects this row "
                            f"(TemplateError: Unknown role: tool)")
    with pytest.raises(ConfigError) as e:  # raw text (the tokenizer has no template): the role would vanish
        _trainer(random_policy, base)
    assert str(e.value).startswith(f"{path} row 7: message 0 has role 'tool', which raw-text prompts")
    assert "task.chat_template" in str(e.value) and "\n" not in str(e.value)
    # The reward model's template is checked on every row too, as it will score them.
    from rlhf.roles.reward_model import check_reward_model
    rm_tok = build_char_tokenizer(tmp_path / "rm")
    save_rm(tmp_path / "rm", rm_tok)
    examples = [Example(r["prompt"], r["answer"], where=f"{path} row {i}") for i, r in enumerate(rows)]
    with pytest.raises(ConfigError, match=r"row 7: the chat template \(reward.chat_template\) rejects this row "
                                          r"\(TemplateError: Unknown role: tool\)"):
        check_reward_model(RewardConfig(kind="model", model_path=str(tmp_path / "rm"), chat_template=str(template)),
                           TaskConfig(), examples)
    check_reward_model(RewardConfig(kind="model", model_path=str(tmp_path / "rm"), chat_template=str(template)),
                       TaskConfig(), examples[:7])

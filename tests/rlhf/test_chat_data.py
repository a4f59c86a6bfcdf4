"""Chat prompts and dataset formats: rendering equals transformers' apply_chat_template, verl
parquet and preference pairs load right, and bad files are one-line errors (exit 2)."""

import json
import subprocess
import sys

import pytest

from rlhf.chat import PromptRenderer, encode_prompt, render_prompt
from rlhf.config import TaskConfig
from rlhf.data import Example, detect_format, load_pairs, load_task, read_records, split_examples
from rlhf.errors import ConfigError
from rlhf.tiny import build_char_tokenizer
from tests.conftest import REPO

# A small Jinja chat template in the usual shape (ChatML-like, with the generation prompt).
TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<bos>assistant: {% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    t = build_char_tokenizer(tmp_path_factory.mktemp("tok"))
    t.chat_template = TEMPLATE
    return t


@pytest.fixture(scope="module")
def raw_tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("rawtok"))


def test_chat_rendering_equals_apply_chat_template(tok):
    expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    r = PromptRenderer(tok, "auto")
    assert r.uses_template and "own chat template" in r.describe()
    assert r.ids(MESSAGES) == list(expected)
    assert r.text(MESSAGES) == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    cfg = TaskConfig()
    assert encode_prompt(tok, MESSAGES, cfg) == list(expected)
    assert render_prompt(tok, MESSAGES, cfg).endswith("<bos>assistant: ")


def test_system_prompt_and_suffix_apply_to_string_and_message_prompts(tok):
    r = PromptRenderer(tok, "auto", system_prompt="Be brief.", instruction_suffix=" Answer after ####.")
    want = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3= Answer after ####."}]
    assert r.messages("2+3=") == want
    assert r.messages([{"role": "user", "content": "2+3="}]) == want
    assert r.ids("2+3=") == list(tok.apply_chat_template(want, add_generation_prompt=True)["input_ids"])
    # a conversation's own system message wins
    assert r.messages(MESSAGES)[0] == MESSAGES[0]


def test_auto_without_template_is_raw_text_and_unchanged(raw_tok):
    r = PromptRenderer(raw_tok, "auto")
    assert not r.uses_template and "no chat template" in r.describe()
    assert r.text("3+4=") == "3+4="
    assert r.ids("3+4=") == raw_tok("3+4=")["input_ids"]
    assert r.full_text("3+4=", "7") == "3+4=7"
    assert PromptRenderer(raw_tok, "none").text([{"role": "user", "content": "3+4="}]) == "3+4="


def test_template_file(tok, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    r = PromptRenderer(tok, str(path))
    assert r.text(MESSAGES) == "[Be brief.][What is 2+3?]"
    assert r.full_text(MESSAGES, "5") == "[Be brief.][What is 2+3?][5]"


def test_template_file_missing_or_not_rendering_is_one_line(tok, tmp_path):
    with pytest.raises(ConfigError, match="no such template file"):
        TaskConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="no such template file"):
        PromptRenderer(tok, str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ConfigError, match="does not render") as e:
        PromptRenderer(tok, str(bad))
    assert "\n" not in str(e.value)
    silent = tmp_path / "silent.jinja"
    silent.write_text("hello")
    with pytest.raises(ConfigError, match="renders no message content"):
        PromptRenderer(tok, str(silent))


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)


VERL_ROWS = [
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": f"Tom has {i} apples and buys 2. How many? "
                 "Let's think step by step and output the final answer after \"####\"."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
     "extra_info": {"split": "train", "index": i}}
    for i in range(30)
]


def test_verl_parquet_loads(tmp_path, tok):
    path = tmp_path / "train.parquet"
    _write_parquet(path, VERL_ROWS)
    assert detect_format(read_records(path), str(path)) == "verl"
    train, held = load_task(TaskConfig(name="file", train_path=str(path), reward_fn="gsm8k"))
    examples = train + held
    assert len(examples) == 30
    by_truth = {ex.answer: ex for ex in examples}
    assert set(by_truth) == {str(i + 2) for i in range(30)}
    ex = by_truth["7"]
    assert ex.prompt == VERL_ROWS[5]["prompt"] and ex.data_source == "openai/gsm8k"
    assert PromptRenderer(tok, "auto").text(ex.prompt).startswith("<bos>user: Tom has 5 apples")
    # the same rows as JSONL load the same examples, and an explicit format agrees
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))
    again = load_task(TaskConfig(name="file", train_path=str(jsonl), format="verl", reward_fn="gsm8k"))
    assert again == (train, held)


def test_plain_rows_with_message_prompts_split_deterministically(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(50)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held = load_task(TaskConfig(name="file", train_path=str(path)))
    assert len(train) + len(held) == 50 and held
    assert split_examples([Example(r["prompt"], r["answer"]) for r in reversed(rows)], 0.2)[1] == held


def test_preference_pairs_in_trl_and_openrlhf_shapes(tmp_path):
    rows = [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},                                     # explicit, text
        {"chosen": "2+2=4", "rejected": "2+2=5"},                                               # implicit, text
        {"prompt": [{"role": "user", "content": "2+2="}],                                       # explicit, chat
         "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]},
        {"chosen": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}],  # implicit, chat
         "rejected": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "5"}], "margin": 1.5},
    ]
    path = tmp_path / "pairs.parquet"
    path.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = load_pairs(path.with_suffix(".jsonl"))
    assert [p.prompt for p in pairs] == ["2+2=", None, [{"role": "user", "content": "2+2="}], None]
    assert pairs[0].chosen == "4" and pairs[1].rejected == "2+2=5" and pairs[3].margin == 1.5
    assert pairs[2].chosen == [{"role": "assistant", "content": "4"}]
    # a preference file is not a PPO task
    with pytest.raises(ConfigError, match="preference pairs"):
        load_task(TaskConfig(name="file", train_path=str(path.with_suffix(".jsonl"))))


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": \n', r"bad\.jsonl:2: not valid JSON"),
    (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9=", "answer": "2"}\n', r"bad\.jsonl:2: not UTF-8"),
    (b"", r"bad\.jsonl' is empty"),
    (b"\n\n", r"bad\.jsonl' is empty"),
    (b'[1, 2]\n', r"bad\.jsonl:1: a row must be a JSON object"),
    (b'{"question": "1+1=", "solution": "2"}\n', r"fits no dataset format: columns found \['question', 'solution'\]; "
                                                  r"accepted: plain .* verl .* preference"),
    (b'{"prompt": 5, "answer": "2"}\n', r"the prompt must be a string or a list"),
    (b'{"data_source": "x", "prompt": [{"role": "user", "content": "q"}], "reward_model": {"style": "rule"}}\n',
     r"needs 'prompt' and 'reward_model' with 'ground_truth'"),
])
def test_bad_data_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as e:
        load_task(TaskConfig(name="file", train_path=str(path)))
    assert "\n" not in str(e.value)


def test_a_directory_as_data_file_says_it_is_one(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_task(TaskConfig(name="file", train_path=str(tmp_path)))
    assert str(e.value) == (f"task data file {str(tmp_path)!r} is a directory, not a file; expected a .jsonl, "
                            f".json or .parquet file")


def test_bad_parquet_is_one_line(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"not a parquet file at all")
    with pytest.raises(ConfigError, match=r"x\.parquet: not a readable parquet file"):
        read_records(path)


@pytest.fixture(scope="module")
def random_policy(tmp_path_factory):
    """A tiny random policy checkpoint and tokenizer (no SFT): enough to reach data loading."""
    from rlhf.config import TinyModelConfig
    from rlhf.tiny import build_tiny_model
    root = tmp_path_factory.mktemp("policy")
    tokenizer = build_char_tokenizer(root / "tok")
    build_tiny_model(TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
                     tokenizer, seed=0).save_pretrained(str(root / "model"))
    return root


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": \n', "bad.jsonl:2: not valid JSON"),
    (b'{"prompt": "caf\xe9=", "answer": "2"}\n', "bad.jsonl:1: not UTF-8 text"),
    (b"", "is empty (no rows)"),
])
def test_train_cli_bad_data_file_exits_2_with_one_line(tmp_path, random_policy, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.train", str(REPO / "recipes" / "tiny.gin"), "--out", str(tmp_path / "run"),
         "-b", f"model.name_or_path = '{random_policy / 'model'}'",
         "-b", f"model.tokenizer_path = '{random_policy / 'tok'}'",
         "-b", "task.name = 'file'", "-b", f"task.train_path = '{path}'"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_study_plan_bad_data_file_exits_2_with_one_line(tmp_path, random_policy):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9=", "answer": "2"}\n')
    study = tmp_path / "study.gin"
    study.write_text(f"""study.name = 'bad_data'
study.baseline_recipe = '{REPO / "recipes" / "tiny.gin"}'
study.baseline_bindings = ["model.name_or_path = '{random_policy / 'model'}'",
                           "model.tokenizer_path = '{random_policy / 'tok'}'",
                           "task.name = 'file'", "task.train_path = '{path}'"]
study.variants = {{'kl': 'ppo.kl_coef = 0.1'}}
study.seeds = 1
study.metric = 'eval/accuracy'
""")
    proc = subprocess.run([sys.executable, "-m", "experiments", "plan", str(study), "--results", str(tmp_path / "r")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "latin.jsonl:2: not UTF-8 text" in lines[-1]

"""Reward models: scores equal a direct AutoModelForSequenceClassification forward at the last
non-pad token (same or different tokenizer and template, any padding and micro-batch size),
reward kinds, bad checkpoints, and Bradley-Terry training (accuracy, determinism, resume)."""

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from rlhf.batch import Batch
from rlhf.chat import PromptRenderer
from rlhf.config import RewardConfig, SFTConfig, TaskConfig, TinyModelConfig
from rlhf.errors import ConfigError
from rlhf.reward_model.score import RewardModelScorer, check_reward_checkpoint
from rlhf.tiny import CHARACTERS, build_char_tokenizer, build_tiny_model
from tests.conftest import REPO

RM_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def other_tokenizer(path):
    """A tokenizer unlike the policy's: another id order, extra special tokens, a chat template."""
    special = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<s>", "</s>", "<unk>", "[PAD]"]
    vocab = {t: i for i, t in enumerate(special + list(reversed(CHARACTERS)) + ["|", "<", ">"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|\w+\|>|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", additional_special_tokens=special[:4])
    tok.chat_template = RM_TEMPLATE
    tok.save_pretrained(str(path))
    return tok


def save_rm(path, tokenizer, num_labels=1, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, num_labels=num_labels)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    policy_tok = build_char_tokenizer(root / "policy_tok")
    policy_tok.padding_side = "left"
    save_rm(root / "same", policy_tok, seed=1)
    rm_tok = other_tokenizer(root / "other_tok")
    save_rm(root / "other", rm_tok, seed=2)
    return root, policy_tok, rm_tok


PROMPTS = ["3+4=", "12-15=", [{"role": "user", "content": "7+8="}], "0+0=", "20-3=", "5+5="]
RESPONSES = ["7", "-3", "15", "01", "17", "1"]
FINISHED = [True, True, False, True, True, True]


def policy_batch(tok, renderer, prompt_side="left"):
    """A rollout batch as the trainer builds it: prompts padded on `prompt_side`, responses on the right."""
    prompt_ids = [renderer.ids(p) for p in PROMPTS]
    resp = [tok(r, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if f else [])
            for r, f in zip(RESPONSES, FINISHED)]
    P, R = max(map(len, prompt_ids)), max(map(len, resp)) + 2

    def pad(rows, width, left):
        ids = torch.full((len(rows), width), tok.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(width - len(r), width) if left else slice(0, len(r))
            ids[i, sl], mask[i, sl] = torch.tensor(r), 1
        return ids, mask
    pi, pm = pad(prompt_ids, P, prompt_side == "left")
    ri, rm = pad(resp, R, False)
    b = Batch({"prompt_ids": pi, "prompt_mask": pm, "response_ids": ri, "response_mask": rm,
               "finished": torch.tensor(FINISHED)})
    b["prompts"], b["responses"], b["answers"] = PROMPTS, RESPONSES, ["7", "-3", "15", "0", "17", "10"]
    return b


def direct_scores(model_dir, seqs):
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        return torch.tensor([float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs])


@pytest.mark.parametrize("prompt_side", ["left", "right"])
@pytest.mark.parametrize("micro_batch_size", [1, 4, 32])
def test_same_tokenizer_scores_equal_direct_forward(setup, prompt_side, micro_batch_size):
    root, tok, _ = setup
    renderer = PromptRenderer(tok, "auto")
    scorer = RewardModelScorer(str(root / "same"), str(root / "policy_tok"), policy_tokenizer=tok,
                               micro_batch_size=micro_batch_size, log=lambda m: None)
    batch = policy_batch(tok, renderer, prompt_side)
    seqs = [renderer.ids(p) + tok(r, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if f else [])
            for p, r, f in zip(PROMPTS, RESPONSES, FINISHED)]
    torch.testing.assert_close(scorer.score_batch(batch), direct_scores(root / "same", seqs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt_side", ["left", "right"])
@pytest.mark.parametrize("micro_batch_size", [1, 3, 32])
def test_other_tokenizer_reencodes_the_conversation_with_its_template(setup, prompt_side, micro_batch_size):
    root, tok, rm_tok = setup
    renderer = PromptRenderer(tok, "auto")
    scorer = RewardModelScorer(str(root / "other"), policy_tokenizer=tok, micro_batch_size=micro_batch_size,
                               log=lambda m: None)
    assert scorer.renderer.uses_template
    batch = policy_batch(tok, renderer, prompt_side)
    convos = [([{"role": "user", "content": p}] if isinstance(p, str) else p) + [{"role": "assistant", "content": r}]
              for p, r in zip(PROMPTS, RESPONSES)]
    seqs = [list(rm_tok.apply_chat_template(c, add_generation_prompt=False)["input_ids"]) for c in convos]
    assert "<|assistant|>15<|end|>" in rm_tok.decode(seqs[2])
    torch.testing.assert_close(scorer.score_batch(batch), direct_scores(root / "other", seqs), atol=1e-5, rtol=1e-5)


def test_reward_kinds_and_normalisation(setup):
    root, tok, _ = setup
    renderer = PromptRenderer(tok, "auto")
    batch = policy_batch(tok, renderer)
    from rlhf.placement.context import DeviceContext
    from rlhf.roles.reward import Reward
    from rlhf.roles.reward_model import RewardModel
    ctx = DeviceContext(torch.device("cpu"))
    scorer = RewardModel(ctx, RewardConfig(kind="model", model_path=str(root / "same")), TaskConfig(),
                         str(root / "policy_tok"), log=lambda m: None)
    raw = scorer.score(batch)
    task = TaskConfig()

    def RewardRole(task, reward, rm=None):  # noqa: N802 - the reward phase in one process
        return Reward(ctx, task, reward, rm)
    rule = RewardRole(task, RewardConfig()).score(batch)
    assert rule["correct"].tolist() == [True, True, False, False, True, False] and "rm_scores" not in rule
    penalty = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0])
    model = RewardRole(task, RewardConfig(kind="model", model_path="x"), scorer).score(batch)
    torch.testing.assert_close(model["scores"], raw - penalty)
    torch.testing.assert_close(model["rm_scores"], raw)
    assert model["correct"].tolist() == rule["correct"].tolist()  # gold accuracy stays the rule's
    comb = RewardRole(task, RewardConfig(kind="combined", model_path="x", rule_weight=2.0, model_weight=0.5),
                      scorer).score(batch)
    torch.testing.assert_close(comb["scores"], 2.0 * (rule["scores"] + penalty) + 0.5 * raw - penalty)
    whitened = RewardRole(task, RewardConfig(kind="model", model_path="x", normalize="batch", clip=1.0),
                          scorer).score(batch)["scores"] + penalty
    assert abs(float(whitened.mean())) < 0.3 and float(whitened.abs().max()) <= 1.0 + 1e-6
    role = RewardRole(task, RewardConfig(kind="model", model_path="x", normalize="running"), scorer)
    role.score(batch)
    state = role.state_dict()
    assert state["running"]["count"] == len(batch)
    role.score(batch, update=False)
    assert role.state_dict() == state  # evaluation never moves the running statistics


def test_bad_reward_checkpoints_are_one_line_errors(setup, tmp_path):
    root, tok, _ = setup
    save_rm(tmp_path / "two", tok, num_labels=2)
    with pytest.raises(ConfigError, match="num_labels = 2; a reward model has one output"):
        RewardModelScorer(str(tmp_path / "two"), log=lambda m: None)
    build_tiny_model(TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), tok,
                     seed=0).save_pretrained(str(tmp_path / "lm"))
    with pytest.raises(ConfigError, match="LlamaForCausalLM checkpoint is not a sequence classifier"):
        check_reward_checkpoint(tmp_path / "lm")
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    (tmp_path / "lm" / "config.json").write_text(json.dumps({**config, "architectures": "LlamaForCausalLM"}))
    with pytest.raises(ConfigError, match=r"a LlamaForCausalLM checkpoint is not"):  # a lone string: one name
        check_reward_checkpoint(tmp_path / "lm")
    with pytest.raises(ConfigError, match="no config.json"):
        check_reward_checkpoint(tmp_path / "nowhere")
    (tmp_path / "bad.jinja").write_text("{% if %}")
    with pytest.raises(ConfigError, match="reward.chat_template .* does not render"):
        RewardModelScorer(str(root / "same"), chat_template=str(tmp_path / "bad.jinja"), log=lambda m: None)
    with pytest.raises(ConfigError, match="reward.model_path"):
        RewardConfig(kind="model")


# ----------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def rm_data(tmp_path_factory):
    """The embedded default's SFT policy and the arithmetic preference pairs."""
    from rlhf.data import load_task
    from rlhf.reward_model.pairs import make_pairs
    from rlhf.tiny import prepare_tiny
    model_dir, tok_dir = prepare_tiny(TinyModelConfig(), SFTConfig(), TaskConfig(), log=lambda m: None)
    root = tmp_path_factory.mktemp("pairs")
    train, held = load_task(TaskConfig())
    for name, rows, seed in (("train", train, 0), ("eval", held, 1)):
        pairs = make_pairs([{"prompt": e.prompt, "answer": e.answer} for e in rows], seed=seed)
        (root / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    recipe = root / "rm.gin"
    recipe.write_text(f"rm.train_path = '{root / 'train.jsonl'}'\nrm.eval_path = '{root / 'eval.jsonl'}'\n"
                      f"rm.base_model = '{model_dir}'\nrm.tokenizer_path = '{tok_dir}'\n"
                      "rm.steps = 60\nrm.batch_size = 32\nrm.learning_rate = 1e-3\nrm.warmup_steps = 10\n"
                      "rm.eval_every = 30\nrm.save_every = 30\nrm.torch_threads = 1\n")
    return recipe


def train_rm(recipe, out, *extra, check=True):
    proc = subprocess.run([sys.executable, "-m", "rlhf.reward_model", str(recipe), "--out", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_rm_training_learns_is_deterministic_and_loads(rm_data, tmp_path):
    # Two runs of one recipe and one with gradient checkpointing, side by side (one thread each: rm.torch_threads).
    runs = [(tmp_path / "a",), (tmp_path / "b",), (tmp_path / "gc", "-b", "rm.gradient_checkpointing = True")]
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        list(pool.map(lambda args: train_rm(rm_data, *args), runs))
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    # Held-out pairs (prompts PPO evaluates on, never trained on): chance is 0.5; measured 0.70 at 60 steps.
    assert summary["final"]["eval/pair_accuracy"] >= 0.62, summary
    assert summary["initial"]["eval/pair_accuracy"] < summary["final"]["eval/pair_accuracy"]
    wa, wb = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # Gradient checkpointing recomputes the same activations: the same weights, bit for bit (CPU).
    wc = load_file(str(tmp_path / "gc" / "model.safetensors"))
    assert wc.keys() == wa.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "a"))
    assert model.config.num_labels == 1
    RewardModelScorer(str(tmp_path / "a"), log=lambda m: None)  # the role loads it, tokenizer included


def test_rm_resume_equals_uninterrupted(rm_data, tmp_path):
    from rlhf.reward_model.bradley_terry import RewardModelTrainer
    from rlhf.reward_model.config import resolve
    cfg, _ = resolve(str(rm_data))
    full = RewardModelTrainer(cfg, tmp_path / "full", log=lambda m: None)
    full.run()
    cut = RewardModelTrainer(cfg, tmp_path / "cut", log=lambda m: None)
    original = cut.train_step

    def interrupted():
        if cut.step == 45:
            raise KeyboardInterrupt
        return original()
    cut.train_step = interrupted
    with pytest.raises(KeyboardInterrupt):
        cut.run()
    resumed = RewardModelTrainer(cfg, tmp_path / "cut", log=lambda m: None)
    resumed.run(resume=True)
    wa = load_file(str(tmp_path / "full" / "model.safetensors"))
    wb = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    def lines(p):
        return [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()]

    assert lines(tmp_path / "full") == [r for r in lines(tmp_path / "cut")]


def test_rm_cli_bad_inputs_exit_2_with_one_line(rm_data, tmp_path, setup, capsys):
    root, tok, _ = setup
    save_rm(tmp_path / "two", tok, num_labels=2)
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    torn = tmp_path / "torn"
    shutil.copytree(tmp_path / "two", torn)
    (torn / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], ')  # cut short
    cases = [
        (["-b", f"rm.base_model = '{tmp_path / 'two'}'"], "num_labels = 2"),
        (["-b", f"rm.train_path = '{plain}'"], "not preference pairs"),
        (["-b", f"rm.base_model = '{torn}'"], "is not valid JSON"),
        (["-b", f"rm.chat_template = '{tmp_path / 'missing.jinja'}'"], "rm.chat_template"),
        (["-b", "rm.batch_size = 30"], "rm.micro_batch_size"),
        (["-b", "rm.stepz = 3"], "rm.stepz"),
    ]
    from rlhf.reward_model.__main__ import main
    for extra, message in cases[1:]:  # in-process: the same entry point, without the start-up cost
        capsys.readouterr()
        assert main([str(rm_data), "--out", str(tmp_path / "out"), *extra]) == 2, extra
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert err and err[-1].startswith("error: ") and message in err[-1], (extra, err)
    proc = train_rm(rm_data, tmp_path / "out", *cases[0][0], check=False)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and cases[0][1] in lines[-1] and "Traceback" not in proc.stderr, proc.stderr[-1500:]


def test_arithmetic_pairs_from_policy_samples():
    from rlhf.reward_model.pairs import make_pairs
    rows = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "9-9=", "answer": "0"}]
    samples = [["7", "8", "17", "7"], ["0", "0", "0", "0"]]
    pairs = make_pairs(rows, seed=0, per_prompt=20, samples=samples, short_fraction=0.3)
    assert all(p["chosen"] == r["answer"] for p, r in zip(pairs, [rows[0]] * 20 + [rows[1]] * 20))
    first = [p["rejected"] for p in pairs[:20]]
    assert set(first) <= {"8", "17"} | {str(d) for d in range(10) if d != 7} and {"8", "17"} <= set(first)
    # a prompt the policy never got wrong gets one-digit guesses, never its right answer
    assert all(len(p["rejected"]) == 1 and p["rejected"] != "0" for p in pairs[20:])
    assert make_pairs(rows, seed=0, per_prompt=20, samples=samples) == pairs  # seeded

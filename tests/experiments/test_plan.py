"""Plan expansion: counts, unique hashes, the same seeds in every variant, what changes a hash."""

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.errors import StudyError
from experiments.plan import expand
from experiments.study import BASELINE, load_study
from rlhf.provenance import hash_directory
from tests.experiments.conftest import fake_checkpoint, previous_study_aggregate

REPO = Path(__file__).resolve().parents[2]

STUDY = """
study.name = 'p'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 4']
study.variants = {'kl': 'ppo.kl_coef = 0.1', 'clip': 'ppo.clip_range = 0.1'}
study.seeds = 3
"""


def test_expansion_counts_hashes_and_seeds(write_study, tmp_path):
    specs = expand(load_study(write_study(STUDY)), tmp_path / "results")
    assert len(specs) == 3 * 3
    assert len({s.run_hash for s in specs}) == 9
    assert len({s.run_dir for s in specs}) == 9
    seeds = {}
    for s in specs:
        seeds.setdefault(s.variant, []).append(s.seed)
    assert seeds == {BASELINE: [0, 1, 2], "kl": [0, 1, 2], "clip": [0, 1, 2]}
    assert {s.code_version["engine_sha256"] for s in specs} == {specs[0].code_version["engine_sha256"]}
    assert len({s.data_hash for s in specs}) == 1
    kl = [s for s in specs if s.variant == "kl"][0]
    assert kl.changes == {"ppo.kl_coef": 0.1}
    assert "ppo.seed = 0" in kl.bindings and "ppo.kl_coef = 0.1" in kl.bindings
    assert kl.total_steps == 4
    assert Path(kl.run_dir) == (tmp_path / "results" / "p" / "runs" / "kl" / "seed0").resolve()


def test_hash_is_stable_and_tracks_the_config(write_study, tmp_path):
    path = write_study(STUDY)
    first = {s.key: s.run_hash for s in expand(load_study(path), tmp_path)}
    assert first == {s.key: s.run_hash for s in expand(load_study(path), tmp_path)}
    placed = {s.key: s.run_hash for s in expand(load_study(path, ["ppo.world_size = 2"]), tmp_path)}
    assert placed == first, "where a run executes (world size, placement) does not change its result"
    changed = {s.key: s.run_hash for s in expand(load_study(path, ["ppo.total_steps = 5"]), tmp_path)}
    assert not set(first.values()) & set(changed.values())
    # Another variant added: the existing runs keep their hashes, so only the new one would run.
    more = expand(load_study(path, ["study.variants = {'kl': 'ppo.kl_coef = 0.1', 'lr': "
                                    "'ppo.actor_learning_rate = 1e-5'}"]), tmp_path)
    assert {s.key: s.run_hash for s in more if s.variant in (BASELINE, "kl")} == \
        {k: v for k, v in first.items() if not k.startswith("clip")}


def test_how_a_study_is_judged_does_not_change_its_runs(write_study, tmp_path):
    # The analysis and the equivalence margin change the verdicts, not what a run computes: every
    # run keeps its hash, so changing them re-reports a study without rerunning it.
    path = write_study(STUDY)
    first = {s.key: s.run_hash for s in expand(load_study(path), tmp_path)}
    judged = load_study(path, ["study.analysis = 'welch'", "study.equivalence_margin = 0.02", "study.alpha = 0.1"])
    assert (judged.analysis, judged.equivalence_margin) == ("welch", 0.02)
    assert {s.key: s.run_hash for s in expand(judged, tmp_path)} == first


def test_data_change_changes_the_data_hash(write_study, tmp_path):
    specs = expand(load_study(write_study(STUDY), ["task.max_operand = 9"]), tmp_path)
    base = expand(load_study(write_study(STUDY)), tmp_path)
    assert specs[0].data_hash != base[0].data_hash


@pytest.mark.parametrize("variant, match", [
    ("'ppo.kl_coef = -1'", r"study.variants\['v'\].*ppo.kl_coef"),
    ("'ppo.kl_coeff = 0.1'", "did you mean ppo.kl_coef"),
    ("'ppo.kl_coef = 0.05'", "changes nothing"),
])
def test_bad_variants_fail_before_running(write_study, tmp_path, variant, match):
    text = STUDY.replace("study.variants = {'kl': 'ppo.kl_coef = 0.1', 'clip': 'ppo.clip_range = 0.1'}",
                         f"study.variants = {{'v': {variant}}}")
    with pytest.raises(StudyError, match=match):
        expand(load_study(write_study(text)), tmp_path)


def _fake_previous_study(root: Path) -> Path:
    prev = root / "prev"
    runs = []
    for seed in (0, 1):
        fake_checkpoint(prev / "runs" / "kl" / f"seed{seed}" / "checkpoints" / "step_4", b"weights %d" % seed)
        fake_checkpoint(prev / "runs" / "kl" / f"seed{seed}" / "checkpoints" / "step_2")
        runs.append((seed, "completed", f"runs/kl/seed{seed}"))
    previous_study_aggregate("prev", "kl", {BASELINE: [], "kl": runs}).save(prev / "aggregate.json")
    return prev


def test_resume_from_previous_study_uses_chosen_variant_per_seed(write_study, tmp_path):
    prev = _fake_previous_study(tmp_path)
    specs = expand(load_study(write_study(STUDY + f"study.resume_from = '{prev}'\nstudy.seeds = [0, 1, 5]\n")),
                   tmp_path / "r")
    by_seed = {s.seed: s for s in specs if s.variant == BASELINE}
    assert by_seed[0].init_from.endswith("runs/kl/seed0/checkpoints/step_4")
    assert by_seed[1].init_from.endswith("runs/kl/seed1/checkpoints/step_4")
    assert by_seed[5].init_from == by_seed[0].init_from  # a seed the previous study lacked
    assert f"ppo.init_from = {by_seed[0].init_from!r}" in by_seed[0].bindings
    assert by_seed[0].init_from_hash == hash_directory(by_seed[0].init_from)
    plain = {s.key: s.run_hash for s in expand(load_study(write_study(STUDY)), tmp_path / "r")}
    assert plain["baseline/seed0"] != by_seed[0].run_hash
    with pytest.raises(StudyError, match="resume_variant"):
        expand(load_study(write_study(STUDY + f"study.resume_from = '{prev}'\nstudy.resume_variant = 'x'\n")),
               tmp_path / "r")


def test_plan_cli_prints_the_table_without_running(write_study, tmp_path):
    path = write_study(STUDY)
    out = subprocess.run([sys.executable, "-m", "experiments", "plan", str(path), "--results", str(tmp_path / "r"),
                          "-b", "study.seeds = 2"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3 variants x 2 seeds = 6 runs" in out.stdout
    assert "ppo.kl_coef = 0.1" in out.stdout
    assert not (tmp_path / "r").exists()
    bad = subprocess.run([sys.executable, "-m", "experiments", "plan", str(path), "-b", "ppo.kl_coef = -1"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "ppo.kl_coef" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes" / "studies").glob("*.gin")), ids=lambda p: p.name)
def test_every_shipped_study_parses_and_plans(recipe, tmp_path, monkeypatch):
    # The demo rounds read the DVC pipeline's data stage output (paths relative to the working
    # directory): make it here, as `dvc repro` would.
    from experiments.cli import main as pipeline
    monkeypatch.chdir(tmp_path)
    assert pipeline(["data", "--recipe", str(REPO / "recipes" / "tiny.gin"), "--out", "data/arithmetic"]) == 0
    study = load_study(recipe)
    if study.resume_from:  # planning needs the previous round's results
        return
    specs = expand(study, tmp_path)
    assert len(specs) == len(study.all_variants) * len(study.seeds)
    assert len({s.run_hash for s in specs}) == len(specs)


def test_resume_from_must_exist_when_planning(write_study, tmp_path):
    study = load_study(write_study(STUDY + "study.resume_from = 'results/not_yet'\n"))
    with pytest.raises(StudyError, match="does not exist: run the previous study first"):
        expand(study, tmp_path)


def test_baseline_only_study(write_study, tmp_path):
    text = STUDY.replace("study.variants = {'kl': 'ppo.kl_coef = 0.1', 'clip': 'ppo.clip_range = 0.1'}",
                         "study.variants = {}")
    specs = expand(load_study(write_study(text)), tmp_path)
    assert [s.key for s in specs] == ["baseline/seed0", "baseline/seed1", "baseline/seed2"]


def test_retraining_the_policy_checkpoint_changes_the_run_hash(write_study, tmp_path):
    """A run reads its local policy checkpoint (and reward model): new weights at the same path rerun it."""
    from rlhf.config import TinyModelConfig
    from rlhf.tiny import build_char_tokenizer, build_tiny_model
    model = tmp_path / "policy"
    tok = build_char_tokenizer(model)
    build_tiny_model(TinyModelConfig(), tok, seed=0).save_pretrained(str(model))
    study = load_study(write_study(STUDY.replace("'ppo.total_steps = 4'",
                                                 f"'ppo.total_steps = 4', \"model.name_or_path = '{model}'\"")))
    before = {s.run_hash for s in expand(study, tmp_path / "results")}
    build_tiny_model(TinyModelConfig(), tok, seed=1).save_pretrained(str(model))
    after = {s.run_hash for s in expand(study, tmp_path / "results")}
    assert len(before) == len(after) == 9 and not before & after


def test_new_data_at_the_same_path_changes_the_run_hash(write_study, tmp_path):
    """Only the bytes of the train file change (no binding, no config text): every run hash changes
    with the data hash, and the config hashes do not."""
    import json

    from rlhf.config import TinyModelConfig
    from rlhf.tiny import build_char_tokenizer, build_tiny_model
    model = tmp_path / "policy"
    tok = build_char_tokenizer(model)
    build_tiny_model(TinyModelConfig(), tok, seed=0).save_pretrained(str(model))
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    rows = lambda answers: "".join(json.dumps({"prompt": f"{i}+1=", "answer": a}) + "\n"  # noqa: E731
                                   for i, a in enumerate(answers))
    train.write_text(rows([str(i + 1) for i in range(8)]))
    held.write_text(rows(["1", "2"]))
    files = (f"\"model.name_or_path = '{model}'\", \"task.name = 'file'\", \"task.train_path = '{train}'\", "
             f"\"task.eval_path = '{held}'\", 'task.eval_size = 2'")
    study = load_study(write_study(STUDY.replace("'ppo.total_steps = 4'", f"'ppo.total_steps = 4', {files}")))
    before = expand(study, tmp_path / "results")
    train.write_text(rows([str(i + 1) for i in range(7)] + ["9"]))  # one answer differs
    after = expand(study, tmp_path / "results")
    assert [s.config_hash for s in after] == [s.config_hash for s in before]
    assert len({s.data_hash for s in before}) == len({s.data_hash for s in after}) == 1
    assert before[0].data_hash != after[0].data_hash
    assert not {s.run_hash for s in before} & {s.run_hash for s in after}


def test_pipeline_stages_load_only_their_own_modules(tmp_path):
    # `python -m experiments data` (and sft) run where only the engine is installed: no Ray, W&B,
    # scipy or plotting is imported for them, and the study subcommands still list and parse.
    code = ("import sys; from experiments.cli import main; "
            f"rc = main(['data', '--recipe', {str(REPO / 'recipes' / 'tiny.gin')!r}, "
            f"'--out', {str(tmp_path / 'd')!r}]); "
            "print(rc, sorted(m for m in ('ray', 'wandb', 'scipy', 'matplotlib', 'experiments.study') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.split("\n")[-2] == "0 []", out.stdout + out.stderr
    assert (tmp_path / "d" / "train.jsonl").is_file()
    listed = subprocess.run([sys.executable, "-m", "experiments", "--help"], capture_output=True, text=True, cwd=REPO)
    assert listed.returncode == 0 and all(name in listed.stdout for name in ("plan", "run", "advise", "sft"))


def test_plan_refuses_a_run_that_cannot_fit_its_gpu(write_study, tmp_path, monkeypatch, capsys):
    """`python -m experiments plan` on a GPU machine: the predicted memory plan of every variant must
    fit its GPU (or share), else exit 2 with one line naming the bindings that would make it fit."""
    import json

    import experiments.gpu_fit as gpu_fit
    from experiments.cli import main
    from rlhf.memory import KNOWN_SHAPES
    shape = KNOWN_SHAPES["qwen2.5-7b"]
    model = tmp_path / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": shape.hidden_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size, "tie_word_embeddings": False}))
    path = write_study(f"""
        study.name = 'big'
        study.baseline_recipe = 'models/instruct.gin'
        study.baseline_bindings = ["model.name_or_path = '{model}'"]
        study.variants = {{'lora': 'ppo.lora_rank = 64'}}
        study.seeds = 1
        study.gpus_per_run = 1
        """)
    monkeypatch.setattr(gpu_fit, "_gpu_memory_gib", lambda: 139.0)
    assert main(["plan", str(path), "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "study.variants['baseline']" in err
    assert "needs 404.2 GiB on a 139.0 GiB GPU" in err and "it fits with ppo.lora_rank = 64" in err
    fitted = load_study(path, ["study.baseline_bindings = [\"model.name_or_path = '%s'\", 'ppo.lora_rank = 64', "
                               "'ppo.gradient_checkpointing = True']" % model,
                               "study.variants = {'budget': 'ppo.max_tokens_per_micro_batch = 8192'}"])
    assert len(expand(fitted, tmp_path / "r")) == 2
    monkeypatch.setattr(gpu_fit, "_gpu_memory_gib", lambda: None)  # no GPU here: nothing to check against
    assert len(expand(load_study(path), tmp_path / "r")) == 2


def test_a_task_variant_plans_its_own_runs(write_study, tmp_path):
    """Every engine scope may be varied, not only `ppo.*` (one list: rlhf.configurable.SCOPES)."""
    from experiments.study import ENGINE_SCOPES
    from rlhf.configurable import SCOPES
    assert ENGINE_SCOPES == tuple(SCOPES)
    path = write_study(STUDY.replace("{'kl': 'ppo.kl_coef = 0.1', 'clip': 'ppo.clip_range = 0.1'}",
                                     "{'eos': 'task.missing_eos_penalty = 0.25'}").replace("seeds = 3", "seeds = 1"))
    base, eos = expand(load_study(path), tmp_path)
    assert eos.variant == "eos" and eos.changes == {"task.missing_eos_penalty": 0.25}
    assert eos.run_hash != base.run_hash and eos.config_hash != base.config_hash
    assert "task.missing_eos_penalty = 0.25" in eos.operative_config
    assert "task.missing_eos_penalty = 0.25" not in base.operative_config


def test_a_variant_that_changes_nothing_the_run_uses_is_refused(write_study, tmp_path):
    """`reward.normalize` shapes the reward model's score: under the tiny default's rule reward it would
    be a no-op with run hashes of its own. It is refused at planning, naming the variant and the binding."""
    from experiments.errors import StudyError
    path = write_study(STUDY.replace("{'kl': 'ppo.kl_coef = 0.1', 'clip': 'ppo.clip_range = 0.1'}",
                                     "{'norm': \"reward.normalize = 'batch'\"}").replace("seeds = 3", "seeds = 1"))
    with pytest.raises(StudyError,
                       match=r"norm.*reward\.normalize = 'batch' is invalid: is set but reward\.kind = 'rule'"):
        expand(load_study(path), tmp_path)


def test_a_variant_the_trainer_would_refuse_is_refused_at_planning(write_study, tmp_path):
    """The plan runs the trainer's own policy check (rlhf/memory/plan.py `check_policy`): a LoRA
    rank above the tiny model's 64-wide layers stops the study before any run, naming the variant."""
    from experiments.errors import StudyError
    path = write_study(STUDY.replace("{'kl': 'ppo.kl_coef = 0.1', 'clip': 'ppo.clip_range = 0.1'}",
                                     "{'wide': 'ppo.lora_rank = 4096'}").replace("seeds = 3", "seeds = 1"))
    with pytest.raises(StudyError, match=r"study\.variants\['wide'\].*ppo\.lora_rank = 4096 is invalid: above the "
                                         r"width of the policy's narrowest adapted layer"):
        expand(load_study(path), tmp_path)

"""Bad input to the manager ends in one line naming what is wrong, exit code 2, before any compute."""

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cli import main
from tests.conftest import REPO

SMOKE = str(REPO / "recipes" / "studies" / "smoke.gin")


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("binding, match", [
    ("study.metric = 'no/such_metric'", "study.metric = 'no/such_metric' is invalid"),
    ("study.metric = 'eval/acc'",
     "study.metric = 'eval/acc' is invalid: no run logs it (did you mean 'eval/accuracy'?)"),
    ("study.guardrails = {'no_such_metric': {'min': 0.5}}",
     "study.guardrails['no_such_metric'] is invalid: no run logs"),
])
def test_a_metric_no_run_logs_is_a_planning_error(capsys, tmp_path, binding, match):
    err = one_line_error(capsys, ["plan", SMOKE, "-b", binding, "--results", str(tmp_path)])
    assert match in err
    err = one_line_error(capsys, ["run", SMOKE, "-b", binding, "--results", str(tmp_path)])
    assert match in err and not (tmp_path / "smoke").exists()  # refused before anything ran


@pytest.mark.parametrize("binding, match", [
    ("study.analysis = 'paird'", "study.analysis = 'paird' is invalid: must be one of ('auto', 'paired', 'welch')"),
    ("study.equivalence_margin = -0.02", "study.equivalence_margin = -0.02 is invalid: must be a number >= 0 in "
                                         "the metric's units (0 turns the equivalence test off)"),
    ("study.equivalence_margin = [0.02]", "study.equivalence_margin = [0.02] is invalid: must be a number >= 0"),
])
def test_a_bad_analysis_or_margin_is_one_line_before_planning(capsys, tmp_path, binding, match):
    err = one_line_error(capsys, ["plan", SMOKE, "-b", binding, "--results", str(tmp_path)])
    assert match in err
    assert not (tmp_path / "smoke").exists()


def test_final_window_metric_must_be_one_the_engine_logs(capsys, tmp_path):
    err = one_line_error(capsys, ["plan", SMOKE, "-b", "study.metric_from = 'final_window'",
                                  "-b", "study.metric = 'no/such_metric'", "--results", str(tmp_path)])
    assert "no run logs it" in err and "rlhf/metrics.py" in err


def test_include_cycle_between_two_recipes_is_one_line(capsys, tmp_path):
    (tmp_path / "a.gin").write_text("include 'tiny.gin'\ninclude 'b.gin'\n")
    (tmp_path / "b.gin").write_text("include 'a.gin'\n")
    study = tmp_path / "s.gin"
    study.write_text(f"study.name = 's'\nstudy.baseline_recipe = {str(tmp_path / 'a.gin')!r}\nstudy.variants = {{}}\n")
    err = one_line_error(capsys, ["plan", str(study), "--results", str(tmp_path / "r")])
    assert "include cycle: a.gin -> b.gin -> a.gin" in err
    engine = subprocess.run([sys.executable, "-m", "rlhf.train", str(tmp_path / "a.gin"), "--out", str(tmp_path / "o")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert engine.returncode == 2 and engine.stderr.strip().count("\n") == 0
    assert "include cycle: a.gin -> b.gin -> a.gin" in engine.stderr


def test_study_file_with_an_include_cycle_is_one_line(capsys, tmp_path):
    (tmp_path / "s1.gin").write_text("include 's2.gin'\nstudy.name = 'x'\nstudy.variants = {}\n")
    (tmp_path / "s2.gin").write_text("include 's1.gin'\n")
    err = one_line_error(capsys, ["plan", str(tmp_path / "s1.gin"), "--results", str(tmp_path / "r")])
    assert "include cycle: s1.gin -> s2.gin -> s1.gin" in err


def test_unknown_study_binding_names_the_close_one(capsys, tmp_path):
    err = one_line_error(capsys, ["plan", SMOKE, "-b", "study.metrc = 'eval/accuracy'", "--results", str(tmp_path)])
    assert "did you mean study.metric?" in err


def test_unwritable_results_dir_is_one_line_before_ray(capsys, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the results dir should be")
    err = one_line_error(capsys, ["run", SMOKE, "-b", "ppo.total_steps = 1", "--results", str(blocker / "results")])
    assert "--results: cannot write" in err and str(blocker) in err


def test_vllm_runs_sharing_a_gpu_must_fit_their_share(capsys, tmp_path):
    err = one_line_error(capsys, ["plan", SMOKE, "-b", "study.gpus_per_run = 0.25",
                                  "-b", "ppo.rollout_backend = 'vllm'", "-b", "ppo.device = 'cuda'",
                                  "--results", str(tmp_path)])
    assert "ppo.vllm_gpu_memory_utilization = 0.3 does not fit study.gpus_per_run = 0.25" in err
    assert "4 runs share each GPU" in err
    err = one_line_error(capsys, ["plan", SMOKE, "-b", "study.gpus_per_run = 0.25",
                                  "-b", "ppo.rollout_backend = 'vllm'",
                                  "-b", "ppo.device = 'cuda'", "-b", "ppo.vllm_gpu_memory_utilization = 0.24",
                                  "--results", str(tmp_path)])
    assert "(4 x 0.24 = 0.96; the engines of one GPU may take 0.9 together" in err
    assert "set ppo.vllm_gpu_memory_utilization at most 0.225" in err
    fits = ["plan", SMOKE, "-b", "study.gpus_per_run = 0.25", "-b", "ppo.rollout_backend = 'vllm'",
            "-b", "ppo.device = 'cuda'", "-b", "ppo.vllm_gpu_memory_utilization = 0.2", "--results", str(tmp_path)]
    import importlib.util

    import torch
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        assert main(fits) == 0
    else:  # the share fits; this machine does not (test_new_flags.py)
        err = one_line_error(capsys, fits)
        assert "needs a GPU" in err or "needs the vllm package" in err


def test_a_required_binding_left_unset_is_one_line(capsys, tmp_path):
    from rlhf.configurable import resolve
    recipe = tmp_path / "needs_model.gin"
    recipe.write_text("include 'tiny.gin'\nmodel.name_or_path = %gin.REQUIRED  # the policy to tune\n")
    engine = subprocess.run([sys.executable, "-m", "rlhf.train", str(recipe), "--out", str(tmp_path / "o")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert engine.returncode == 2 and engine.stderr.strip().count("\n") == 0, engine.stderr
    assert "model.name_or_path is required: the recipe leaves it %gin.REQUIRED" in engine.stderr
    study = tmp_path / "s.gin"
    study.write_text(f"study.name = 's'\nstudy.baseline_recipe = {str(recipe)!r}\nstudy.variants = {{}}\n")
    err = one_line_error(capsys, ["plan", str(study), "--results", str(tmp_path / "r")])
    assert "model.name_or_path is required" in err
    cfg, _ = resolve(recipe, ["model.name_or_path = 'tiny'"])
    assert cfg.model.name_or_path == "tiny"


def test_a_variant_listed_twice_names_the_key_and_the_file(capsys, tmp_path):
    study = tmp_path / "s.gin"
    study.write_text("study.name = 's'\nstudy.variants = {\n    'kl': 'ppo.kl_coef = 0.1',\n"
                     "    'clip': 'ppo.clip_range = 0.1',\n    'kl': 'ppo.kl_coef = 0.2',\n}\n")
    err = one_line_error(capsys, ["plan", str(study), "--results", str(tmp_path / "r")])
    assert f"study.variants ({study}, line 5) lists the variant 'kl' twice" in err
    err = one_line_error(capsys, ["run", SMOKE,
                                  "-b", "study.variants = {'a': 'ppo.kl_coef = 0.1', 'a': 'ppo.kl_coef = 0.3'}",
                                  "--results", str(tmp_path / "r")])
    assert "study.variants (-b) lists the variant 'a' twice" in err and not (tmp_path / "r").exists()


def test_two_variants_with_the_same_runs_name_both(capsys, tmp_path):
    err = one_line_error(capsys, ["run", SMOKE,
                                  "-b", "study.variants = {'a': 'ppo.kl_coef = 0.1', 'b': 'ppo.kl_coef=0.10'}",
                                  "--results", str(tmp_path)])
    assert "study.variants['b'] and study.variants['a'] run the same configuration" in err
    assert not (tmp_path / "smoke").exists()


@pytest.mark.parametrize("files, expected", [
    ({"a.gin": "include 'tiny.gin'\nppo.seed = 1\nppo.kl_coef = [0.1, 0.2\n"},
     "cannot parse {a}:3: 'ppo.kl_coef = [0.1, 0.2': a bracket or quote is not closed"),
    ({"a.gin": "include 'b.gin'\n", "b.gin": "include 'tiny.gin'\nppo.kl_coef = [0.1,\nppo.seed = 1\n"},
     "cannot parse {b}:2: 'ppo.kl_coef = [0.1,': a bracket or quote is not closed"),
    ({"a.gin": "include 'tiny.gin'\nppo.kl_coef = %KL\n"},
     "macro %KL is not defined ({a}:2: 'ppo.kl_coef = %KL'); define it in the recipe (KL = VALUE) or with "
     "-b 'KL = VALUE'"),
], ids=["unclosed-at-the-end", "unclosed-in-an-include", "undefined-macro"])
def test_recipe_that_does_not_parse_is_one_line_naming_file_and_line(capsys, tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    expected = expected.format(**{Path(name).stem: tmp_path / name for name in files})
    engine = subprocess.run([sys.executable, "-m", "rlhf.train", str(tmp_path / "a.gin"), "--out", str(tmp_path / "o")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert engine.returncode == 2 and engine.stderr.strip() == f"error: {expected}", engine.stderr
    study = tmp_path / "s.gin"
    study.write_text(f"study.name = 's'\nstudy.baseline_recipe = {str(tmp_path / 'a.gin')!r}\nstudy.variants = {{}}\n")
    assert expected in one_line_error(capsys, ["plan", str(study), "--results", str(tmp_path / "r")])


def test_study_file_that_does_not_parse_is_one_line_naming_its_line(capsys, tmp_path):
    study = tmp_path / "s.gin"
    study.write_text("study.name = 's'\nstudy.variants = {\nstudy.seeds = 2\n")
    err = one_line_error(capsys, ["plan", str(study), "--results", str(tmp_path / "r")])
    assert err == f"error: cannot parse {study}:2: 'study.variants = {{': a bracket or quote is not closed"
    err = one_line_error(capsys, ["plan", SMOKE, "-b", "study.seeds = [1, 2", "--results", str(tmp_path / "r")])
    assert err == "error: cannot parse -b binding: 'study.seeds = [1, 2': a bracket or quote is not closed"


def test_a_directory_given_as_a_study_or_recipe_says_it_is_one(capsys, tmp_path):
    for command in ("plan", "run"):
        err = one_line_error(capsys, [command, str(tmp_path), "--results", str(tmp_path / "r")])
        assert err == (f"error: study file {str(tmp_path)!r} is a directory, not a file; expected a study recipe "
                       f"(.gin), e.g. recipes/studies/smoke.gin")
    engine = subprocess.run([sys.executable, "-m", "rlhf.train", str(tmp_path), "--out", str(tmp_path / "o")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert engine.returncode == 2 and engine.stderr.strip() == (
        f"error: recipe {str(tmp_path)!r} is a directory, not a file; expected a gin recipe file "
        f"(e.g. recipes/tiny.gin)"), engine.stderr


SEEDS_ALLOWED = ("must be a count 1..10000 or a non-empty list of at most 10000 distinct integers >= 0")


@pytest.mark.parametrize("seeds, shown", [
    ("100000", "100000"),
    ("list(range(10001))", "[0, 1, 2, ... 10000] (10001 seeds)"),
], ids=["count", "list"])
def test_more_seeds_than_a_plan_proposes_is_one_line_before_planning(capsys, tmp_path, seeds, shown):
    """study.seeds = 100000 planned for ~25 minutes, silently. A count or a list above stats.MAX_SEEDS
    (the most seeds per variant a seed plan proposes, and the advisor writes) is refused at once."""
    import time

    from experiments import stats, study
    assert study.MAX_SEEDS == stats.MAX_SEEDS == 10000
    value = seeds if seeds.isdigit() else repr(list(range(10001)))
    t0 = time.monotonic()
    err = one_line_error(capsys, ["plan", SMOKE, "-b", f"study.seeds = {value}", "--results", str(tmp_path)])
    assert time.monotonic() - t0 < 30
    assert err == (f"error: study.seeds = {shown} is invalid: at most 10000 seeds per variant (the most a seed plan "
                   f"proposes); {SEEDS_ALLOWED}")
    assert not (tmp_path / "smoke").exists()


def test_the_seed_cap_holds_for_seed_waves_and_the_cap_itself_is_allowed(capsys, tmp_path):
    from experiments.study import load_study
    err = one_line_error(capsys, ["plan", SMOKE, "-b", "study.sequential = {'max_seeds': 20000}",
                                  "--results", str(tmp_path)])
    assert err == "error: study.sequential['max_seeds'] = 20000 is invalid: must be an integer from 2 to 10000"
    assert len(load_study(SMOKE, ["study.seeds = 10000"]).seeds) == 10000
    assert load_study(SMOKE, ["study.sequential = {'max_seeds': 10000}"]).sequential.max_seeds == 10000


def test_many_seeds_plan_without_resolving_the_engine_config_per_seed(tmp_path, monkeypatch, capsys):
    """gin resolves a variant's first two seeds; the others' operative configs are the first's with
    their seed written in, the very text (so hashes) a full resolve gives. `plan` then prints one row
    per variant, with a notice, above PLAN_TABLE_RUNS runs."""
    import experiments.plan as plan
    from experiments.commands import PLAN_TABLE_RUNS
    from experiments.study import load_study
    calls = []
    resolve_config = plan.resolve_config
    monkeypatch.setattr(plan, "resolve_config", lambda *a: calls.append(a) or resolve_config(*a))
    study = load_study(SMOKE, ["study.seeds = [0, 5, 17, 123, 4096]"])
    fast = plan.expand(study, tmp_path)
    assert len(calls) == 1 + 2 * (1 + 2)  # the baseline's config, then per variant: its config and two seeds
    with_seed = plan._with_seed
    monkeypatch.setattr(plan, "_with_seed", lambda *a: None)  # no shortcut: gin resolves every seed
    full = plan.expand(study, tmp_path)
    assert [s.to_json() for s in fast] == [s.to_json() for s in full]
    assert "\nppo.seed = 4096\n" in fast[4].operative_config and fast[4].seed == 4096

    monkeypatch.setattr(plan, "_with_seed", with_seed)
    calls.clear()
    seeds = PLAN_TABLE_RUNS // 2 + 1
    assert main(["plan", SMOKE, "-b", f"study.seeds = {seeds}", "--results", str(tmp_path)]) == 0
    assert len(calls) == 1 + 2 * 3 + 1  # and the baseline once more: what its runs need of the machine
    out = capsys.readouterr().out
    assert f"notice: {2 * seeds} runs, more than {PLAN_TABLE_RUNS}: one row per variant" in out
    assert f"0..{seeds - 1} ({seeds})" in out and f"{seeds} start" in out


@pytest.mark.parametrize("bindings, ok", [
    # the margin at the smallest change of interest
    (["study.target_effect = 0.02", "study.equivalence_margin = 0.02"], True),
    (["study.target_effect = 0.05", "study.equivalence_margin = 0.03"], True),
    (["study.equivalence_margin = 0.05"], True),  # no target: nothing to overlap
    (["study.target_effect = 0.02", "study.equivalence_margin = 0.05"], False),
])
def test_an_equivalence_margin_wider_than_the_target_effect_is_refused(capsys, tmp_path, bindings, ok):
    """A margin says a difference within it is no difference; a target says one of its size must not be
    missed. A margin above the target would call a change worth detecting 'equivalent'."""
    from experiments.study import load_study
    argv = ["plan", SMOKE, *[x for b in bindings for x in ("-b", b)], "--results", str(tmp_path)]
    if ok:
        assert load_study(SMOKE, bindings).equivalence_margin == float(bindings[-1].split("=")[1])
        return
    err = one_line_error(capsys, argv)
    assert err == ("error: study.equivalence_margin = 0.05 is invalid with study.target_effect = 0.02: the margin "
                   "must be at most the target effect (a difference within +-margin counts as none, so a wider "
                   "margin would call a change worth detecting 'equivalent'); lower study.equivalence_margin to "
                   "<= 0.02 or raise study.target_effect")

"""The manager's module structure: layers that import only downward, so no import cycles, and
one name for each run state and each study file.

The layers, bottom first, as README ("Layout") draws them. A module imports from its own layer
or the layers below it, never above; every import counts, at the top of a module or deferred
inside a function (tests/import_graph.py).
"""

import ast

import pytest

from experiments.results import AGGREGATE, RunStatus
from tests.conftest import REPO
from tests.import_graph import cycles, import_graph, layer_violations, loaded_packages

LAYERS = (
    ("errors", "results", "stats", "paths", "storage", "sequential"),
    ("study", "overrides"),
    ("run_records",),
    ("resume_from", "gpu_fit", "plan", "seed_plan"),
    ("collect", "aggregate", "execute", "display", "wandb_sink", "watchdog", "launch"),
    ("report", "plots", "advisor", "stages", "heldout", "summary", "wandb_report", "driver"),
    ("commands", "confirm", "advisor.command", "cli", "__main__"),
)
"""0 the vocabulary (the one error and the exit codes, the result types with the run-status enum
and the run record, statistics and seed waves' design, paths as files record them, a results location's local copy) -> 1
declarations (the study) -> 2 what a run dir holds -> 3 the plan (where runs start, whether they fit
their GPU, specs and hashes, seeds planned for power) -> 4 runs launched, executed and read back,
and the aggregate -> 5 what is made of them (report, plots, the advisor, the pipeline stages, W&B
reports) and the driver of the fixed design and the seed waves -> 6 the command line, with the
confirmation stage (a study it runs as `run` does)."""


def test_the_manager_imports_only_downward():
    graph = import_graph("experiments")
    assert {"experiments.cli", "experiments.driver", "experiments.advisor.window", "experiments.errors"} <= set(graph)
    assert "experiments.commands" in graph["experiments.cli"]  # a subcommand's 'module:function' hook counts
    assert cycles(graph) == []
    assert layer_violations(graph, LAYERS, "experiments") == []
    # The check itself: an upward import, a module in no layer, and a longest-name match.
    toy = {"p.low": {"p.high"}, "p.high": {"p.low"}, "p.stray": set(), "p.sub.cmd": {"p.sub.x"}, "p.sub.x": set()}
    assert layer_violations(toy, (("low", "sub"), ("high", "sub.cmd")), "p") == [
        "p.low (layer 0) imports p.high (layer 1)", "p.stray: in no layer"]


RUN_STATES = {status.value for status in RunStatus}
FILES = {AGGREGATE: "experiments/results.py", "plan.json": "experiments/plan.py"}
"""A study file's name, written out by one module: every other one calls results.aggregate_path,
plan.plan_path."""


def state_strings(tree):
    """(line, string) of each run state written as a plain string where a state goes: compared
    (`status == 'completed'`, `in ('failed', ...)`), returned, assigned, passed, or a dict's
    'status' (a message that says 'failed' in words is not a state)."""
    spots = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            spots += [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            spots += [v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant) and k.value == "status"]
        elif isinstance(node, ast.Call):
            spots += [*node.args, *(k.value for k in node.keywords)]
        elif isinstance(node, (ast.Return, ast.Assign)) and node.value is not None:
            spots.append(node.value)
    spots += [e for spot in spots if isinstance(spot, (ast.Tuple, ast.List, ast.Set)) for e in spot.elts]
    return sorted((c.lineno, c.value) for c in spots if isinstance(c, ast.Constant) and c.value in RUN_STATES)


def test_each_run_state_and_study_file_is_written_out_once():
    """The run states are RunStatus's members (results.py), whose strings the files hold; the
    study files' names are each one module's."""
    found = []
    for path in sorted((REPO / "experiments").rglob("*.py")):
        where = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        if where != "experiments/results.py":
            found += [f"{where}:{line}: {value!r}" for line, value in state_strings(tree)]
        found += [f"{where}:{n.lineno}: {n.value!r}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and n.value in FILES and FILES[n.value] != where]
    assert found == []
    assert f"{RunStatus.FAILED}" == "failed" and RunStatus("stale") is RunStatus.STALE  # the files' strings
    caught = state_strings(ast.parse("if r.status in ('done', 'failed'):\n    show(key, 'running')\n"
                                     "x = {'status': 'stale', 'why': 'failed'}\nsay(f'{n} failed')\n"))
    assert caught == [(1, "failed"), (2, "running"), (3, "stale")]


@pytest.mark.parametrize("module", ["experiments.errors", "experiments.sequential", "experiments.run_records",
                                    "experiments.plan", "experiments.driver", "experiments.advisor.command"])
def test_each_module_imports_on_its_own_without_the_engines_heavy_parts(module):
    """Each imports alone, and planning, status and the verdicts load no torch, transformers, Ray,
    W&B, DVC or plotting: those come with the commands that run, log or draw."""
    loaded = loaded_packages(module)
    assert "experiments" in loaded  # the check sees what was loaded
    assert loaded & {"torch", "transformers", "ray", "wandb", "dvc", "vllm", "matplotlib"} == set()

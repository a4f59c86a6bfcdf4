"""The manager's module structure: layers that import only downward, so no import cycles.

The layers, bottom first, as README ("Layout") draws them. A module imports from its own layer
or the layers below it, never above; every import counts, at the top of a module or deferred
inside a function (tests/import_graph.py).
"""

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.import_graph import cycles, import_graph, layer_violations

LAYERS = (
    ("errors", "results", "stats", "paths"),
    ("study", "adaptive"),
    ("rundir",),
    ("resume_from", "gpu_fit", "plan", "seed_plan"),
    ("collect", "aggregate", "execute", "display", "wandb_sink", "watchdog", "launch"),
    ("report", "plots", "advisor", "stages", "wandb_report", "driver"),
    ("commands", "advisor.command", "cli", "__main__"),
)
"""0 the vocabulary (the one error and the exit codes, the result types with the run-status enum
and the run record, statistics, paths as files record them) -> 1 declarations (the study, adaptive
seeds' stopping rule) -> 2 what a run dir holds -> 3 the plan (where runs start, whether they fit
their GPU, specs and hashes, seeds planned for power) -> 4 runs launched, executed and read back,
and the aggregate -> 5 what is made of them (report, plots, the advisor, the pipeline stages, W&B
reports) and the driver of the fixed and adaptive loops -> 6 the command line."""


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


@pytest.mark.parametrize("module", ["experiments.errors", "experiments.adaptive", "experiments.rundir",
                                    "experiments.plan", "experiments.driver", "experiments.advisor.command"])
def test_each_module_imports_on_its_own(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]

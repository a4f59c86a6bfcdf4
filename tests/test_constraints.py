"""The version lock: `constraints.txt` pins every package of the project's install closure, and the
README's two commands and CI install through it."""

import importlib.util
import re
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent


def _pins() -> dict:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_every_package_of_the_install_closure_is_pinned():
    spec = importlib.util.spec_from_file_location("constraints", REPO / ".ci" / "constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pins = _pins()
    made_with = re.search(r"\(Python (\d+)\.(\d+)\)", (REPO / "constraints.txt").read_text().splitlines()[0])
    if made_with and tuple(map(int, made_with.groups())) == sys.version_info[:2]:  # markers evaluate alike
        closure = module.closure(module.ROOT, module.EXTRAS)
        assert set(closure) - set(pins) == set(), (
            "unpinned: regenerate with python .ci/constraints.py > constraints.txt")
    for name in ("torch", "transformers", "tokenizers", "safetensors", "gin-config", "dvc", "wandb", "peft"):
        assert name in pins and pins[name][0].isdigit()
    assert pins["torch"] == "2.13.0"


def test_the_readme_and_ci_install_through_the_lock():
    head = (REPO / "README.md").read_text().split("```")[1]
    commands = [line for line in head.splitlines() if "pip install" in line]
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line)
    assert len(commands) == 2 and all("-c constraints.txt -e '.[dev]'" in c for c in commands)
    assert all(c.startswith(f"pip install torch=={pins['torch']} && ") for c in commands)  # torch first, pinned
    assert "-c constraints.txt -e '.[dev]'" in (REPO / ".ci" / "run").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in (REPO / "README.md").read_text()  # the CPU wheel

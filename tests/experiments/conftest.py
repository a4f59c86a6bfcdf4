"""Shared helpers: write small study files next to the test's tmp dir."""

from __future__ import annotations

import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def write_study(tmp_path):
    """write_study(text, name='s.gin') -> path of a study file in tmp_path."""
    def write(text: str, name: str = "s.gin") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path
    return write


@pytest.fixture
def workdir():
    """A private temporary directory for slow tests: pytest's numbered tmp dirs are pruned by any
    other pytest session on the machine, which could delete a study's results mid-test."""
    path = Path(tempfile.mkdtemp(prefix="experiments-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)

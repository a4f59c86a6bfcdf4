"""Shared helpers: write small study files next to the test's tmp dir."""

from __future__ import annotations

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

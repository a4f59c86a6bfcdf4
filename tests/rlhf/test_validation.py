"""The validator vocabulary every config shares (rlhf/validation.py)."""

from __future__ import annotations

import pytest

from rlhf.errors import ConfigError
from rlhf.validation import check, choice, number, positive_int


def test_validators_name_the_binding_and_what_is_allowed():
    check(True, "x.y", 1, "anything")
    with pytest.raises(ConfigError, match=r"^x\.y = 1 is invalid: must be fine$"):
        check(False, "x.y", 1, "must be fine")
    with pytest.raises(ConfigError, match=r"must be an integer >= 1"):
        positive_int("x", "n", True)
    with pytest.raises(ConfigError, match=r"must be a number in \(0\.0, 1\.0\]"):
        number("x", "p", 0.0, 0.0, 1.0, lo_open=True)
    with pytest.raises(ConfigError, match=r"must be one of 'a', 'b'"):
        choice("x", "c", "z", ("a", "b"))


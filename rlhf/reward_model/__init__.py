"""Reward models: scoring (`score.py`), training (`train.py`, `python -m rlhf.reward_model`), and
the preference pairs of the embedded default (`pairs.py`)."""

"""The tuning advisor: the rules of the tuning guide (docs/tuning_guide.md) read a study's curves
and propose the next round.

window.py (the evidence) -> rules.py (the guide's rules) -> advise.py (rank, one per parameter)
-> recipe.py (the next study's .gin) -> command.py (`python -m experiments advise`).
"""

from experiments.advisor.advise import Advice, advise, build_rules
from experiments.advisor.rules import RULES, Rule, Suggestion
from experiments.advisor.window import AdviceError, Window, load_window

__all__ = ["Advice", "AdviceError", "RULES", "Rule", "Suggestion", "Window", "advise", "build_rules",
           "load_window"]

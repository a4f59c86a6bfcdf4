"""Advise: apply the rules to a window, rank their suggestions, one per parameter.

The guide's closing advice is "change one parameter at a time", so the advisor never merges
suggestions: each becomes one variant of the next study (a bracket, one variant per value).
When two rules touch the same parameter (a sawtooth and a high variance both lower the actor LR;
memory and utilisation both move the rollout batch) the one further past its threshold is kept,
unless the other declares that it outranks it (`Rule.outranks`: over-optimisation replaces the
plain KL-too-high step), and the other is reported as `superseded`, so the evidence is not lost.
A change the study already settled (a variant that set the same value was found equivalent or
worse: `Window.settled`) is not proposed again: it is reported as `settled`, and the next
suggestion for that parameter, if any, takes its place.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from experiments.advisor.rules import GROUPS, RULES, Rule, Suggestion
from experiments.advisor.window import AdviceError, Window

RULES_BY_NAME: Dict[str, Rule] = {r.name: r for r in RULES}


def parse_threshold(text: str) -> Tuple[str, str, float]:
    """'kl_high.kl_max=0.2' -> ('kl_high', 'kl_max', 0.2); errors name what is allowed."""
    key, sep, value = text.partition("=")
    rule, dot, field = key.strip().partition(".")
    if not sep or not dot:
        raise AdviceError(f"--threshold {text!r} is invalid: expected RULE.PARAMETER=NUMBER, e.g. kl_high.kl_max=0.2")
    try:
        number = float(value)
    except ValueError:
        raise AdviceError(f"--threshold {text!r}: {value.strip()!r} is not a number") from None
    return rule, field.strip(), number


def build_rules(overrides: Optional[Mapping[str, Mapping[str, float]]] = None, groups: Optional[Sequence[str]] = None,
                names: Optional[Sequence[str]] = None) -> List[Rule]:
    """The default rules with thresholds overridden ({rule: {field: value}}), restricted to `groups`
    and/or rule `names`. Unknown names raise AdviceError listing what exists."""
    for group in groups or ():
        if group not in GROUPS:
            raise AdviceError(f"group {group!r} is unknown; allowed: {', '.join(GROUPS)}")
    for name in list(names or ()) + list(overrides or {}):
        if name not in RULES_BY_NAME:
            raise AdviceError(f"rule {name!r} is unknown; allowed: {', '.join(RULES_BY_NAME)}")
    out = []
    for rule in RULES:
        if (groups and rule.group not in groups) or (names and rule.name not in names):
            continue
        changes = dict((overrides or {}).get(rule.name, {}))
        fields = {f.name: f for f in dataclasses.fields(rule)}
        for key, value in changes.items():
            if key not in fields:
                raise AdviceError(f"{rule.name}.{key} is not a threshold of rule {rule.name!r}; allowed: "
                                  f"{', '.join(fields) or 'none'}")
            if fields[key].type in (int, "int"):
                changes[key] = int(value)
        out.append(dataclasses.replace(rule, **changes))
    return out


@dataclasses.dataclass
class Advice:
    """What `advise` found: ranked changes, flags, and the suggestions a stronger one superseded."""

    changes: List[Suggestion]
    warnings: List[Suggestion]
    superseded: List[Suggestion]
    silent: List[str]
    """The rules that checked and found nothing to change (or lacked their metrics)."""
    variant: str = ""
    settled: List[Tuple[Suggestion, str]] = dataclasses.field(default_factory=list)
    """(suggestion, why) for the changes the study already settled: not proposed again."""

    def variants(self, limit: Optional[int] = None) -> List[Tuple[Suggestion, str, str]]:
        """(suggestion, variant name, binding) of every change in rank order, a bracket's values
        one after another; the first `limit` of them when given (a round's variant budget)."""
        out = [(s, name, binding) for s in self.changes for name, binding in s.variants]
        return out[:limit] if limit is not None else out

    def to_json(self) -> dict:
        return {"variant": self.variant, "changes": [s.to_json() for s in self.changes],
                "warnings": [s.to_json() for s in self.warnings],
                "superseded": [s.to_json() for s in self.superseded], "silent": list(self.silent),
                "settled": [{**s.to_json(), "why": why} for s, why in self.settled]}


def advise(window: Window, rules: Iterable[Rule] = RULES) -> Advice:
    """Every rule's verdict on `window`: changes ranked by severity, one per parameter; flags apart."""
    fired, silent, outranks = [], [], {}
    for rule in rules:
        suggestion = rule.check(window)
        (fired.append(suggestion) if suggestion else silent.append(rule.name))
        outranks[rule.name] = rule.outranks
    ranked = sorted(fired, key=lambda s: -s.severity)
    settled = [(s, window.settled[(s.parameter, s.proposed)]) for s in ranked
               if not s.is_warning and (s.parameter, s.proposed) in window.settled]
    open_ = [s for s in ranked if not any(s is t for t, _ in settled)]
    by_parameter: Dict[str, List[Suggestion]] = {}
    for s in open_:
        if not s.is_warning:
            by_parameter.setdefault(s.parameter, []).append(s)
    kept = []
    for group in by_parameter.values():
        beaten = {name for s in group for name in outranks.get(s.rule, ())}
        kept.append(next((s for s in group if s.rule not in beaten), group[0]))
    changes = [s for s in open_ if any(s is k for k in kept)]
    superseded = [s for s in open_ if not s.is_warning and not any(s is k for k in kept)]
    return Advice(changes=changes, warnings=[s for s in ranked if s.is_warning], superseded=superseded,
                  silent=silent, variant=window.variant, settled=settled)

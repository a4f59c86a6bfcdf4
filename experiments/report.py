"""Report: aggregate.json for machines, report.md and plots for people.

Reads the launched plan and the run dirs (via `collect`), aggregates (`aggregate`), then
writes RESULTS/<study>/aggregate.json, report.md and plots/*.png. Rendering is a pure function
of the aggregate dict, so a report can be re-rendered from aggregate.json alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

from experiments.aggregate import aggregate
from experiments.collect import RunResult, collect, load_plan
from experiments.plan import RunSpec
from experiments.plots import plot_study
from experiments.rundir import read_json, write_json
from experiments.study import BASELINE, Study


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _ci(pair) -> str:
    if not pair or pair[0] is None:
        return "–"
    return f"[{_fmt(pair[0])}, {_fmt(pair[1])}]"


def provenance_summary(specs: Sequence[RunSpec]) -> Dict:
    """What the runs ran on, from the first run dir with an engine provenance.json."""
    out: Dict = {}
    if specs:
        out["code_version"] = specs[0].code_version
        out["data_sha256"] = sorted({s.data_hash for s in specs})
        out["init_from"] = sorted({s.init_from for s in specs if s.init_from})
        out["recipe"] = specs[0].recipe
    for s in specs:
        prov = read_json(Path(s.run_dir) / "provenance.json")
        if prov and "versions" in prov:
            out["versions"] = prov.get("versions")
            hw = prov.get("hardware") or {}
            out["hardware"] = {k: hw.get(k) for k in ("hostname", "platform", "cpu", "cpu_count", "cuda", "gpus",
                                                      "driver") if hw.get(k) is not None}
            out["manager_command"] = (prov.get("manager") or {}).get("manager_command")
            break
    return out


def render(agg: Dict, plots: Dict[str, str]) -> str:
    """report.md text from an aggregate dict and the plots written."""
    metric = f"{agg['metric_from']} {agg['metric']} ({agg['direction']} is better)"
    lines = [f"# Study `{agg['study']}`", ""]
    if agg.get("description"):
        lines += [agg["description"], ""]
    d = agg["decision"]
    lines += [f"**Decision:** `{d['chosen']}`: {d['reason']}.", "",
              f"Metric: {metric}; seeds: {agg['seeds']}; alpha {agg['alpha']:g} (Welch's t-test, "
              f"Holm-corrected across {max(0, len(agg['variants']) - 1)} variant(s)); a variant's 95% CI: "
              f"percentile bootstrap; the difference's: Welch's t interval (uncorrected).", ""]
    if d["guardrail_violations"]:
        lines += [f"**Guardrail violations:** {', '.join(d['guardrail_violations'])}.", ""]
    lines += ["## Decision table", "",
              "| variant | change | n | mean | std | SE | median | IQM | 95% CI | difference [95% CI] | "
              "p (Holm) | Hedges' g | P(improve) | MDE | seeds needed | verdict |",
              "|" + "---|" * 16]
    for name, v in agg["variants"].items():
        s, c = v["summary"], v.get("comparison") or {}
        change = "; ".join(v["bindings"]) or "–"
        if v.get("coupled"):
            change += " (coupled)"
        verdict = v["verdict"] + (" (underpowered)" if v.get("underpowered") else "")
        if not v["guardrails_ok"]:
            verdict += " ⚠ guardrail"
        diff = f"{_fmt(c.get('difference'))} {_ci(c.get('difference_ci95'))}" if c else "–"
        lines.append(f"| {name} | `{change}` | {s['n']}/{len(v['runs'])} | {_fmt(s['mean'])} | {_fmt(s['std'])} | "
                     f"{_fmt(s['se'])} | {_fmt(s['median'])} | {_fmt(s['iqm'])} | {_ci(s['ci95'])} | {diff} | "
                     f"{_fmt(c.get('p_value_holm'))} | {_fmt(c.get('hedges_g'), 3)} | "
                     f"{_fmt(c.get('prob_improvement'), 3)} | {_fmt(c.get('min_detectable_effect'))} | "
                     f"{_fmt(c.get('seeds_needed'))} | {verdict} |")
    lines += [""]
    for name, v in agg["variants"].items():
        if v.get("explanation"):
            lines.append(f"- `{name}`: {v['verdict']}: {v['explanation']}.")
    lines += ["", "## Per-seed values", "", "| variant | seed | status | value | steps | error |", "|---|---|---|---|---|---|"]
    for name, v in agg["variants"].items():
        for r in v["runs"]:
            lines.append(f"| {name} | {r['seed']} | {r['status']} | {_fmt(r['value'])} | {_fmt(r['steps'])} | "
                         f"{(r['error'] or '').replace('|', '/')[:160]} |")
    if agg["guardrails"]:
        lines += ["", "## Guardrails (final-window values)", "",
                  "| variant | guardrail | per-seed values | violated seeds |", "|---|---|---|---|"]
        for name, v in agg["variants"].items():
            for metric, g in v["guardrails"].items():
                vals = ", ".join(f"{k}: {_fmt(x)}" for k, x in g["values"].items()) or "–"
                bad = ", ".join(map(str, g["violated_seeds"])) or "none"
                lines.append(f"| {name} | {g['bound']} | {vals} | {'⚠ ' if not g['ok'] else ''}{bad} |")
    if plots:
        lines += ["", "## Curves (mean ± std over seeds)", ""]
        lines += [f"![{stem}]({path})" for stem, path in plots.items()]
    prov = agg.get("provenance") or {}
    if prov:
        code = prov.get("code_version") or {}
        lines += ["", "## Provenance", "",
                  f"- code: git {code.get('git_sha') or 'none'}{' (dirty)' if code.get('dirty') else ''}, "
                  f"engine files sha256 {str(code.get('engine_sha256'))[:16]}",
                  f"- recipe: {prov.get('recipe')}; data sha256: {', '.join(h[:16] for h in prov.get('data_sha256', []))}"]
        if prov.get("init_from"):
            lines.append(f"- started from: {', '.join(prov['init_from'])}")
        if prov.get("versions"):
            lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v))
        if prov.get("hardware"):
            lines.append("- hardware: " + ", ".join(f"{k} {v}" for k, v in prov["hardware"].items()))
        if prov.get("manager_command"):
            lines.append("- command: `" + " ".join(prov["manager_command"]) + "`")
        lines.append("- each run dir holds config.gin, provenance.json (full), metrics.jsonl, summary.json")
    return "\n".join(lines) + "\n"


def write_report(study: Study, study_dir: Path, specs: Optional[List[RunSpec]] = None) -> Dict:
    """Collects, aggregates and writes aggregate.json, report.md and plots; returns the aggregate."""
    specs = specs if specs is not None else load_plan(study_dir)
    results: List[RunResult] = collect(specs, study)
    agg = aggregate(study, results, provenance_summary(specs))
    plots = plot_study(study.name, results, study_dir / "plots")
    agg["plots"] = plots
    write_json(study_dir / "aggregate.json", agg)
    (study_dir / "report.md").write_text(render(agg, plots))
    return agg

"""Plots: mean +- std (ddof = 1, as the report's tables) bands over seeds, one line per variant,
per metric the guide reads; a step fewer than two seeds logged has no band.

matplotlib with the Agg backend (no display needed). One PNG per figure under
RESULTS/<study>/plots/; the report embeds them by relative path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.collect import band, curves  # noqa: E402
from experiments.results import RunOutcome, RunStatus  # noqa: E402
from rlhf.atomic import write_atomic  # noqa: E402
from rlhf.metrics import SIGNALS  # noqa: E402

SIDE_BY_SIDE = {"clip_fraction": "clip_fractions", "clip_fraction_lower": "clip_fractions",
                "clip_fraction_upper": "clip_fractions"}
"""{signal: the figure it shares}: the clip fraction beside its two sides."""
NOT_PLOTTED = ("rollout_success_rate",)
"""Signals no figure draws: the rollout success rate, a guardrail near 1, is in the report's guardrail
table per seed."""


def _figures() -> Dict[str, List[str]]:
    figures: Dict[str, List[str]] = {}
    for signal in SIGNALS:
        if signal not in NOT_PLOTTED:
            figures.setdefault(SIDE_BY_SIDE.get(signal, signal.replace("/", "_")), []).append(signal)
    return figures


FIGURES = _figures()
"""{file stem: metrics drawn side by side in that figure}, in `SIGNALS` order."""


def plot_study(study_name: str, results: Sequence[RunOutcome], out_dir: Path) -> Dict[str, str]:
    """Writes the figures; returns {file stem: path relative to the study dir} of those drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = sorted({m for ms in FIGURES.values() for m in ms})
    variants: Dict[str, List[dict]] = {}
    for r in results:
        if r.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.INTERRUPTED):
            variants.setdefault(r.variant, []).append(curves(r.run_dir, metrics))
    written = {}
    for stem, names in FIGURES.items():
        fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.6), squeeze=False)
        drawn = False
        for ax, metric in zip(axes[0], names):
            for i, (variant, per_run) in enumerate(variants.items()):
                steps, mean, std = band([c[metric] for c in per_run if len(c[metric][0])])
                if not len(steps):
                    continue
                drawn = True
                color = f"C{i % 10}"
                marker = "o" if len(steps) <= 12 else None
                ax.plot(steps, mean, color=color, marker=marker, label=f"{variant} (n={len(per_run)})")
                ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
            ax.set_title(metric)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        if drawn:
            axes[0][0].legend(fontsize="small")
            fig.suptitle(f"{study_name}: mean ± std (ddof = 1) over seeds", fontsize="medium")
            fig.tight_layout()
            path = out_dir / f"{stem}.png"
            write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
            written[stem] = f"{out_dir.name}/{path.name}"
        plt.close(fig)
    return written

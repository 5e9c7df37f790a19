"""Every figure ulfmtrain draws (matplotlib, imported only when a figure is drawn: a `tools` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..core.extras import require
from .lost_time import COMPONENT_LABELS, COMPONENTS, fmt_s


def pyplot() -> Any:
    """Return matplotlib.pyplot on the Agg backend (no display on a compute node)."""
    require("matplotlib", "drawing figures").use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write a figure as PNG, release it, and return the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return Path(path)


def plot_loss(curves: dict[str, list[tuple[int, float]]], path: str | Path,
              kills: dict[str, list[int]] | None = None, title: str = "training loss",
              smooth: int = 20) -> Path:
    """Plot loss against step for several runs, marking kill steps."""
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for label, pts in curves.items():
        if pts:
            steps, losses = np.array(pts).T
            # Per-batch losses are noisy: show them faintly under a moving average.
            line, = ax.plot(steps, losses, lw=0.6, alpha=0.3)
            w = min(smooth, len(losses))
            ax.plot(steps[w - 1:], np.convolve(losses, np.ones(w) / w, mode="valid"),
                    color=line.get_color(), lw=1.6, label=label)
    for steps in (kills or {}).values():
        for s in steps:
            ax.axvline(s, color="red", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, path)


def plot_timeline(report: dict[str, Any], path: Path) -> Path:
    """Committed steps against wall time since launch, one line per run, kills marked."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for label, r in report["runs"].items():
        if not r.get("ok"):
            continue
        t, s = zip(*r["progress"])
        line, = ax.plot(t, s, lw=1.2, label=label, drawstyle="steps-post")
        for tk in r["kill_times_s"]:
            ax.axvline(tk, color=line.get_color(), ls=":", lw=0.8)
            before = [st for tt, st in r["progress"] if tt <= tk]
            ax.plot([tk], [before[-1] if before else 0], "x", color="red", ms=8, mew=2)
    ax.plot([], [], "x", color="red", label="SIGKILL")
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("committed steps")
    ax.set_title(f"progress: {report['job']['description']}")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_lost(report: dict[str, Any], path: Path) -> Path:
    """Stacked horizontal bars of the lost time per failure, by component."""
    runs = [(label, r) for label, r in report["runs"].items() if r.get("ok") and r["failures"]]
    fig, ax = pyplot().subplots(figsize=(8, 0.6 * len(runs) + 1.8))
    for i, (_label, r) in enumerate(runs):
        left = 0.0
        for j, c in enumerate(COMPONENTS):
            v = r["lost_breakdown_s"][c]
            ax.barh(i, v, left=left, color=f"C{j}", label=COMPONENT_LABELS[c] if i == 0 else None)
            left += v
        ax.text(left, i, "  " + fmt_s(left), va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [label for label, _ in runs])
    ax.invert_yaxis()
    ax.set_xlabel("lost time per failure (s)")
    ax.set_xlim(0, max((r["lost_per_failure_s"] for _, r in runs), default=1) * 1.25)
    ax.set_title("where the time of a failure goes")
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)

"""Per-rank JSONL metrics, run summaries and loss plots."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np


class MetricsWriter:
    """Append one JSON object per line to OUT/rank<world rank>.jsonl.

    Each line is flushed as written, so a rank killed by SIGKILL leaves every
    line it finished.
    """

    def __init__(self, out_dir: str | Path, world_rank: int) -> None:
        self.path = Path(out_dir) / f"rank{world_rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.world_rank = world_rank
        self._f = open(self.path, "a", buffering=1)

    def __call__(self, event: str, **fields: Any) -> None:
        fields = {"event": event, "rank": self.world_rank, "t": time.time(), **fields}
        self._f.write(json.dumps(fields) + "\n")

    def close(self) -> None:
        self._f.close()


def read_rank_logs(out_dir: str | Path) -> dict[int, list[dict]]:
    """Return every rank's records, keyed by world rank."""
    logs = {}
    for p in sorted(Path(out_dir).glob("rank*.jsonl")):
        logs[int(p.stem[4:])] = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return logs


def loss_curve(records: list[dict]) -> list[tuple[int, float]]:
    """(step, loss) of one rank's step records."""
    return [(r["step"], r["loss"]) for r in records if r["event"] == "step"]


def pyplot() -> Any:
    """Return matplotlib.pyplot on the Agg backend (no display on a compute node)."""
    import matplotlib
    matplotlib.use("Agg")
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
    for label, steps in (kills or {}).items():
        for s in steps:
            ax.axvline(s, color="red", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, path)

"""The demo's PNG plots, drawn with matplotlib's Agg backend (no display needed).

- ``ttft.png``: the distribution (empirical CDF) of TTFT per class and arm;
- ``timeline.png``: through the proxy, per engine over the run: the turn, the prefill
  budget and the batch prompt tokens in prefill, and the batch requests queued in the
  proxy, from ``GET /turn`` sampled during the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TURNS = ("idle", "interactive", "batch", "saturated")


def ttft_plot(path: Path, series: Mapping[str, Sequence[float]]) -> None:
    """``series``: a label (class and arm) → its TTFTs in seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in series.items():
        ordered = sorted(values)
        if not ordered:
            continue
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT per class and arm")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_plot(path: Path, samples: Sequence[dict[str, Any]]) -> None:
    """``samples``: ``{"t": seconds from the start, "engines": GET /turn's list}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({e["engine"] for s in samples for e in s["engines"]})
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    for name in names:
        points = [(s["t"], e) for s in samples for e in s["engines"] if e["engine"] == name]
        t = [p[0] for p in points]
        axes[0].step(t, [TURNS.index(e["turn"]) for _, e in points], where="post", label=name)
        axes[1].plot(t, [e["budget"]["tokens"] for _, e in points], label=f"{name} budget")
        prefill = [e["prefill_tokens"]["batch"] for _, e in points]
        axes[1].plot(t, prefill, linestyle=":", label=f"{name} batch in prefill")
        axes[2].plot(t, [e["queued"]["batch"] for _, e in points], label=name)
    axes[0].set_yticks(range(len(TURNS)), TURNS)
    axes[0].set_title("whose turn, through the proxy")
    axes[1].set_ylabel("prompt tokens")
    axes[2].set_ylabel("batch queued in proxy")
    axes[2].set_xlabel("seconds from the start of the arm")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""PNG plots of `amoe bench compare` (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput_vs_itl(points: list[dict[str, Any]], path: Path) -> None:
    """Mean ITL against output throughput, one line per swept config, one panel per group (paper Fig. 9–11)."""
    plt = _pyplot()
    groups = sorted({pt["group"] for pt in points}, key=lambda g: g != "main")
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, group in zip(axes[0], groups):
        sweep = [pt for pt in points if pt["group"] == group and pt["kind"] == "sweep"]
        for config in dict.fromkeys(pt["config"] for pt in sweep):
            line = sorted((pt for pt in sweep if pt["config"] == config), key=lambda pt: pt["rate"])
            line = [pt for pt in line if pt["itl_ms_mean"] is not None]
            ax.plot([pt["throughput"] for pt in line], [pt["itl_ms_mean"] for pt in line], "o-", label=config)
        for pt in (pt for pt in points if pt["group"] == group and pt["kind"] in ("policy", "policy_max")):
            if pt["itl_ms_mean"] is not None:
                where = "max" if pt["kind"] == "policy_max" else f"{pt['rate']:.0f} req/s"
                ax.plot(pt["throughput"], pt["itl_ms_mean"], "s", label=f"{pt['setup']['policy']} @ {where}")
        ax.set_xlabel("output tokens/s (emulated)")
        ax.set_ylabel("mean ITL (ms, emulated)")
        ax.set_title(group)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_queue_depth(points: list[dict[str, Any]], path: Path) -> None:
    """Tokens in all μ-queues over time for the policy runs (paper Fig. 7); the AEP sweep when there are none."""
    plt = _pyplot()
    chosen = [pt for pt in points if pt["kind"] == "policy"] or [
        pt for pt in points if pt["setup"]["mode"] == "aep" and pt["group"] == "main"
    ]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for pt in chosen:
        series = pt.get("queue") or []
        label = f"{pt['config']} @ {pt['rate']:.0f} req/s"
        ax.plot([t for t, _ in series], [q for _, q in series], label=label)
    ax.set_xlabel("time (s, emulated)")
    ax.set_ylabel("tokens queued (all μ-queues)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

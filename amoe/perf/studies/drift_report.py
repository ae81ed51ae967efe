"""The drift benchmark's figures from its runs (amoe.perf.studies.drift): tokens/s over time, the lowest one-second
rate during each rebalance against the rate before it, and the rate after the drift against the placement computed
for the new routing — with the targets of experiments/2026-11-29-drift/RULES.md. Emulated: amoe against its own
cost model, not a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

WINDOW_S = 1.0  # the one-second rate
STEP_S = 0.05  # where sliding windows start
BEFORE_S = 2.0  # the rate before a rebalance: over this long, up to its start
SETTLE_S = 1.0  # the start-up's first emulated second counts in no rate
DIP_TARGET = 0.95  # live rebalancing never drops below this of the rate before a move
RECOVERY_TARGET = 0.90  # and recovers at least this of the gain the new placement gives
CLOSE = 0.01  # a figure this near its target is a close call (RULES.md)
MEASURABLE_GAIN = 0.03  # a gain below this fraction of the reference's rate is within the run's noise


BIN_S = 0.001  # token arrivals are kept per emulated millisecond (drift.json stays small; every rate is taken on them)


def binned(tokens: list) -> list[tuple[float, int]]:
    """(the start of each emulated millisecond with arrivals, its output tokens), ascending."""
    bins: dict[int, int] = {}
    for t, n in tokens:
        key = int(t // BIN_S)
        bins[key] = bins.get(key, 0) + n
    return [(round(k * BIN_S, 6), n) for k, n in sorted(bins.items())]


def rate(tokens: list, start: float, end: float) -> float:
    """Output tokens per emulated second over [start, end)."""
    if end <= start:
        return float("nan")
    return sum(n for t, n in tokens if start <= t < end) / (end - start)


def sliding(tokens: list, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
    """(window starts, one-second rates) for every window inside [start, end]."""
    starts = np.arange(start, end - WINDOW_S + 1e-9, STEP_S)
    times = np.array([t for t, _ in tokens])
    counts = np.array([n for _, n in tokens], dtype=np.float64)
    cum = np.concatenate([[0.0], np.cumsum(counts[np.argsort(times, kind="stable")])])
    ordered = np.sort(times)
    lo = np.searchsorted(ordered, starts, side="left")
    hi = np.searchsorted(ordered, starts + WINDOW_S, side="left")
    return starts, (cum[hi] - cum[lo]) / WINDOW_S


def dips(run: dict, setup) -> list[dict[str, float]]:
    """Each rebalance that started in the measured period: the lowest one-second rate over the windows it
    overlaps, and the rate over the BEFORE_S before it."""
    out = []
    starts, rates = sliding(run["tokens"], SETTLE_S, setup.end_s)
    for a, b in run["rebalance_spans"]:
        if a < setup.warmup_s or b > setup.end_s:
            continue
        touching = (starts < b) & (starts + WINDOW_S > a)
        if not touching.any():
            continue
        before = rate(run["tokens"], max(SETTLE_S, a - BEFORE_S), a)
        if not before > 0:  # nothing served before it (or no time to serve it in): no ratio to take
            continue
        lowest = float(rates[touching].min())
        out.append({"start_s": a, "end_s": b, "lowest": lowest, "before": before, "ratio": lowest / before})
    return out


def summarise(setup, runs: list[dict]) -> dict[str, Any]:
    """Per variant: rates before and after the drift and its rebalances' dips; then the figures and targets."""
    half = setup.end_s - setup.after_s / 2
    variants = {}
    for run in runs:
        d = dips(run, setup)
        variants[run["variant"]] = {
            "mode": run["mode"],
            "before_drift": rate(run["tokens"], setup.warmup_s, setup.drift_s),
            "after_drift": rate(run["tokens"], half, setup.end_s),
            "rebalances_measured": len(d),
            "worst_dip": min((x["ratio"] for x in d), default=None),
            "dips": d,
            "placement": run["placement"],
            "wall_s": run["wall_s"],
        }
    return {"variants": variants, "figures": figures(variants)}


def figures(v: dict) -> dict[str, Any]:
    """The benchmark's lines (RULES.md), where the variants they need ran."""
    out: dict[str, Any] = {}
    if "live" in v:
        dip = v["live"]["worst_dip"]
        out["live_worst_dip"] = dip
        out["live_dip_target"] = _verdict(dip, DIP_TARGET)
    if {"static", "live", "reference"} <= set(v):
        static, live, ref = (v[k]["after_drift"] for k in ("static", "live", "reference"))
        gain = ref - static
        out["gain_of_new_placement"] = gain / static if static else None
        out["live_after_vs_reference"] = live / ref if ref else None
        out["static_after_vs_reference"] = static / ref if ref else None
        if ref and gain >= MEASURABLE_GAIN * ref:
            out["live_recovery"] = (live - static) / gain
            out["live_recovery_target"] = _verdict(out["live_recovery"], RECOVERY_TARGET)
        else:
            out["live_recovery"] = None
            out["live_recovery_target"] = "not measurable (the new placement's gain is within the noise)"
    if "stop-the-world" in v:
        out["stop_the_world_worst_dip"] = v["stop-the-world"]["worst_dip"]
    if {"stop-the-world", "ep-reference"} <= set(v):
        ref = v["ep-reference"]["after_drift"]
        out["stop_the_world_after_vs_reference"] = v["stop-the-world"]["after_drift"] / ref if ref else None
    return out


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "no rebalance in the measured period"
    if abs(value - target) <= CLOSE:
        return "close call"
    return "pass" if value >= target else "miss"


def brief(summary: dict) -> dict[str, Any]:
    """The summary without each rebalance's dip (drift.json keeps them): the benchmark's final JSON line."""
    keep = ("mode", "before_drift", "after_drift", "rebalances_measured", "worst_dip", "wall_s")
    variants = {name: {k: v[k] for k in keep} for name, v in summary["variants"].items()}
    return {"variants": variants, "figures": summary["figures"]}


def table(summary: dict) -> str:
    """The variants side by side, then the figures."""
    rows = [f"{'variant':<16}{'mode':<6}{'before':>10}{'after':>10}{'moves':>7}{'worst dip':>11}"]
    for name, v in summary["variants"].items():
        dip = "-" if v["worst_dip"] is None else f"{v['worst_dip']:.3f}"
        rows.append(f"{name:<16}{v['mode']:<6}{v['before_drift']:>10.0f}{v['after_drift']:>10.0f}"
                    f"{v['rebalances_measured']:>7}{dip:>11}")  # fmt: skip
    rows.append("(output tokens per emulated second; emulated: amoe against its own cost model, not a GPU)")
    for key, value in summary["figures"].items():
        rows.append(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    return "\n".join(rows)


def plot(setup, runs: list[dict], path) -> None:
    """Tokens/s (sliding one-second rates) over emulated time, aep's variants above ep's, the drift marked and
    each rebalance shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("aep", "ep") if any(r["mode"] == m for r in runs)]
    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 3.4 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        for run in (r for r in runs if r["mode"] == mode):
            starts, rates = sliding(run["tokens"], SETTLE_S, setup.end_s)
            line = ax.plot(starts + WINDOW_S / 2, rates, label=run["variant"])[0]
            for a, b in run["rebalance_spans"]:
                ax.axvspan(a, max(b, a + 0.02), color=line.get_color(), alpha=0.15)
        ax.axvline(setup.drift_s, color="k", ls="--", lw=1, label="drift")
        ax.axvline(setup.warmup_s, color="grey", ls=":", lw=1)
        ax.set_ylabel("output tokens/s (emulated)")
        ax.set_title(f"{mode}: {setup.profile} on emulated {setup.gpu} (own cost model, not a GPU)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("time (s, emulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

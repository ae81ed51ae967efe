"""A load point's figures from the `/metrics` scrapes of its window (amoe.perf.studies.probe): throughput and ITL in emulated
time, TTFT, the runtimes' busy fractions, the host's CPU and the requests in flight. `amoe bench compare`'s Poisson
points (amoe.perf.studies.compare) and steady points (amoe.perf.studies.steady) are both measured here."""

from __future__ import annotations

from typing import Any


def measure(setup, kind, rate, probe, start, window, done, scale) -> dict[str, Any]:
    """A point's figures from the scrapes inside `window` (wall times): throughput, ITL, TTFT, busy fractions, host
    CPU; `start` is the queue-depth series' origin."""
    from amoe.perf.studies import calibrate
    from amoe.perf.studies.probe import histogram_quantile

    point = {"config": setup.name, "group": setup.group, "kind": kind, "setup": setup.record(), "rate": rate}
    point["time_scale"] = scale
    window = probe.window(*window)
    completed = [r for r in done if r.success]
    point["completed"] = len(completed)
    if window is None:
        empty = dict.fromkeys(
            ("throughput_fit", "itl_ms_mean", "itl_ms_p50", "itl_ms_p90", "ttft_ms_mean", "host_cores")
        )
        return {**point, **empty, "throughput": 0.0, "busy": {}, "running_mean": 0.0}
    first, last = window
    inside = [s for s in probe.scrapes if first.t <= s.t <= last.t]
    running = [s.running for s in inside]
    wall_s = last.t - first.t
    emulated_s = wall_s / scale
    measured_cpu = None not in (first.cpu_s, last.cpu_s)
    host = round((last.cpu_s - first.cpu_s) / wall_s, 2) if measured_cpu else None
    point.update(
        throughput=(last.tokens - first.tokens) / emulated_s,  # output tokens per emulated second
        throughput_fit=token_rate_fit([(s.t, s.tokens) for s in inside], scale),
        # The counter over the window (wall seconds from its first scrape, tokens since it): the record to check
        # either estimate against.
        tokens_series=[(round(s.t - first.t, 3), s.tokens - first.tokens) for s in inside],
        window_tokens=last.tokens - first.tokens,
        itl_ms_mean=_mean_ms(first, last, "itl", scale),
        itl_ms_p50=_ms(histogram_quantile(0.5, first, last), scale),
        itl_ms_p90=_ms(histogram_quantile(0.9, first, last), scale),
        ttft_ms_mean=_mean_ms(first, last, "ttft", scale),
        busy=busy_fractions(first, last),
        rows_per_step=rows_per_step(first, last),
        # Host CPU in use (cores) by the server's processes and the load generator over the window: near the
        # machine's core count the host, not the emulated GPUs, sets the pace: marked.
        host_cores=host,
        saturated=calibrate.saturated(host),
        running_mean=round(
            sum(running) / len(running), 1
        ),  # requests in flight: a steady point's concurrency
        queue=[((s.t - start) / scale, s.queue_tokens) for s in probe.scrapes],
        ended=ended(probe.scrapes),
    )
    return point


# Why a request ended when it did not run to its end: the coordinator cut it (a timeout, a lost runtime) or refused it.
FAILED = ("error", "rejected")


def ended(scrapes) -> dict[str, int]:
    """Requests ended over the whole point (its first scrape to its last), by the coordinator's reason: the
    record that a point measured the load it was given, not one thinned by timeouts or refusals (FAILED)."""
    if len(scrapes) < 2:
        return {}
    first, last = scrapes[0].finished, scrapes[-1].finished
    return {r: round(n - first.get(r, 0.0)) for r, n in sorted(last.items()) if n > first.get(r, 0.0)}


def token_rate_fit(series: list[tuple[float, float]], scale: float) -> float | None:
    """Output tokens per emulated second as the least-squares slope of the token counter over every scrape of the
    window ((wall time, tokens) pairs), not just its two ends.

    Why: a lock-step deployment (EP, ping-pong) hands the coordinator a whole iteration's tokens at once, so its
    counter is a staircase with one step per ITL. Two scrapes 8–14 ITLs apart count a step more or less depending
    on where they fall (±1/8 to ±1/14: EP 16 of the Figure 10 setup read 0.86–1.01 of its prediction over three
    routings while its ITLs were 1.01–1.09); the slope through ~32 scrapes averages over the phase of the steps.
    AEP's counter is smoother, but at full depth it moves in waves too (the two-scrape figure read 1.00–1.03 of
    the slope there). None with fewer than three scrapes."""
    if len(series) < 3:
        return None
    n = len(series)
    mean_t = sum(t for t, _ in series) / n
    mean_y = sum(y for _, y in series) / n
    var = sum((t - mean_t) ** 2 for t, _ in series)
    if var <= 0:
        return None
    slope = sum((t - mean_t) * (y - mean_y) for t, y in series) / var  # tokens per wall second
    return slope * scale


def rows_per_step(first, last) -> dict[str, float]:
    """Mean rows per step of each kind (attn, head, expert) over the window, all runtimes together: the batches the
    runtime actually ran, to set beside the ones a prediction assumed."""
    out = {}
    for kind, (rows, steps) in sorted(last.batch_rows.items()):
        rows0, steps0 = first.batch_rows.get(kind, (0.0, 0.0))
        if steps > steps0:
            out[kind] = round((rows - rows0) / (steps - steps0), 1)
    return out


def busy_fractions(first, last) -> dict[str, float]:
    """Fraction of the window each runtime spent running layers (holding its emulated GPU, plus the host's work
    around it): how busy the emulated devices were, read from them rather than inferred from ITL. Divided by the
    runtime's own uptime between the two reports the scrapes carry, not by the scrapes' wall time: reports arrive
    every heartbeat (0.5 s), which over a short window would otherwise skew the fraction either way."""
    out = {}
    for key, busy in sorted(last.busy.items()):
        elapsed = last.uptime.get(key, 0.0) - first.uptime.get(key, 0.0)
        if elapsed > 0:  # no new report within the window: no measurement, rather than a made-up one
            out[key] = round((busy - first.busy.get(key, 0.0)) / elapsed, 3)
    return out


def _mean_ms(first, last, name: str, scale: float) -> float | None:
    """Mean of a histogram (itl, ttft) between two scrapes, in emulated ms."""
    n = getattr(last, f"{name}_count") - getattr(first, f"{name}_count")
    return (getattr(last, f"{name}_sum") - getattr(first, f"{name}_sum")) / n * 1000 / scale if n else None


def _ms(seconds: float | None, scale: float) -> float | None:
    return None if seconds is None else seconds * 1000 / scale

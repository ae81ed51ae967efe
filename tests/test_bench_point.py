"""A point's throughput from the coordinator's token counter (amoe.perf.studies.point): the least-squares estimate holds
for a lock-step deployment's staircase counter wherever the scrapes fall, where two scrapes miss by a step."""

import math

import pytest

from amoe.perf.studies.point import token_rate_fit

ITL = 1.0  # wall seconds between a lock-step deployment's bursts
BURST = 1000  # tokens per burst: one per request in flight
SCALE = 40.0  # wall seconds per emulated second


def staircase(phase: float, window: float = 8.5 * ITL, period: float = 0.25) -> list[tuple[float, float]]:
    """Scrapes every `period` over `window` of a counter that jumps by BURST every ITL, the first scrape `phase`
    ITLs after a burst. The window is 8 ITLs of the guess, and the guess was 6 % short (steady points re-aim only
    past 25 %), so it is not a whole number of steps."""
    times = [phase * ITL + i * period for i in range(int(window / period) + 1)]
    return [(t, BURST * math.floor(t / ITL)) for t in times]


def endpoints(series: list[tuple[float, float]]) -> float:
    (t0, y0), (t1, y1) = series[0], series[-1]
    return (y1 - y0) / (t1 - t0) * SCALE


def test_staircase_rate_holds_at_every_phase() -> None:
    truth = BURST / ITL * SCALE  # tokens per emulated second
    phases = [i / 20 for i in range(20)]
    fit = [token_rate_fit(staircase(p), SCALE) / truth for p in phases]
    two = [endpoints(staircase(p)) / truth for p in phases]
    assert max(abs(f - 1) for f in fit) < 0.01
    # What the fit is for: the two-scrape estimate of the same counters misses by up to a step in eight.
    assert max(abs(t - 1) for t in two) > 0.05


def test_smooth_counter_gives_its_slope() -> None:
    series = [(0.5 * i, 123.0 + 700.0 * 0.5 * i) for i in range(33)]
    assert token_rate_fit(series, SCALE) == pytest.approx(700.0 * SCALE)


@pytest.mark.parametrize("series", [[], [(0.0, 0.0)], [(0.0, 0.0), (1.0, 5.0)], [(1.0, 0.0)] * 3])
def test_too_few_scrapes_give_no_figure(series) -> None:
    assert token_rate_fit(series, SCALE) is None

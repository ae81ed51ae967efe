"""`amoe bench drift`: the hot set of experts moves mid-run, and amoe's live rebalancing, a static placement and a
lock-step engine's stop-the-world rebalance are measured side by side in one run (docs/rebalancing.md, "The drift
benchmark"). Emulated GPUs: amoe's scheduling against its own cost model, not a GPU.

Routing is the measured skew (skew-exp at λ = 0.08, Mixtral-8x7B's, amoe.perf.model.routing) with a drift: requests
from id DRIFT_ID on come from another mix of domains and draw from another seeded permutation of which experts are
hot. A closed loop keeps `streams` requests in flight, new ones replacing those that end; from the drift moment on
every new request is drifted traffic. Variants, each on a fresh deployment:

- `static` (aep): EPLB's map for the load measured in the warm-up, kept after the drift;
- `live` (aep): the periodic rebalance (`--enable-eplb`: EPLB every step_interval steps, joins and drains);
- `reference` (aep): drifted traffic from the start, EPLB's map for its load: the placement for the new routing;
- `stop-the-world` (ep): the same periodic EPLB, done as a lock-step engine must (amoe.runtime.sync.rebalance);
- `ep-reference` (ep): drifted traffic from the start under the same periodic EPLB.

Each records its output tokens over time and its rebalances; amoe.perf.studies.drift_report reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from amoe.config import AmoeConfig, EmulationSection, EplbSection
from amoe.errors import ConfigError
from amoe.perf.model.routing import DEFAULT_LAMBDA
from amoe.perf.studies import drift_report
from amoe.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DRIFT_ID = 1_000_000  # request ids from here on are the drifted traffic
VARIANTS = ("static", "live", "reference", "stop-the-world", "ep-reference")
POLL_S = 0.01  # wall seconds between the driver's looks at the streams and the placement


@dataclasses.dataclass(frozen=True)
class DriftSetup:
    """One run's deployment, workload and schedule (times in emulated seconds)."""

    profile: str = "mixtral-8x7b-mqa:2"  # Mixtral's shapes (the measured skew is Mixtral's), 2 of its blocks
    gpu: str = "a100-80g"  # where a compute-bound expert step makes skew cost time
    lam: float = DEFAULT_LAMBDA
    seed: int = 0
    time_scale: float = 4.0
    # Prompts of prompt_len / 2 .. 3 prompt_len / 2 tokens and max_tokens / 2 .. 3 max_tokens / 2 output tokens, by
    # request id: requests of one length would stay in phase and deliver their tokens in waves.
    prompt_len: int = 256
    max_tokens: int = 8
    streams: int = 128
    attn_ranks: int = 3  # aep: 3 attention + 3 expert runtimes, expert-bound by the cost model
    expert_ranks: int = 3
    ep_devices: int = 4
    redundant: int = 4  # replicas a block beyond one per expert, every variant
    batch_rows: int = 1024  # rows per attention batch (ep: per device iteration): past the experts' knee
    step_interval: int = 64  # steps between periodic rebalances (~1 emulated s here)
    window_size: int = 32
    warmup_s: float = 3.0
    before_s: float = 3.0
    after_s: float = 6.0

    def __post_init__(self) -> None:
        counts = (
            "prompt_len",
            "max_tokens",
            "streams",
            "attn_ranks",
            "batch_rows",
            "step_interval",
            "window_size",
        )
        for name in counts:
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"drift: {name.replace('_', '-')} must be at least 1; got {getattr(self, name)}"
                )
        if self.expert_ranks < 2 or self.ep_devices < 2:
            raise ConfigError(
                "drift: a placement to rebalance needs 2 or more expert runtimes and ep devices"
            )
        for name in ("time_scale", "warmup_s", "before_s", "after_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"drift: {name.replace('_', '-')} must be positive; got {getattr(self, name)}"
                )

    @property
    def drift_s(self) -> float:
        return self.warmup_s + self.before_s

    @property
    def end_s(self) -> float:
        return self.drift_s + self.after_s

    @property
    def routing(self) -> str:
        return f"skew-exp:{self.lam:g},drift={DRIFT_ID}"

    def emulation(self) -> EmulationSection:
        return EmulationSection(
            gpu=self.gpu, profile=self.profile, top_k=2, time_scale=self.time_scale, routing=self.routing,
            seed=self.seed,
        )  # fmt: skip

    def eplb(self, periodic: bool) -> EplbSection:
        return EplbSection(
            enable=periodic, num_redundant_experts=self.redundant, window_size=self.window_size,
            step_interval=self.step_interval,
        )  # fmt: skip


class Traffic:
    """The closed loop's bookkeeping: request ids (drifted from the drift moment on, or from the start), output
    tokens over time, and the run's emulated clock (wall seconds since the start / time scale)."""

    def __init__(self, setup: DriftSetup, drifted: bool) -> None:
        self.setup = setup
        self.start = time.perf_counter()
        self._plain, self._drifted = itertools.count(1), itertools.count(DRIFT_ID)
        self._always_drifted = drifted
        self.tokens: list[tuple[float, int]] = []  # (emulated seconds, output tokens that arrived)
        self.rebalances: list[tuple[float, float]] = []  # (start, end) emulated seconds
        self._lock = threading.Lock()  # ep's driver thread and the study's thread

    def now(self) -> float:
        return (time.perf_counter() - self.start) / self.setup.time_scale

    def emulated(self, wall: float) -> float:
        return (wall - self.start) / self.setup.time_scale

    @property
    def running(self) -> bool:
        return self.now() < self.setup.end_s

    def next_id(self) -> int:
        with self._lock:
            drifted = self._always_drifted or self.now() >= self.setup.drift_s
            return next(self._drifted if drifted else self._plain)

    def record(self, count: int) -> None:
        if count:
            with self._lock:
                self.tokens.append((self.now(), count))


def params(setup: DriftSetup, request_id: int) -> SamplingParams:
    tokens = _spread(setup.max_tokens, request_id, salt=1)
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def prompt(setup: DriftSetup, request_id: int) -> list[int]:
    return [3 + (request_id + i) % 97 for i in range(_spread(setup.prompt_len, request_id, salt=0))]


def _spread(mean: int, request_id: int, salt: int) -> int:
    """mean / 2 .. mean / 2 + mean, spread over request ids by a multiplicative hash (Knuth's): the same for a
    request in every variant."""
    return max(1, mean // 2 + (request_id * 2654435761 + salt * 40503) % 2**32 % (mean + 1))


# ---- aep: a served cluster (coordinator + runtime processes), its Rebalancer


def aep_config(setup: DriftSetup, periodic: bool) -> AmoeConfig:
    return AmoeConfig().replace(
        parallel={"mode": "aep", "attn_ranks": setup.attn_ranks, "expert_ranks": setup.expert_ranks},
        device={"kind": "cpu"}, executor={"kind": "emulated"}, emulation=dataclasses.asdict(setup.emulation()),
        eplb=dataclasses.asdict(setup.eplb(periodic)), scheduler={"attn_batch_cap": setup.batch_rows},
        cache={"max_num_seqs": setup.streams},
    )  # fmt: skip


def run_aep(setup: DriftSetup, variant: str) -> dict[str, Any]:
    from amoe.testing.cluster import ServedCluster

    with ServedCluster(None, aep_config(setup, periodic=variant == "live")) as cluster:
        traffic = Traffic(setup, drifted=variant == "reference")
        cluster.call(_aep_run(cluster.backend, setup, traffic, place_once=variant != "live"), None)
        placement = cluster.backend.placement()
    return {"variant": variant, "mode": "aep", **_series(traffic), "placement": _placement_summary(placement)}


async def _aep_run(backend, setup: DriftSetup, traffic: Traffic, place_once: bool) -> None:
    num_ranks = setup.attn_ranks

    async def stream(i: int) -> None:
        while traffic.running:
            rid = traffic.next_id()
            generate = backend.generate(rid, prompt(setup, rid), params(setup, rid), rank=i % num_ranks)
            async for delta in generate:
                traffic.record(len(delta.token_ids))

    tasks = [asyncio.ensure_future(stream(i)) for i in range(setup.streams)]
    watch = asyncio.ensure_future(_watch_placement(backend, traffic))
    if place_once:  # EPLB's map for the warm-up's load, halfway through the warm-up; never again
        while traffic.now() < setup.warmup_s / 2:
            await asyncio.sleep(POLL_S)
        await backend.rebalance(None, wait=True)
    await asyncio.gather(*tasks)
    watch.cancel()


async def _watch_placement(backend, traffic: Traffic) -> None:
    """Every move the Rebalancer makes: from the moment it shows as under way to the moment it no longer does."""
    started = None
    while True:
        moving = (backend.placement() or {}).get("rebalancing") is not None
        if moving and started is None:
            started = traffic.now()
        elif not moving and started is not None:
            traffic.rebalances.append((started, traffic.now()))
            started = None
        await asyncio.sleep(POLL_S)


def _placement_summary(report: dict | None) -> dict[str, Any]:
    report = report or {}
    keep = ("epoch", "rebalances", "moved_bytes", "balancedness", "last_error")
    return {k: report.get(k) for k in keep}


# ---- ep: the synchronous group in one process, its stop-the-world rebalance


def run_ep(setup: DriftSetup, variant: str) -> dict[str, Any]:
    from amoe.runtime.emulated import Emulation
    from amoe.testing.sync_inproc import SyncCluster

    em = Emulation(setup.emulation())
    cluster = SyncCluster(
        mode="ep", num_devices=setup.ep_devices, emulation=em, num_kv_blocks=4096, max_batch_rows=setup.batch_rows,
        eplb=setup.eplb(periodic=True), timeout_s=60.0,
    )  # fmt: skip
    with cluster:
        traffic = Traffic(setup, drifted=variant == "ep-reference")
        _ep_run(cluster, setup, traffic)
        stats = cluster.stats()
    events = [e for d in cluster.devices for e in d.rebalancer.events]
    traffic.rebalances = _merge_events(traffic, events)
    moved = sum(s["moved_bytes"] for s in stats)
    return {
        "variant": variant, "mode": "ep", **_series(traffic),
        "placement": {"rebalances": stats[0]["rebalances"], "moved_bytes": moved,
                      "paused_s": max(s["rebalance_s"] for s in stats)},
    }  # fmt: skip


def _ep_run(cluster, setup: DriftSetup, traffic: Traffic) -> None:
    """The closed loop from this thread: a look at every stream each POLL_S, a new request for each that ended."""
    live: dict[int, tuple[Any, int]] = {}  # stream -> (its request, tokens seen)
    for i in range(setup.streams):
        live[i] = (_ep_submit(cluster, setup, traffic, i), 0)
    while live:
        time.sleep(POLL_S)
        cluster._check()  # a dead device ends the run with EngineDeadError
        for i, (req, seen) in list(live.items()):
            now = len(req.output)
            traffic.record(now - seen)
            if not req.done.is_set():
                live[i] = (req, now)
            elif traffic.running:
                live[i] = (_ep_submit(cluster, setup, traffic, i), 0)
            else:
                del live[i]


def _ep_submit(cluster, setup: DriftSetup, traffic: Traffic, stream: int):
    rid = traffic.next_id()
    rank = stream % setup.ep_devices
    return cluster.submit(prompt(setup, rid), params(setup, rid), rank=rank, request_id=rid)


def _merge_events(traffic: Traffic, events: list[tuple[float, float, int]]) -> list[tuple[float, float]]:
    """Every device's pause of one rebalance, as one span from the first boundary to the last resume."""
    spans = sorted((traffic.emulated(start), traffic.emulated(start + pause)) for start, pause, _ in events)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _series(traffic: Traffic) -> dict[str, Any]:
    spans = [(round(a, 6), round(b, 6)) for a, b in traffic.rebalances]
    return {"tokens": drift_report.binned(traffic.tokens), "rebalance_spans": spans}


# ---- the command


def run_variant(setup: DriftSetup, variant: str) -> dict[str, Any]:
    start = time.perf_counter()
    out = run_aep(setup, variant) if variant in ("static", "live", "reference") else run_ep(setup, variant)
    out["wall_s"] = time.perf_counter() - start
    logger.info("[drift] %s: %d tokens in %.0f s of wall time", variant, sum(n for _, n in out["tokens"]),
                out["wall_s"])  # fmt: skip
    return out


def setup_of(args: argparse.Namespace) -> DriftSetup:
    changes = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(DriftSetup)
        if getattr(args, f.name, None) is not None
    }
    return DriftSetup(**changes)


def main(args: argparse.Namespace) -> int:
    setup = setup_of(args)
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"drift: unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    runs = [run_variant(setup, v) for v in variants]
    summary = drift_report.summarise(setup, runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drift.json").write_text(json.dumps({"setup": dataclasses.asdict(setup), "runs": runs, **summary}))
    drift_report.plot(setup, runs, out / "drift.png")
    print(drift_report.table(summary))
    print(json.dumps({"bench": "drift", "setup": dataclasses.asdict(setup), **drift_report.brief(summary)}))
    return 0

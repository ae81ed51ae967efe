"""Redundant experts and live rebalancing end to end (docs/rebalancing.md): greedy streams keep transformers' tokens
while the expert map changes under them — full replication, every home swapped, EPLB's map for the measured load,
back to the start — on the inline and the gloo plane; and a rebalance that fails (a weight load that raises, a
runtime killed during its join) leaves the old map serving, logged and counted, with no request lost."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
import transformers
from factories import hf_greedy

from amoe.config import AmoeConfig
from amoe.expert_map import ExpertMap
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.testing.cluster import ServedCluster
from coordinator.metrics import CoordinatorMetrics

PROMPTS = [[1, 5 + i, 60 + 11 * i, 9] for i in range(4)]
MAX_TOKENS = 1024  # a cap no wave reaches: a wave's streams are aborted once its step has ended
STRIDE = 4  # tokens every stream of a wave has before its step starts
AFTER = 4  # and after it has ended, before the wave is aborted


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("rebalance") / "tiny-rebalance", seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def transformers_prefixes(hf, waves: list[list[list[int]]]) -> list[list[list[int]]]:
    """transformers' greedy tokens for every stream of `waves`, as long as the stream went."""
    longest = [max(len(wave[i]) for wave in waves) for i in range(len(PROMPTS))]
    full = [hf_greedy(hf, prompt, n)[0] for prompt, n in zip(PROMPTS, longest)]
    return [[full[i][: len(out)] for i, out in enumerate(wave)] for wave in waves]


def config(plane: str, **eplb) -> AmoeConfig:
    return AmoeConfig().replace(
        parallel={"attn_ranks": 1, "expert_ranks": 2},
        device={"kind": "cpu"},
        transport={"plane": plane},
        eplb=eplb,
    )


async def through_rebalances(backend, steps) -> tuple[list[list[list[int]]], list[str]]:
    """For each step: once every runtime serves, a wave of greedy streams (every prompt, no end of their own);
    once each has STRIDE tokens, the step runs — a rebalance that starts, without awaiting anything first, while
    all of them are running (`mid()` checks it) — and its outcome is noted; once it has ended and each stream has
    AFTER tokens more, the wave is aborted. So every wave runs from before its step to after it, however fast or
    slow the machine. Returns every wave's tokens and the outcomes."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    waves: list[list[list[int]]] = []
    outcomes = []

    async def stream(request_id: int, out: list[int], prompt: list[int]) -> None:
        async for delta in backend.generate(request_id, prompt, params, 0):
            out += delta.token_ids

    async def until(condition) -> None:
        while not condition():
            await asyncio.sleep(0.002)

    for k, step in enumerate(steps):
        await until(lambda: backend.status == "ok")  # a runtime being replaced (a step killed it): wait
        wave = [[] for _ in PROMPTS]
        waves.append(wave)
        ids = [100 * k + i for i in range(len(PROMPTS))]
        tasks = [asyncio.ensure_future(stream(r, out, p)) for r, out, p in zip(ids, wave, PROMPTS)]
        await until(lambda wave=wave: min(len(out) for out in wave) >= STRIDE)

        def mid(wave=wave) -> None:
            assert max(len(out) for out in wave) < MAX_TOKENS, "the rebalance would not start mid-stream"

        outcomes.append(await step(backend, mid))
        ended = [len(out) for out in wave]
        await until(
            lambda w=wave, e=ended, ts=tasks: all(
                len(o) >= n + AFTER or t.done() for o, n, t in zip(w, e, ts)
            )
        )
        assert all(len(o) >= n + AFTER for o, n in zip(wave, ended)), "a stream ended before its step did"
        for request_id in ids:
            backend.abort(request_id)
        await asyncio.gather(*tasks)
    return waves, outcomes


def to(table):
    """A step that rebalances to `table` (None: EPLB's map for the load measured so far) and waits for its end."""

    async def step(backend, mid) -> str:
        rebalancer = backend.cluster.placement
        target = await rebalancer.planned() if table is None else ExpertMap.of(table)
        mid()
        epoch = rebalancer.start(target, "test")  # no await between the check and the start
        return await rebalancer.wait(epoch) if rebalancer.move is not None else "unchanged"

    return step


async def settled(backend) -> dict:
    """The placement once no rebalance is under way (one the last steps started finishes its drain)."""
    while (report := backend.placement())["rebalancing"] is not None:
        await asyncio.sleep(0.02)
    return report


async def metrics_text(backend) -> str:
    return CoordinatorMetrics(backend).render().decode()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plane", ["inline", "gloo"])
def test_greedy_tokens_are_transformers_across_live_rebalances(model_dir, hf_model, plane):
    with ServedCluster(model_dir, config(plane, num_redundant_experts=2)) as cluster:
        start = cluster.backend.placement()[
            "replicas"
        ]  # experts 0 and 1 of every block on both expert runtimes
        assert start[0][:3] == [[1, 2], [1, 2], [1]]
        full = [[[1, 2] for _ in row] for row in start]
        swapped = [[[3 - w[0]] if len(w) == 1 else w for w in row] for row in start]
        steps = [to(full), to(swapped), to(None), to(start)]
        waves, outcomes = cluster.call(through_rebalances(cluster.backend, steps), 200)
        report = cluster.backend.placement()
        text = cluster.call(metrics_text(cluster.backend))
        stats = cluster.runtime_stats()
    assert waves == transformers_prefixes(hf_model, waves)
    assert outcomes[:2] + outcomes[3:] == ["completed"] * 3
    assert outcomes[2] in ("completed", "unchanged")  # EPLB's map for the measured load
    assert report["replicas"] == start and report["rebalancing"] is None and report["last_error"] is None
    assert 'amoe_placement_rebalances_total{outcome="failed"} 0.0' in text
    assert (
        "amoe_placement_moved_bytes_total" in text
        and 'amoe_placement_replicas{block="0",expert="0"} 2.0' in text
    )
    assert report["moved_bytes"] > 0 and report["rebalances"]["completed"] >= 3
    # While every layer had two replicas, the rule sent rows of a layer to both of them.
    rows = {
        (s["runtime"], layer): n for s in stats if s["role"] == "expert" for layer, n in s["rows"].items()
    }
    assert any(rows.get((1, layer), 0) and rows.get((2, layer), 0) for _, layer in rows if layer[2] >= 2)


@pytest.mark.timeout(300)
def test_a_failed_rebalance_leaves_the_old_map_serving(model_dir, hf_model, monkeypatch):
    """Expert 5 fails to load anywhere it joins; expert 6's load never returns, and its runtime is killed mid-join.
    Both rebalances fail and the starting map serves on; a third one, without those experts, completes."""
    monkeypatch.setenv("AMOE_FAULTS", "join:5,joinwedge:6")
    with ServedCluster(model_dir, config("inline")) as cluster:
        start = cluster.backend.placement()["replicas"]  # expert e on runtime 1 + e mod 2
        with_5, with_6, with_0 = ([[list(w) for w in row] for row in start] for _ in range(3))
        with_5[0][5] = [1, 2]
        with_6[1][6] = [1, 2]
        with_0[2][0] = [1, 2]
        hosted = cluster.backend.cluster.placement.hosted

        async def kill_the_joiner(backend, mid) -> str:
            mid()
            epoch = backend.cluster.placement.start(ExpertMap.of(with_6), "test")
            os.kill(
                backend.cluster.runtimes[2].proc.pid, signal.SIGKILL
            )  # runtime 2 is the one joining (1, 6)
            return await backend.cluster.placement.wait(epoch)

        steps = [to(with_5), kill_the_joiner, to(with_0)]
        waves, outcomes = cluster.call(through_rebalances(cluster.backend, steps), 250)
        report = cluster.backend.placement()
        text = cluster.call(metrics_text(cluster.backend))
    # No request lost or failed: the killed runtime's rows were asked for again from its replacement.
    assert waves == transformers_prefixes(hf_model, waves)
    assert outcomes == ["failed", "failed", "completed"]
    assert report["rebalances"] == {"started": 3, "completed": 1, "failed": 2, "unchanged": 0}
    assert "lost during its join" in report["last_error"]
    assert report["replicas"] == with_0 and (0, 5) not in hosted[1] and (1, 6) not in hosted[2]
    assert 'amoe_placement_rebalances_total{outcome="failed"} 2.0' in text


@pytest.mark.timeout(180)
def test_the_periodic_rebalance_runs_on_the_emulated_executor():
    """`--enable-eplb` with a short step interval on emulated Mixtral (skewed routing): EPLB's map for the measured
    load replaces the start-up one while 8 streams run — the joins' weights land after the modelled PCIe copy —,
    balancing the expert runtimes better, and every stream gets all its tokens."""
    cfg = AmoeConfig().replace(
        parallel={"attn_ranks": 1, "expert_ranks": 2}, device={"kind": "cpu"}, executor={"kind": "emulated"},
        emulation={"profile": "mixtral-8x7b-mqa:2", "top_k": 2, "routing": "skew-exp", "time_scale": 2},
        eplb={"enable": True, "num_redundant_experts": 2, "window_size": 20, "step_interval": 20},
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    with ServedCluster(None, cfg) as cluster:
        out = cluster.generate([[11, 12, 13, 14]] * 8, params, timeout=150)
        report = cluster.call(settled(cluster.backend), 60)
    assert [len(o) for o in out] == [120] * 8
    counts = report["rebalances"]
    assert counts["started"] >= 1 and counts["failed"] == 0 and counts["completed"] == counts["started"]
    assert report["moved_bytes"] > 0 and report["rebalancing"] is None

"""A lost attention rank's requests move to a serving rank when the replacement is not serving within
server.failover_after_s: the load balancer moves their KV reservation, the backend admits them there again from
their tokens so far, and the stream goes on with the text it would have had."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from factories import AliveProcess

from amoe import wire
from amoe.config import AmoeConfig, ServerSection
from amoe.errors import ConfigError
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.testing.servers import ServerProcess
from coordinator.cluster.runtimes import RuntimeProc
from coordinator.requests.backend import RankKV, TokenDelta
from coordinator.requests.cluster_backend import ClusterBackend
from coordinator.requests.load_balancer import LoadBalancer


def _balancer(ranks: list[RankKV]) -> LoadBalancer:
    return LoadBalancer(lambda: ranks, block_size=16, max_waiting=8)


def test_a_reservation_moves_to_the_serving_rank_with_most_room():
    ranks = [RankKV(100, 100), RankKV(100, 100), RankKV(60, 60)]
    lb = _balancer(ranks)
    assert [lb.try_admit(i, 160) for i in (1, 2)] == [0, 1]  # 10 blocks each
    assert lb.try_admit(3, 160) == 0
    ranks[1] = RankKV(0, 100, serving=False)  # rank 1 is being replaced
    assert lb.move(2, 1) == 0  # rank 0: 80 free; rank 2: 60
    assert lb.rank_of(2) == 0 and lb.free_blocks() == [70, 100, 60]
    assert lb.move(2, 1) is None  # not on rank 1 any more: nothing to move
    lb.release(2)
    assert lb.free_blocks() == [80, 100, 60]


def test_a_reservation_without_room_elsewhere_stays():
    ranks = [RankKV(10, 10), RankKV(15, 15)]
    lb = _balancer(ranks)
    assert lb.try_admit(1, 10 * 16) == 1  # the most room
    assert lb.try_admit(2, 10 * 16) == 0  # rank 0 is full with it
    ranks[1] = RankKV(0, 100, serving=False)
    assert lb.rank_of(1) == 1 and lb.move(1, 1) is None and lb.rank_of(1) == 1


def test_new_requests_avoid_a_rank_being_replaced_unless_only_it_fits():
    ranks = [RankKV(20, 20), RankKV(100, 100, serving=False)]
    lb = _balancer(ranks)
    assert lb.try_admit(1, 16) == 0  # rank 1 has more room but is not serving
    assert lb.try_admit(2, 50 * 16) == 1  # fits only there: it waits for the replacement, as before


def test_the_failover_delay_is_checked():
    assert ServerSection(failover_after_s=0).failover_after_s == 0
    with pytest.raises(ConfigError, match="failover_after_s"):
        ServerSection(failover_after_s=-1)


def test_a_request_waiting_for_its_lost_rank_is_admitted_on_another_from_its_tokens_so_far(tmp_path):
    config = AmoeConfig.from_dict({"server": {"failover_after_s": 0.0}})

    async def scenario():
        be = ClusterBackend(config, tmp_path)
        be.cluster.runtimes += [
            RuntimeProc(0, "attention", proc=AliveProcess(), num_kv_blocks=10, kv_free=10, ready=True),
            RuntimeProc(1, "attention", proc=AliveProcess(), num_kv_blocks=10, kv_free=10, ready=True),
            RuntimeProc(2, "expert", proc=AliveProcess(), ready=True),
        ]
        be._status = "ok"
        sent = []
        be.cluster.send = lambda runtime, msg: sent.append((runtime, msg))
        lb = LoadBalancer(be.kv_usage, be.block_size, 8)
        be.rebind = lb.move
        assert lb.try_admit(5, 3 + 8) == 0 and lb.try_admit(6, 3 + 8) == 1
        stream = be.generate(6, [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0), rank=1)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        be.on_tokens(wire.TokenOut(1, [6], [[40, 41]], [None], 8))
        assert await first == TokenDelta([40, 41])
        lost = be.cluster.runtimes[1]
        lost.lost, lost.lost_at = "killed", 1.0
        be.on_lost(lost, "killed")
        await asyncio.sleep(0.01)  # failover_after_s = 0: on the next turns of the loop
        moved = sent[-1]
        be.on_tokens(wire.TokenOut(0, [6], [[42]], ["length"], 8))
        rest = await anext(stream)
        await stream.aclose()
        return moved, rest, lb.rank_of(6), be.moved

    (runtime, add), rest, rank, moved = asyncio.run(scenario())
    assert runtime == 0 and isinstance(add, wire.AddRequest) and rank == 0 and moved == 1
    assert add.prompt == [1, 2, 3, 40, 41] and add.num_generated == 2 and add.params.max_tokens == 6
    assert rest == TokenDelta([42], "length")


@pytest.mark.timeout(240)
def test_a_stream_whose_attention_runtime_is_killed_moves_to_the_other_rank_and_reads_the_same(tmp_path):
    model = make_model("tiny", tmp_path / "failover", seed=0)
    body = {"model": "failover", "prompt": [1, 17, 4], "max_tokens": 160, "temperature": 0.9, "seed": 11,
            "ignore_eos": True}  # fmt: skip
    config = AmoeConfig().replace(
        model={"path": str(model)},
        parallel={"attn_ranks": 2, "expert_ranks": 1},
        server={"failover_after_s": 0.0},
    )
    with ServerProcess(config) as url:
        reference = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        health = httpx.get(f"{url}/health").json()
        pid_of_rank1 = next(r["pid"] for r in health["runtimes"] if r["runtime"] == 1)
        # A first stream takes rank 0; the second goes to rank 1 (the most free KV) and is the one disturbed.
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as first:
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            text, killed = "", False
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                        if not killed and len(text) > len(reference) // 3:
                            os.kill(pid_of_rank1, signal.SIGKILL)
                            killed = True
            rest = "".join(
                json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {")
            )
        assert killed and text == reference
        assert rest and reference.endswith(rest)  # the first stream, on rank 0, went on undisturbed
        metrics = httpx.get(f"{url}/metrics").text
        assert "amoe_cluster_moved_requests_total 1.0" in metrics, metrics[-3000:]

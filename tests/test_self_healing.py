"""Self-healing, piece by piece: an attention engine asks again for the expert outputs it still waits for (and
drops the second answer), a communicator sends to a replaced peer's new process, a re-admitted seeded request
resumes its draws, the restart budget; and, served, seeded sampling that survives a lost attention runtime.
(tests/test_chaos.py runs the whole under kills and stops.)"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import torch
from test_comm_basic import message, recv_n, same

from amoe import core
from amoe.config import AmoeConfig, SchedulerSection
from amoe.model.make import make_model
from amoe.placement import Placement
from amoe.runtime.requests import RankRequests
from amoe.sampling_params import SamplingParams
from amoe.testing.servers import ServerProcess
from coordinator.cluster.runtimes import RestartBudget

H, K, E, NB = 4, 2, 4, 2


def test_an_attention_engine_asks_again_for_what_it_still_waits_for():
    """After attention(0), the K expert outputs of every row are on record; resend(runtime) sends that runtime's
    share again (same rows, same inputs); the first answer is taken, a second one dropped as a duplicate."""
    placement = Placement.disaggregated(1, 2, E)  # experts 0, 2 on runtime 1; 1, 3 on runtime 2
    hub = core.LoopbackHub(3)
    cfg = core.engine_config(
        0,
        placement,
        num_blocks=NB,
        num_experts=E,
        top_k=K,
        hidden=H,
        scheduler=SchedulerSection(),
        track_requests=True,
    )
    attn = core.Engine(cfg, hub.communicator(0))
    experts = [hub.communicator(r) for r in (1, 2)]
    attn.add_tokens(
        torch.tensor([9]), torch.tensor([5]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1])
    )
    batch = attn.next_batch(0)
    moe_input = torch.arange(H, dtype=torch.float32).view(1, H)
    attn.submit_attention(
        batch, torch.zeros(1, H), moe_input, torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]])
    )
    assert attn.stats()["expected_parts"] == 2
    first = recv_n(experts[0], 1)[0]  # expert 0's row, on runtime 1
    assert attn.resend(1) == 1 and attn.resend(2, older_than_s=60) == 0  # runtime 2's part is not overdue
    again = recv_n(experts[0], 1)[0]
    assert same(first, again) and attn.stats()["resent_rows"] == 1
    meta = first.meta()
    answer = dict(
        request_id=[9], kind=[core.ATTN], block=[1], index=[0], position=[0], slot=meta["slot"].tolist(),
        expert_id=[0], weight=[0.6],
    )  # fmt: skip
    attn.ingest(core.make_message(moe_input * 0.6, **answer))
    attn.ingest(core.make_message(moe_input * 0.6, **answer))  # the resent row's second answer
    stats = attn.stats()
    assert stats["dropped"]["duplicate"] == 1 and stats["expected_parts"] == 1 and stats["pool_entries"] == 1
    attn.forget(torch.tensor([9]))  # a request that ends elsewhere takes its expectations with it
    assert attn.stats()["expected_parts"] == 0


def test_a_communicator_sends_to_a_replaced_peers_new_process():
    a, b = core.ZmqCommunicator(0, 2), core.ZmqCommunicator(1, 2)
    a.connect([a.endpoint, b.endpoint])
    b.connect([a.endpoint, b.endpoint])
    a.send(1, message(2, 8, seed=1))
    assert same(recv_n(b, 1)[0], message(2, 8, seed=1))
    b.close()  # runtime 1 goes; a new process takes its place
    replacement = core.ZmqCommunicator(1, 2)
    replacement.connect([a.endpoint, replacement.endpoint])
    a.reconnect(1, replacement.endpoint)
    a.send(1, message(3, 8, seed=2))
    assert same(recv_n(replacement, 1)[0], message(3, 8, seed=2))
    replacement.send(0, message(1, 8, seed=3))  # and it may speak for rank 1 now the old connection is gone
    assert same(recv_n(a, 1)[0], message(1, 8, seed=3))
    assert a.failed_peers() == []
    for c in (a, replacement):
        c.close()


def test_a_replaced_process_neither_speaks_for_its_rank_nor_gets_its_successor_reported_lost():
    """Once reconnect() names generation 1 of rank 1, frames of generation 0 (the old process, still connected
    here) are dropped, the new process's connection takes the rank over at once, and the old one closing (its
    goodbye is one of those frames) fails nobody."""
    a, old = core.ZmqCommunicator(0, 2), core.ZmqCommunicator(1, 2)
    a.connect([a.endpoint, old.endpoint])
    old.connect([a.endpoint, old.endpoint])
    old.send(0, message(2, 8, seed=1))
    assert same(recv_n(a, 1)[0], message(2, 8, seed=1))  # the old connection speaks for rank 1
    new = core.ZmqCommunicator(1, 2, generation=1)
    new.connect([a.endpoint, new.endpoint])
    a.reconnect(1, new.endpoint, generation=1)
    old.send(0, message(2, 8, seed=2))  # late: dropped
    new.send(0, message(3, 8, seed=3))
    got = recv_n(a, 2, timeout=2.0)
    assert len(got) == 1 and same(got[0], message(3, 8, seed=3))
    old.close()
    time.sleep(0.6)  # past the monitor's judgement of a closed connection (200 ms)
    assert a.failed_peers() == [] and a.stats()["dropped"]["inconsistent"] >= 2  # the message and the goodbye
    a.send(1, message(1, 8, seed=4))
    assert same(recv_n(new, 1)[0], message(1, 8, seed=4))
    for c in (a, new):
        c.close()


def test_a_readmitted_seeded_request_resumes_its_draws():
    """Moved after n sampled tokens, a seeded request's generator skips the n draws they took: it samples on
    exactly as it would have (what the sampler draws is one uniform per token)."""
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=50)
    requests = RankRequests(
        vocab_size=100, eos_token_ids=(2,), num_kv_blocks=64, block_size=4, max_model_len=200
    )
    whole, _ = requests.add(1, [5, 6, 7], params)
    draws = [torch.rand(1, generator=whole.generator).item() for _ in range(40)]
    for n in (1, 7, 39):
        moved, _ = requests.add(100 + n, [5, 6, 7] + [3] * n, params, num_generated=n)
        assert torch.rand(1, generator=moved.generator).item() == draws[n]
    with pytest.raises(Exception, match="num_generated"):
        requests.add(999, [5, 6], params, num_generated=2)


def test_the_restart_budget():
    budget = RestartBudget(limit=2, window_s=0.3)
    assert budget.take() and budget.take() and not budget.take()
    time.sleep(0.35)
    assert budget.take()


@pytest.mark.timeout(180)
def test_seeded_sampling_survives_a_lost_attention_runtime(tmp_path):
    """The same seeded, sampled request twice: once undisturbed, once with its attention runtime killed halfway.
    It is admitted again on the replacement from its tokens so far and streams the same text — each of its n
    sequences, with its own seed, penalties counting what it generated before the move."""
    model = make_model("tiny", tmp_path / "heal", seed=0)
    body = {
        "model": "heal",
        "prompt": [1, 17, 4],
        "max_tokens": 64,
        "temperature": 0.9,
        "seed": 77,
        "ignore_eos": True,
        "n": 2,
        "presence_penalty": 0.4,
        "repetition_penalty": 1.1,
    }
    config = AmoeConfig().replace(model={"path": str(model)}, parallel={"attn_ranks": 1, "expert_ranks": 2})
    with ServerProcess(config) as url:
        choices = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
        reference = [c["text"] for c in choices]
        pid = next(
            r["pid"] for r in httpx.get(f"{url}/health").json()["runtimes"] if r["role"] == "attention"
        )
        texts, killed = ["", ""], False
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    texts[choice["index"]] += choice["text"]
                    if not killed and len(texts[0]) > len(reference[0]) // 3:
                        os.kill(pid, signal.SIGKILL)
                        killed = True
        assert killed and texts == reference and reference[0] != reference[1]
        metrics = httpx.get(f"{url}/metrics").text
        assert "amoe_cluster_readmitted_requests_total 1.0" in metrics
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["runtimes"][0]["restarts"] == 1

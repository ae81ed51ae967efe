"""The operator endpoints (coordinator/api/admin.py): behind the API key like every endpoint but /health; on a cluster
backend they read and change the live expert map (a Rebalancer driven by hand, no runtime processes); elsewhere
they say the experts never move; a bad map is a 400 naming `replicas`, a rebalance under way a 409."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from factories import CharDetokenizer, CharTokenizer
from test_api_fake_backend import ScriptedBackend
from test_rebalancer import make

from amoe.config import AmoeConfig
from coordinator.api.app import create_app
from coordinator.api.validation import ModelInfo
from coordinator.requests.cluster_backend import ClusterBackend

KEY = {"Authorization": "Bearer sesame"}


def client(backend) -> httpx.AsyncClient:
    app = create_app(backend, CharTokenizer(), ModelInfo("m", 64, 100_000), lambda ids: CharDetokenizer(),
                     api_key="sesame")  # fmt: skip
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=10)


def placed_backend(tmp_path) -> ClusterBackend:
    """A cluster backend whose cluster is a Rebalancer over two attention and two expert runtimes (2, 3)."""
    backend = ClusterBackend(AmoeConfig().replace(parallel={"attn_ranks": 2, "expert_ranks": 2}), tmp_path)
    rebalancer, runtimes, sent, _ = make()
    backend.cluster.placement, backend.cluster.runtimes[:] = rebalancer, runtimes
    backend._status = "ok"
    return backend


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


@pytest.mark.timeout(30)
def test_the_admin_endpoints_read_and_change_the_live_map(tmp_path):
    backend = placed_backend(tmp_path)

    async def scenario():
        async with client(backend) as c:
            assert (await c.get("/admin/placement")).status_code == 401
            assert (await c.post("/admin/rebalance", json={})).status_code == 401
            report = (await c.get("/admin/placement", headers=KEY)).json()
            assert report["epoch"] == 0 and report["rebalancing"] is None
            table = report["replicas"]
            bad = await c.post("/admin/rebalance", json={"replicas": [[[0]] * 4] * 2}, headers=KEY)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "replicas", bad.text
            assert "not an expert runtime" in bad.json()["error"]["message"]
            empty = await c.post("/admin/rebalance", json={"replicas": [[[]] * 4] * 2}, headers=KEY)
            assert empty.status_code == 400 and empty.json()["error"]["param"] == "replicas"
            typo = await c.post("/admin/rebalance", json={"replica": table}, headers=KEY)
            assert typo.status_code == 400 and "replica" in typo.json()["error"]["message"]
            table[0][0] = [2, 3]
            started = await c.post("/admin/rebalance", json={"replicas": table}, headers=KEY)
            assert started.status_code == 200 and started.json()["outcome"] == "started", started.text
            assert started.json()["rebalancing"] == {"epoch": 1, "phase": "join", "reason": "admin"}
            busy = await c.post("/admin/rebalance", json={"replicas": table}, headers=KEY)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "rebalance_busy"

    run(scenario())


@pytest.mark.timeout(30)
def test_a_deployment_whose_experts_never_move_says_so():
    async def scenario():
        async with client(ScriptedBackend()) as c:
            assert (await c.get("/admin/placement", headers=KEY)).status_code == 404
            refused = await c.post("/admin/rebalance", headers=KEY)
            assert refused.status_code == 400 and "never move" in refused.json()["error"]["message"]

    run(scenario())


@pytest.mark.timeout(30)
def test_the_scale_endpoint_refuses_bad_input_by_name_and_waits_its_turn(tmp_path):
    """POST /admin/scale: behind the key; a count or change it cannot read, a count that leaves no expert runtime or
    needs more slots than there are, a runtime that is not a serving expert runtime, attention runtimes (which do
    not move yet): each a 400 naming its parameter; a rebalance under way: a 409. GET /admin/scale: the shape."""
    backend = placed_backend(tmp_path)
    bad = [
        ({"expert_runtimes": "abc"}, "expert_runtimes", "must be a count"),
        ({"expert_runtimes": True}, "expert_runtimes", "must be a count"),
        ({"expert_runtimes": 1.5}, "expert_runtimes", "must be a count"),
        ({"expert_runtimes": [1]}, "expert_runtimes", "must be a count"),
        ({"expert_runtimes": 0}, "expert_runtimes", "would leave 0"),
        ({"expert_runtimes": "-2"}, "expert_runtimes", "would leave 0"),
        ({"expert_runtimes": "+61"}, "expert_runtimes", "60 slots are free"),
        ({"attention_runtimes": "+1"}, "attention_runtimes", "only expert runtimes"),
        ({"remove": [0]}, "remove", "not a serving expert runtime"),
        ({"remove": [2], "expert_runtimes": 3}, "remove", "names 1 runtimes"),
        ({}, "expert_runtimes", "say how many"),
    ]

    async def scenario():
        async with client(backend) as c:
            assert (await c.post("/admin/scale", json={"expert_runtimes": "+1"})).status_code == 401
            assert (await c.get("/admin/scale")).status_code == 401
            shape = (await c.get("/admin/scale", headers=KEY)).json()
            assert (shape["attention_runtimes"], shape["expert_runtimes"], shape["max_runtimes"]) == (
                2,
                2,
                64,
            )
            for body, param, words in bad:
                reply = await c.post("/admin/scale", json=body, headers=KEY)
                assert reply.status_code == 400, (body, reply.text)
                error = reply.json()["error"]
                assert error["param"] == param and words in error["message"], (body, error)
            typo = await c.post("/admin/scale", json={"expert_runtime": "+1"}, headers=KEY)
            assert typo.status_code == 400 and "expert_runtime" in typo.json()["error"]["message"]
            not_json = await c.post(
                "/admin/scale", content=b"{", headers=KEY | {"Content-Type": "application/json"}
            )
            assert not_json.status_code == 400
            table = (await c.get("/admin/placement", headers=KEY)).json()["replicas"]
            table[0][0] = [2, 3]
            assert (
                await c.post("/admin/rebalance", json={"replicas": table}, headers=KEY)
            ).status_code == 200
            busy = await c.post("/admin/scale", json={"expert_runtimes": "+1"}, headers=KEY)
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "scale_busy", busy.text
            assert backend.cluster.runtimes == backend.cluster.active and len(backend.cluster.runtimes) == 4

    run(scenario())


@pytest.mark.timeout(30)
def test_a_deployment_whose_runtimes_are_fixed_says_so():
    async def scenario():
        async with client(ScriptedBackend()) as c:
            assert (await c.get("/admin/scale", headers=KEY)).status_code == 404
            refused = await c.post("/admin/scale", json={"expert_runtimes": "+1"}, headers=KEY)
            assert refused.status_code == 400 and "fixed" in refused.json()["error"]["message"]

    run(scenario())

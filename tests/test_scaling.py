"""Elastic runtimes end to end (docs/rebalancing.md "Scaling"): while greedy streams run, an expert runtime is added
(started by the launcher, Ready, then given replicas by a live rebalance) and one of the start-up expert runtimes is
removed (its replicas move, its rows drain, it stops); every stream keeps transformers' tokens, none is lost or
fails, the new runtime serves rows, and /health and the metrics show the join and the drain — on the inline and the
gloo plane. Then `amoe scale` against a served HTTP API, and the input it and the endpoint refuse."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import signal
import socket

import httpx
import pytest
import torch
import transformers
from factories import hf_greedy, server_in_thread

from amoe.cli import main
from amoe.config import AmoeConfig
from amoe.llm import LLM
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.testing.cluster import ServedCluster
from amoe.testing.netns import Hosts, MultiHost, Node, RayNodes, write_secret
from coordinator.metrics import CoordinatorMetrics

PROMPTS = [[1, 5 + i, 60 + 11 * i, 9] for i in range(4)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("scaling") / "tiny-scaling", seed=0)


@pytest.fixture(scope="module")
def hf_tokens(model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(hf, prompt, MAX_TOKENS)[0] for prompt in PROMPTS]


def config(plane: str) -> AmoeConfig:
    return AmoeConfig().replace(
        parallel={"attn_ranks": 1, "expert_ranks": 2},
        device={"kind": "cpu"},
        transport={"plane": plane},
        eplb={"num_redundant_experts": 2},
    )


async def under_traffic(backend, step) -> tuple[list[tuple[int, list[int]]], dict]:
    """Greedy requests, one client per prompt, each sending its next request as soon as the last ended, from before
    `step` starts (every client has a stream with tokens) until it has ended; every request's (prompt, tokens),
    and what `step` answered."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    done: list[tuple[int, list[int]]] = []
    streaming = [0] * len(PROMPTS)
    stop = asyncio.Event()
    ids = itertools.count(1000 * (1 + len(backend.cluster.runtimes)))

    async def client(i: int) -> None:
        while not stop.is_set():
            out: list[int] = []
            async for delta in backend.generate(next(ids), PROMPTS[i], params, 0):
                out += delta.token_ids
                streaming[i] = len(out)
            done.append((i, out))

    clients = [asyncio.ensure_future(client(i)) for i in range(len(PROMPTS))]
    while min(streaming) == 0:
        await asyncio.sleep(0.002)
    answer = await step(backend)
    stop.set()
    await asyncio.gather(*clients)
    return done, answer


def scale(**request):
    async def step(backend) -> dict:
        return await backend.scale(**request, wait=True)

    return step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plane", ["inline", "gloo"])
def test_an_expert_runtime_joins_and_one_leaves_under_load(model_dir, hf_tokens, plane):
    with ServedCluster(model_dir, config(plane)) as cluster:
        backend = cluster.backend
        joined, join = cluster.call(under_traffic(backend, scale(expert_runtimes="+1")), 200)
        hosted_after_join = sorted(backend.cluster.placement.hosted[3])
        # Rows it served before anything else changed: those of the streams that were running when it joined.
        rows_after_join = sum(next(s for s in cluster.runtime_stats() if s["runtime"] == 3)["rows"].values())
        left, drain = cluster.call(under_traffic(backend, scale(expert_runtimes=-1, remove=[1])), 200)
        after = cluster.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        stats = {s["runtime"]: s for s in cluster.runtime_stats()}
        health = backend.health()
        report = backend.placement()
        text = CoordinatorMetrics(backend).render().decode()
    for prompt, tokens in joined + left:  # none lost, none failed, none changed by a replica or a move
        assert tokens == hf_tokens[prompt]
    assert len(joined) >= len(PROMPTS) and len(left) >= len(PROMPTS)
    assert after == hf_tokens
    assert join["outcome"] == "completed" and drain["outcome"] == "completed", (join, drain)
    assert hosted_after_join, "the runtime that joined was given no replica"
    assert rows_after_join > 0, (
        "the runtime that joined served no row of the streams running through its join"
    )
    assert sum(stats[3]["rows"].values()) > 0, "the runtime that joined served no row"
    assert sorted(stats) == [0, 2, 3]
    assert all(1 not in where for row in report["replicas"] for where in row)
    assert any(3 in where for row in report["replicas"] for where in row)
    assert [r["runtime"] for r in health["runtimes"]] == [0, 2, 3] and health["status"] == "ok"
    shape = health["scaling"]
    assert (shape["expert_runtimes"], shape["joins"]["expert"], shape["drains"]["expert"]) == (2, 1, 1)
    assert shape["scaling"] is None and shape["failed"] == {"join": 0, "drain": 0}
    assert 'amoe_cluster_runtime_joins_total{role="expert"} 1.0' in text
    assert 'amoe_cluster_runtime_drains_total{role="expert"} 1.0' in text
    assert 'amoe_cluster_runtimes{role="expert"} 2.0' in text


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--expert-runtimes", "abc"], "'expert_runtimes' must be a count"),
        (["--expert-runtimes", "+1.5"], "'expert_runtimes' must be a count"),
        (["--attention-runtimes", "x"], "'attention_runtimes' must be a count"),
        ([], "say how many expert runtimes"),
        (["--expert-runtimes", "+1", "--timeout", "0"], "--timeout must be positive"),
    ],
)
def test_amoe_scale_refuses_bad_input_in_one_line(flags, words, capsys):
    assert main(["scale", "--url", f"http://127.0.0.1:{_closed_port()}", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and err.startswith("amoe: error:")


def test_amoe_scale_says_when_the_server_cannot_be_reached(capsys):
    assert main(["scale", "--url", f"http://127.0.0.1:{_closed_port()}", "--expert-runtimes", "+1"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and err.count("\n") == 1


@pytest.mark.timeout(240)
def test_amoe_scale_adds_and_removes_an_expert_runtime_of_a_served_api(model_dir, capsys):
    cfg = config("inline").replace(model={"path": str(model_dir)}, server={"port": 0, "api_key": "sesame"})
    with server_in_thread(cfg) as srv:
        url, key = srv.url, ["--api-key", "sesame"]
        assert main(["scale", "--url", url, "--expert-runtimes", "+1"]) == 1  # no key: 401
        assert "HTTP 401" in capsys.readouterr().err
        assert main(["scale", "--url", url, *key, "--expert-runtimes", "0"]) == 2  # the server's 400
        assert "'expert_runtimes' would leave 0 runtimes" in capsys.readouterr().err
        assert main(["scale", "--url", url, *key, "--expert-runtimes", "+1"]) == 0
        grown = capsys.readouterr().out
        assert main(["scale", "--url", url, *key, "--expert-runtimes", "2"]) == 0  # the count: one leaves
        shrunk = capsys.readouterr().out
        auth = {"Authorization": "Bearer sesame"}
        health = httpx.get(f"{url}/health", headers=auth, timeout=10).json()
        shape = httpx.get(f"{url}/admin/scale", headers=auth, timeout=10).json()
        metrics = httpx.get(f"{url}/metrics", headers=auth, timeout=10).text
    assert '"outcome": "completed"' in grown and '"expert_runtimes": 3' in grown
    assert '"outcome": "completed"' in shrunk and '"expert_runtimes": 2' in shrunk
    assert [r["runtime"] for r in health["runtimes"]] == [0, 1, 2]  # the one that joined (3) left first
    assert shape["joins"]["expert"] == 1 and shape["drains"]["expert"] == 1 and shape["scaling"] is None
    assert health["scaling"] == shape and health["status"] == "ok"
    assert 'amoe_cluster_runtime_drains_total{role="expert"} 1.0' in metrics


@pytest.mark.timeout(240)
def test_a_joiner_killed_while_warming_up_fails_its_join_and_its_slot_is_taken_again(model_dir, hf_tokens):
    """The new runtime is killed before it serves: the join fails (not healed: it never served), said in the answer,
    the metrics and /health; the cluster serves on; the next join takes the same slot as its next process."""

    async def kill_the_joiner(backend) -> dict:
        task = backend.cluster.scaler.start(expert_runtimes="+1")
        while len(backend.cluster.runtimes) < 4:
            await asyncio.sleep(0.005)
        os.kill(backend.cluster.runtimes[3].proc.pid, signal.SIGKILL)
        return await task

    with ServedCluster(model_dir, config("inline")) as cluster:
        backend = cluster.backend
        during, failed = cluster.call(under_traffic(backend, kill_the_joiner), 200)
        shape_after_failure = backend.shape()
        again = cluster.call(backend.scale(expert_runtimes="+1", wait=True), 200)
        after = cluster.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        text = CoordinatorMetrics(backend).render().decode()
        runtimes = backend.cluster.runtimes
        health = backend.health()
    for prompt, tokens in during:
        assert tokens == hf_tokens[prompt]
    assert after == hf_tokens
    assert failed["outcome"] == "failed" and "killed" in failed["last_error"], failed
    assert shape_after_failure["expert_runtimes"] == 2 and shape_after_failure["failed"]["join"] == 1
    assert again["outcome"] == "completed" and again["expert_runtimes"] == 3
    assert len(runtimes) == 4 and runtimes[3].spawned == 1 and runtimes[3].restarts == 0
    assert health["status"] == "ok" and [r["runtime"] for r in health["runtimes"]] == [0, 1, 2, 3]
    assert 'amoe_cluster_scale_failures_total{action="join"} 1.0' in text
    assert 'amoe_cluster_runtime_joins_total{role="expert"} 1.0' in text


@pytest.mark.timeout(180)
def test_scaling_on_the_emulated_executor():
    """Emulated Mixtral (no weights; its joins' weights land after the modelled copy): a runtime that joins gets its
    links' emulated delays like the others, serves rows, and every stream gets all its tokens through a join and a
    drain."""
    cfg = AmoeConfig().replace(
        parallel={"attn_ranks": 1, "expert_ranks": 2}, device={"kind": "cpu"}, executor={"kind": "emulated"},
        emulation={"profile": "mixtral-8x7b-mqa:2", "top_k": 2, "routing": "skew-exp", "time_scale": 2},
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with ServedCluster(None, cfg) as cluster:
        backend = cluster.backend
        joined = cluster.call(backend.scale(expert_runtimes="+1", wait=True), 120)
        first = cluster.generate([[11, 12, 13, 14]] * 4, params, timeout=120)
        rows = sum(next(s for s in cluster.runtime_stats() if s["runtime"] == 3)["rows"].values())
        left = cluster.call(backend.scale(remove=[1], wait=True), 120)
        second = cluster.generate([[11, 12, 13, 14]] * 4, params, timeout=120)
        serving = sorted(s["runtime"] for s in cluster.runtime_stats())
    assert (joined["outcome"], left["outcome"]) == ("completed", "completed")
    assert [len(o) for o in first + second] == [40] * 8 and rows > 0 and serving == [0, 2, 3]


@pytest.mark.skipif(not Hosts.available(), reason="network namespaces need root and iproute2")
@pytest.mark.timeout(300)
def test_over_node_agents_a_drained_slot_is_joined_again_through_its_agent(model_dir, tmp_path, capsys):
    """Three "hosts" (tests/test_multinode.py's): the attention runtime on node 0, an expert runtime on each agent's
    node. A new id would have no node, so +1 is refused; runtime 2 (node 2) is drained and stopped; +1 then takes
    its slot again, started by node 2's agent as the slot's next process; completions stay the reference's."""
    prompts = [[1, 5, 9, 200], [1, 77, 3]]
    llm = LLM(model=str(model_dir))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = [o.outputs[0].text for o in llm.generate(prompts, params)]

    with Hosts(3) as hosts:
        cluster = MultiHost(hosts, model_dir, write_secret(tmp_path / "secret", "s" * 64))
        try:
            url = cluster.url
            assert main(["scale", "--url", url, "--expert-runtimes", "+1"]) == 2
            assert "0 slots are free" in capsys.readouterr().err
            assert main(["scale", "--url", url, "--remove", "2"]) == 0
            drained = httpx.get(f"{url}/health", timeout=10).json()
            after_drain = _complete(url, prompts)
            assert main(["scale", "--url", url, "--expert-runtimes", "+1"]) == 0
            joined = httpx.get(f"{url}/health", timeout=10).json()
            after_join = _complete(url, prompts)
        finally:
            cluster.stop()
    assert [r["runtime"] for r in drained["runtimes"]] == [0, 1]
    assert [r["runtime"] for r in joined["runtimes"]] == [0, 1, 2]
    assert joined["runtimes"][2]["host"] == hosts.addrs[2] and joined["runtimes"][2]["alive"]
    assert joined["scaling"]["joins"]["expert"] == 1 and joined["scaling"]["drains"]["expert"] == 1
    assert after_drain == reference and after_join == reference


@pytest.mark.skipif(not Hosts.available(), reason="network namespaces need root and iproute2")
@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="the optional ray package is not installed"
)
@pytest.mark.timeout(300)
def test_over_ray_a_drained_slot_is_joined_again_as_a_new_actor_on_its_bundle(model_dir, tmp_path, capsys):
    """`--distributed-backend ray` over two "hosts": runtime 2 is drained and stopped (its actor ended, its bundle
    free), then +1 takes its slot again as a new actor on the same bundle; completions stay the reference's."""
    prompts = [[1, 5, 9, 200], [1, 77, 3]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = [o.outputs[0].text for o in LLM(model=str(model_dir)).generate(prompts, params)]
    secret = write_secret(tmp_path / "secret", "y" * 64)
    with Hosts(2) as hosts, RayNodes(hosts, count=2) as ray_nodes:
        flags = [
            "--model", str(model_dir), "--distributed-backend", "ray", "--dist-init-addr", ray_nodes.address,
            "--cluster-secret-file", secret, "--attn-ranks", "1", "--expert-ranks", "2",
            "--host", hosts.addrs[0], "--port", "0", "--dist-timeout-s", "120",
        ]  # fmt: skip
        head = Node(hosts, 0, flags)
        try:
            url = head.wait_for(r"amoe serve: listening on (http://\S+)$", timeout=240).group(1)
            assert main(["scale", "--url", url, "--remove", "2"]) == 0
            drained = httpx.get(f"{url}/health", timeout=10).json()
            after_drain = _complete(url, prompts)
            assert main(["scale", "--url", url, "--expert-runtimes", "+1"]) == 0
            joined = httpx.get(f"{url}/health", timeout=10).json()
            after_join = _complete(url, prompts)
            head.proc.send_signal(signal.SIGTERM)
            assert head.proc.wait(60) == 0, head.log()
        finally:
            head.kill_all()
    assert [r["runtime"] for r in drained["runtimes"]] == [0, 1]
    assert [r["runtime"] for r in joined["runtimes"]] == [0, 1, 2] and joined["runtimes"][2]["alive"]
    assert after_drain == reference and after_join == reference


def _complete(url: str, prompts: list[list[int]]) -> list[str]:
    body = {"model": "tiny-scaling", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    replies = [httpx.post(f"{url}/v1/completions", json=body | {"prompt": p}, timeout=60) for p in prompts]
    return [r.json()["choices"][0]["text"] for r in replies]


@pytest.mark.timeout(240)
def test_a_drain_whose_rebalance_fails_leaves_the_runtime_serving(model_dir, hf_tokens, monkeypatch):
    """Expert 2 (home: runtime 1) fails to load anywhere else, so runtime 1's replicas cannot all move: the drain
    fails, runtime 1 serves on with the map it had, and every stream running through it keeps transformers'
    tokens."""
    monkeypatch.setenv("AMOE_FAULTS", "join:2")
    cfg = config("inline").replace(eplb={"num_redundant_experts": 0})
    with ServedCluster(model_dir, cfg) as cluster:
        backend = cluster.backend
        start = backend.placement()["replicas"]
        during, failed = cluster.call(under_traffic(backend, scale(remove=[1])), 200)
        after = cluster.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        report, health = backend.placement(), backend.health()
    for prompt, tokens in during:
        assert tokens == hf_tokens[prompt]
    assert after == hf_tokens
    assert failed["outcome"] == "failed" and "injected" in failed["last_error"], failed
    assert failed["failed"] == {"join": 0, "drain": 1} and failed["expert_runtimes"] == 2
    assert report["replicas"] == start and [r["runtime"] for r in health["runtimes"]] == [0, 1, 2]

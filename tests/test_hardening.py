"""Hardening against a live `amoe serve` with real runtime processes and sockets: no single input, frame or stall
crashes, wedges or silently misleads the server (docs/serve.md, "Limits and failure behaviour").

Each test checks what the client gets, what /metrics counts, and that the server serves on afterwards."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families
from test_comm_faults import frames

from amoe import core, wire
from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.servers import ServerProcess

MODEL = "tiny-hard"
KEY = "open-sesame"
OK_BODY = {"model": MODEL, "prompt": "the expert", "max_tokens": 4, "temperature": 0}
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("hard") / MODEL, seed=0)


def serve(model_dir, env: dict[str, str] | None = None, **sections: dict) -> ServerProcess:
    config = AmoeConfig().replace(model={"path": str(model_dir)}).replace(**sections)
    return ServerProcess(config, startup_timeout_s=120, env=env)


@pytest.fixture(scope="module")
def server(model_dir):
    """1 attention + 2 expert runtimes, the API key from the environment, faults for tokens 900 and 901. Its last
    test stops an expert runtime, which is replaced."""
    env = {"AMOE_API_KEY": KEY, "AMOE_FAULTS": "admit:900,attend:901"}
    srv = serve(model_dir, env=env, server={"stall_timeout_s": 3.0})
    with srv as url:
        srv.url = url
        yield srv


def post(url: str, body, path: str = "/v1/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **HEADERS, **kw.pop("headers", {})}
    return httpx.post(url + path, content=content, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def metrics(url: str) -> dict[tuple, float]:
    out = {}
    text = httpx.get(url + "/metrics", headers=HEADERS, timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def serves_and_frees_kv(url: str) -> None:
    """A normal request still works, and every KV block is free again (nothing leaked)."""
    reply = post(url, OK_BODY)
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 15
    while True:
        health = httpx.get(url + "/health", headers=HEADERS, timeout=10).json()
        if health["status"] == "ok" and all(kv["free_blocks"] == kv["total_blocks"] for kv in health["kv"]):
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.1)


def tree(srv: ServerProcess) -> list[psutil.Process]:
    root = psutil.Process(srv.proc.pid)
    return [root, *root.children(recursive=True)]


def runtime_pid(srv: ServerProcess, title: str) -> int:
    for proc in tree(srv):
        if title in " ".join(proc.cmdline()):
            return proc.pid
    raise AssertionError(f"no process titled {title!r}")


def run_dir(srv: ServerProcess) -> str:
    """The coordinator's private run directory (where its control socket lives)."""
    for conn in psutil.Process(srv.proc.pid).net_connections(kind="unix"):
        if conn.laddr and conn.laddr.endswith("/control"):
            return os.path.dirname(conn.laddr)
    raise AssertionError("no control socket")


# ---- one request never takes the backend down


def test_an_oversized_body_gets_413_before_it_is_parsed(server):
    rejected = total(metrics(server.url), "amoe_requests_finished_total", reason="rejected")
    big = b'{"model": "' + b"x" * (17 * 1024 * 1024) + b'"}'  # over the 16 MiB default
    reply = post(server.url, big)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the cap is counted as the body streams in
        for _ in range(17):
            yield b" " * (1024 * 1024)

    reply = httpx.post(server.url + "/v1/completions", content=chunked(), headers=HEADERS, timeout=60)
    assert reply.status_code == 413
    assert total(metrics(server.url), "amoe_requests_finished_total", reason="rejected") == rejected + 2
    serves_and_frees_kv(server.url)


OUT_OF_RANGE = [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 2**40}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2**70}, "n"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": "y" * 1025}, "stop"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"stop_token_ids": [5000]}, "stop_token_ids"),  # outside the tiny model's vocabulary
    ({"prompt": [1, 2**70]}, "prompt"),
]


@pytest.mark.parametrize(("extra", "param"), OUT_OF_RANGE, ids=[p for _, p in OUT_OF_RANGE])
def test_out_of_range_values_are_400s_naming_the_field(server, extra, param):
    reply = post(server.url, {**OK_BODY, **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_non_finite_floats_are_400s(server):
    for raw in (b'"temperature": 1e400', b'"temperature": NaN', b'"top_p": -Infinity'):
        body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, %s}' % (MODEL.encode(), raw)
        reply = post(server.url, body)
        assert reply.status_code == 400, (raw, reply.text)
    serves_and_frees_kv(server.url)


def test_a_failure_in_the_runtime_fails_that_request_alone(server):
    """A request whose admission raises in its attention runtime (token 900) gets a 500 with a message while the
    requests beside it complete; one whose attention batch raises there (token 901) fails with its batch (here
    alone) and the runtime serves on."""

    def run(prompt, stream=False):
        return post(server.url, {**OK_BODY, "prompt": prompt, "max_tokens": 6, "stream": stream})

    results = {}
    threads = [
        threading.Thread(target=lambda k=k, p=p: results.__setitem__(k, run(p)))
        for k, p in {"ok1": [1, 5, 9], "admit": [1, 900, 3], "ok2": [1, 7]}.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["ok1"].status_code == results["ok2"].status_code == 200
    results["attend"] = run([1, 901, 4])
    for stage in ("admit", "attend"):
        reply = results[stage]
        assert reply.status_code == 500, reply.text
        assert "injected" in reply.json()["error"]["message"]
    streamed = run([1, 901, 2], stream=True)  # headers went out first: the failure is an error event
    assert (
        streamed.status_code == 200
        and '"error"' in streamed.text
        and streamed.text.endswith("data: [DONE]\n\n")
    )
    serves_and_frees_kv(server.url)
    assert total(metrics(server.url), "amoe_requests_finished_total", reason="error") >= 3


# Slow: the event loop's freedom is wall time — the gaps between a stream's tokens against the tokenizer's seconds.
@pytest.mark.slow
def test_a_huge_prompt_does_not_freeze_other_streams(server):
    """Tokenizing an 8 MB prompt takes seconds; a stream running meanwhile keeps its pace (tokenization runs off
    the event loop, without the GIL)."""
    gaps: list[float] = []

    def stream():
        body = {**OK_BODY, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=HEADERS, timeout=120
        ) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(1.0)  # well into its stream
    start = time.monotonic()
    huge = {**OK_BODY, "prompt": "the expert said hello " * (8 * 1024 * 1024 // 22)}
    reply = post(server.url, huge, timeout=120)
    took = time.monotonic() - start
    streamer.join()
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"  # longer than the model
    assert took > 1.0, "the prompt should take a while to tokenize"
    # The stream never waited for it: had tokenizing blocked the event loop, one gap would be about `took`.
    assert max(gaps[1:]) < took / 2, (max(gaps), took)


# ---- no message from a runtime or a peer can crash or wedge anything


def test_bad_control_frames_are_dropped_and_counted(server):
    """Garbage, and well-formed messages that lie (another runtime's id, a malformed report, an unknown request,
    a coordinator's command), sent to the coordinator's live control socket: each dropped and counted."""
    path = f"ipc://{run_dir(server)}/control"
    before = total(metrics(server.url), "amoe_coordinator_control_dropped_messages_total")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"rt9")  # not a runtime's identity
    sock.linger = 0
    sock.connect(path)
    good_stats = {"runtime": 1, "role": "expert"}
    bad = [
        b"",
        b"\x02garbage",
        os.urandom(64),
        wire.encode(wire.Heartbeat(1, good_stats)),  # runtime 1's message from socket rt9
        wire.encode(wire.Shutdown()),  # a command, not a runtime's message
    ]
    for frame in bad:
        sock.send(frame)
    spoof = ctx.socket(zmq.DEALER)  # a runtime's identity is taken by that runtime: one that looks like it
    spoof.setsockopt(zmq.IDENTITY, b"rt1.out.x")
    spoof.linger = 0
    spoof.connect(path)
    spoof.send(
        wire.encode(wire.Heartbeat(1, {"runtime": 1, "role": "expert", "depth": [["expert", -1, 0, 1]]}))
    )
    time.sleep(1.0)
    sock.close()
    spoof.close()
    ctx.term()
    after = metrics(server.url)
    assert total(after, "amoe_coordinator_control_dropped_messages_total") - before == len(bad) + 1
    serves_and_frees_kv(server.url)


def test_malformed_heartbeats_and_token_reports_never_reach_the_cluster(server):
    """Messages a broken runtime could send, checked directly against the coordinator's validation."""
    with pytest.raises(wire.WireError):
        wire.check_report(1, {"runtime": 1, "role": "expert", "depth": [["expert", 0, 0, float("nan")]]})
    with pytest.raises(wire.WireError):
        wire.check_report(1, {"runtime": 2, "role": "expert"})  # someone else's report
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode(wire.TokenOut(0, [1], [[3]], ["stop"], 5))[:-1] + b"\xff")
    frame = wire.encode(wire.TokenOut(0, [1], [[3]], ["stop"], 5)).replace(b"stop", b"boom")
    with pytest.raises(wire.WireError):
        wire.decode(frame)


def test_bad_data_rows_are_dropped_and_counted(server):
    """Garbage frames, and a well-formed row posing as a peer (runtime 1, whose own connection owns that rank),
    sent to the attention runtime's live data socket: dropped and counted; closing that connection does not get
    the real runtime 1 reported lost."""
    (path,) = glob.glob(f"{run_dir(server)}/rt0-*.data")
    path = f"ipc://{path}"
    before = metrics(server.url)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect(path)
    push.send_multipart([os.urandom(40)])
    push.send_multipart([b"AMTX" + os.urandom(100)])
    hidden = 64  # the tiny preset
    rows = dict(request_id=[424242], kind=[core.ATTN], block=[1], index=[0], position=[7], attn_rank=[0])
    push.send_multipart(frames(core.make_message(torch.zeros(1, hidden), **rows), src=1))
    time.sleep(1.0)
    push.close()
    ctx.term()
    time.sleep(1.0)  # a heartbeat later, and long after the disconnect is judged
    after = metrics(server.url)
    comm = lambda s: total(s, "amoe_comm_dropped_messages_total", runtime="0")  # noqa: E731
    assert comm(after) - comm(before) == 3
    assert total(after, "amoe_comm_failed_peers", runtime="0") == 0
    serves_and_frees_kv(server.url)


# Slow: the 3 s stall timeout must really elapse; it ends no earlier, and well within a wide margin after.
@pytest.mark.slow
def test_a_stalled_request_ends_with_an_error_and_frees_its_kv(server):
    """An expert runtime stopped (SIGSTOP) for 5 s: a request that gets no token for 3 s (the stall timeout)
    ends with 504; when the runtime wakes, its KV is freed and the server serves on."""
    pid = runtime_pid(server, "amoe: expert runtime 1")
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        reply = post(server.url, {**OK_BODY, "max_tokens": 8})
        assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout", reply.text
        assert 2.5 < time.monotonic() - start < 30
    finally:
        os.kill(pid, signal.SIGCONT)
    serves_and_frees_kv(server.url)


# Slow: the 2 s deadline and the abort's 2 s hold must really elapse (no earlier; wide margins after).
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_request_past_its_deadline_ends_and_an_unconfirmed_abort_stops_holding_kv(model_dir):
    """The attention runtime stopped (SIGSTOP; its heartbeat timeout is long): a request gets no token, ends with
    504 at its 2 s deadline, and its abort cannot be confirmed — the coordinator holds its blocks back (the load
    balancer's view, exported as amoe_kv_total_blocks) for twice the 1 s abort timeout, then lets them go. When the
    runtime wakes, it frees them too and serves on."""
    srv = serve(
        model_dir,
        env={"AMOE_API_KEY": KEY},
        server={"request_timeout_s": 2.0, "abort_timeout_s": 1.0},
        transport={"timeout_s": 60.0},
    )
    with srv as url:
        kv_total = lambda: total(metrics(url), "amoe_kv_total_blocks", rank="0")  # noqa: E731
        blocks = kv_total()
        pid = runtime_pid(srv, "amoe: attention runtime 0")
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            reply = post(url, {**OK_BODY, "max_tokens": 8})
            assert reply.status_code == 504 and "deadline" in reply.json()["error"]["message"], reply.text
            assert 1.5 < time.monotonic() - start < 30
            assert kv_total() == blocks - 1  # held back: 2 + 8 tokens fit one 16-token block
            deadline = time.monotonic() + 30
            while kv_total() != blocks:
                assert time.monotonic() < deadline, "the hold never expired"
                time.sleep(0.2)
        finally:
            os.kill(pid, signal.SIGCONT)
        serves_and_frees_kv(url)


def test_health_shows_details_only_with_the_key(server):
    open_report = httpx.get(server.url + "/health", timeout=10).json()
    assert open_report == {"status": "ok"}
    full = httpx.get(server.url + "/health", headers=HEADERS, timeout=10).json()
    assert {"runtimes", "kv"} <= set(full) and all("pid" in r for r in full["runtimes"])
    assert post(server.url, OK_BODY, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_nothing_listens_beyond_loopback(server):
    """TCP only on loopback; every unix socket (control and data plane) in the coordinator's 0700 run directory."""
    assert listening(server) == {"127.0.0.1"}
    private = run_dir(server)
    assert os.stat(private).st_mode & 0o777 == 0o700
    paths = {
        conn.laddr
        for proc in tree(server)
        for conn in proc.net_connections(kind="unix")
        if conn.laddr  # bound: a listening socket or one it accepted (psutil gives unix sockets no status)
    }
    assert f"{private}/control" in paths
    assert all(any(p.startswith(f"{private}/rt{r}-") for p in paths) for r in range(3)), paths  # data sockets
    assert all(os.path.dirname(p) == private for p in paths), paths


def listening(srv: ServerProcess) -> set[str]:
    """The addresses the server's process tree listens on (TCP and UDP)."""
    found = set()
    for proc in tree(srv):
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN or conn.type == socket.SOCK_DGRAM:
                found.add(conn.laddr.ip)
    return found


# ---- every --parallel mode, its own server


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "sections",
    [
        {"parallel": {"mode": "local"}},
        {"transport": {"plane": "gloo"}},
        {"parallel": {"mode": "ep", "attn_ranks": 2}},
        {"parallel": {"mode": "pingpong"}},
    ],
    ids=["local", "aep-gloo", "ep", "pingpong"],
)
def test_every_mode_refuses_seed_overflow_and_listens_on_loopback(model_dir, sections):
    """Also, in every mode with runtimes, a batch whose attention layer raises (token 901) fails its requests
    alone: the synchronous groups stay in lock-step and serve on."""
    srv = serve(model_dir, env={"AMOE_API_KEY": KEY, "AMOE_FAULTS": "attend:901"}, **sections)
    with srv as url:
        reply = post(url, {**OK_BODY, "seed": 2**64, "temperature": 0.7})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "seed"
        seeded = post(url, {**OK_BODY, "seed": 2**63 - 1, "temperature": 0.7})
        assert seeded.status_code == 200, seeded.text
        if sections.get("parallel", {}).get("mode") != "local":
            failed = post(url, {**OK_BODY, "prompt": [1, 901, 4]})
            assert failed.status_code == 500 and "injected" in failed.json()["error"]["message"], failed.text
        serves_and_frees_kv(url)
        assert listening(srv) == {"127.0.0.1"}


# ---- liveness comes from the loop


# Slow: the runtime's heartbeat timeout (10 s) must really elapse; reported within a wide margin after it.
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stopped_runtime_is_reported_after_its_heartbeat_timeout_and_replaced(server):
    # On the module's server (the tests before it are done with it), whose heartbeat timeout is the default.
    url = server.url
    pid = runtime_pid(server, "amoe: expert runtime 2")
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    while (report := httpx.get(url + "/health", headers=HEADERS, timeout=10).json())["status"] == "ok":
        assert time.monotonic() - start < 30, "still reported healthy"
        time.sleep(0.2)
    assert report["status"] == "degraded" and "expert runtime 2" in report["reason"], report
    while httpx.get(url + "/health", timeout=10).json()["status"] != "ok":  # replaced: serving again
        assert time.monotonic() - start < 120, "not replaced"
        time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    serves_and_frees_kv(url)


@pytest.mark.timeout(120)
def test_a_wedged_loop_is_reported_although_its_heartbeats_go_on(model_dir):
    """Token 902 wedges the attention runtime's loop thread (its control thread still sends heartbeats): the
    loop's own progress counter stops, and the coordinator notices within 15 s. Without restarts the server
    then drains and exits non-zero."""
    env = {"AMOE_API_KEY": KEY, "AMOE_FAULTS": "wedge:902"}
    srv = serve(model_dir, env=env, server={"max_restarts": 0})
    with srv as url:
        threading.Thread(
            target=lambda: post(url, {**OK_BODY, "prompt": [1, 902]}, timeout=60), daemon=True
        ).start()
        assert srv.proc.wait(40) == 1
        log = "\n".join(srv.lines)
        found = re.search(
            r"(\d\d):(\d\d):(\d\d\.\d+) .*attention runtime 0 .*loop made no progress for ([\d.]+) s", log
        )
        assert found and float(found.group(4)) < 15, log[-2000:]


# ---- units of the same guarantees


def test_the_api_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    from amoe.config import ServerSection
    from amoe.errors import ConfigError
    from amoe.serve import api_key

    monkeypatch.delenv("AMOE_API_KEY", raising=False)
    assert api_key(ServerSection()) is None
    monkeypatch.setenv("AMOE_API_KEY", "from-env")
    assert api_key(ServerSection()) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert api_key(ServerSection(api_key_file=str(key_file))) == "from-file"
    assert api_key(ServerSection(api_key="from-flag")) == "from-flag"
    with pytest.raises(ConfigError, match="cannot read"):
        api_key(ServerSection(api_key_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="not both"):
        ServerSection(api_key="a", api_key_file=str(key_file))


def test_an_unconfirmed_abort_stops_holding_kv_after_its_timeout(model_dir):
    """The coordinator holds an aborted request's blocks back until its rank confirms, but not forever."""
    from amoe.config import AmoeConfig
    from coordinator.cluster.runtimes import RuntimeProc
    from coordinator.requests.cluster_backend import ClusterBackend

    now = [100.0]
    config = AmoeConfig().replace(server={"abort_timeout_s": 0.2})
    backend = ClusterBackend(config, model_dir, clock=lambda: now[0])
    backend.cluster.runtimes = [RuntimeProc(0, "attention", proc=None, num_kv_blocks=10, kv_free=4)]
    backend._aborting[5] = (0, 6, now[0] + 0.4)
    now[0] += 0.39
    assert backend.kv_usage()[0].total_blocks == 4  # its 6 blocks are still held back
    now[0] += 0.02
    assert backend.kv_usage()[0].total_blocks == 10 and not backend._aborting

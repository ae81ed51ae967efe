"""Chaos (self-healing): 2 attention + 3 expert runtimes serving 24 concurrent streaming greedy requests while
runtimes of alternating kind are killed with SIGKILL, four in a row, and then an expert runtime is stopped (SIGSTOP).
Each fault hits mid-stream and the next comes as soon as the last one's replacement serves (no fixed schedule: the
time between faults is the healing's, not a guess at it). Every request completes with exactly the text of a run
without faults, /health ends "ok", every KV block is free again, and nothing is left behind."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
import uuid

import httpx
import psutil
import pytest

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.checked_load import ClosedLoop, reference_texts
from amoe.testing.servers import ServerProcess

MODEL = "tiny-chaos"
MAX_TOKENS = 48
PROMPTS = [[1, 3 + i, 40 + 7 * i, 9] for i in range(24)]
WAIT_S = 120.0  # hang guard for each step; a stop is noticed after the 10 s heartbeat timeout, then replaced
STOPPED_S = 20.0  # how long the stopped runtime stays stopped unless it is replaced (killed) first


def tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("AMOE_TEST_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def runtimes(url: str) -> dict[int, dict]:
    return {r["runtime"]: r for r in httpx.get(f"{url}/health", timeout=10).json()["runtimes"]}


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.1)


def tokens(load: ClosedLoop) -> int:
    return sum(len(o.token_times) for o in load.outcomes)


def fault(
    url: str, load: ClosedLoop, victim: int, sig: signal.Signals, wakes: list[threading.Timer]
) -> float:
    """Once tokens stream, send `sig` to runtime `victim`; return when its replacement serves and /health is "ok"
    again. The time of the fault. A stopped process is woken after STOPPED_S if it still exists then (the
    watchdog should have killed it long before)."""
    streamed = tokens(load)
    wait_until(lambda: tokens(load) > streamed + 24, "tokens streaming")
    before = runtimes(url)[victim]
    os.kill(before["pid"], sig)
    at = time.monotonic()
    if sig == signal.SIGSTOP:
        pid = before["pid"]
        wakes.append(
            threading.Timer(STOPPED_S, lambda: psutil.pid_exists(pid) and os.kill(pid, signal.SIGCONT))
        )
        wakes[-1].start()

    def back() -> bool:
        report = httpx.get(f"{url}/health", timeout=10).json()
        now = {r["runtime"]: r for r in report["runtimes"]}[victim]
        return now["restarts"] > before["restarts"] and report["status"] == "ok"

    wait_until(back, f"{before['role']} runtime {victim} replaced after {sig.name}")
    return at


@pytest.mark.timeout(300)
def test_requests_survive_killed_and_stopped_runtimes(tmp_path):
    model = make_model("tiny", tmp_path / MODEL, seed=0)
    references = reference_texts(str(model), PROMPTS, MAX_TOKENS)
    tag = uuid.uuid4().hex
    # A stream pauses while its runtime is replaced; on a busy host a replacement can take most of a minute to load,
    # so the stall watchdog (60 s by default, not what this test is about) gets more room.
    config = AmoeConfig().replace(
        model={"path": str(model)}, parallel={"attn_ranks": 2, "expert_ranks": 3},
        server={"max_restarts": 20, "stall_timeout_s": 300.0},
    )  # fmt: skip
    srv = ServerProcess(config, env={"AMOE_TEST_TAG": tag, "SPT_NOENV": "1"})
    rng = random.Random(7)
    chaos: list[str] = []
    wakes: list[threading.Timer] = []
    with srv as url:
        start = time.monotonic()
        with ClosedLoop(url, MODEL, PROMPTS, references, MAX_TOKENS, workers=24) as load:
            for kind in ("expert", "attention", "expert", "attention"):
                victim = rng.choice([rt for rt, r in runtimes(url).items() if r["role"] == kind])
                at = fault(url, load, victim, signal.SIGKILL, wakes)
                chaos.append(
                    f"t={at - start:.0f}s kill {kind} runtime {victim}, back at {time.monotonic() - start:.0f}s"
                )
            victim = rng.choice([2, 3, 4])
            at = fault(url, load, victim, signal.SIGSTOP, wakes)
            chaos.append(
                f"t={at - start:.0f}s stop expert runtime {victim}, back at {time.monotonic() - start:.0f}s"
            )
            last_fault = time.monotonic()
            wait_until(
                lambda: any(o.ended > last_fault for o in load.outcomes), "requests end after the last fault"
            )
        health = httpx.get(f"{url}/health", timeout=10).json()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        pids = [p.pid for p in tagged(tag)]
    for wake in wakes:  # its process was killed when it was replaced: nothing is left to wake
        wake.cancel()
    assert load.outcomes and not load.failed, [(o.prompt, o.error) for o in load.failed][:5]
    assert not load.mismatched, [(o.prompt, o.text[:60]) for o in load.mismatched][:5]
    # The load kept flowing: every worker's request in flight at the end finished, and requests also finished
    # after the last fault (how many is a matter of the host's speed, not of correctness).
    assert len(load.outcomes) >= 24 and any(o.ended > last_fault for o in load.outcomes), len(load.outcomes)
    assert health["status"] == "ok", health
    assert all(kv["free_blocks"] == kv["total_blocks"] for kv in health["kv"]), health["kv"]
    restarts = sum(r["restarts"] for r in health["runtimes"])
    assert restarts >= 5, (restarts, chaos)
    readmitted = float(re.search(r"^amoe_cluster_readmitted_requests_total (\S+)", metrics, re.M).group(1))
    assert readmitted > 0, chaos
    assert not [
        p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
    assert not tagged(tag)

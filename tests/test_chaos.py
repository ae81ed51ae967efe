"""Chaos (self-healing): 2 attention + 3 expert runtimes serving 24 concurrent streaming greedy requests while a
runtime of either kind is killed with SIGKILL every ~10 s and one is stopped (SIGSTOP) for 20 s. Every request
completes with exactly the text of a run without faults, /health ends "ok", every KV block is free again, and
nothing is left behind."""

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

from amoe.bench.servers import ServerProcess
from amoe.model.make import make_model
from amoe.testing.checked_load import ClosedLoop, reference_texts

MODEL = "tiny-chaos"
MAX_TOKENS = 48
PROMPTS = [[1, 3 + i, 40 + 7 * i, 9] for i in range(24)]


def tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("AMOE_TEST_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def runtimes(url: str) -> dict[int, tuple[str, int]]:
    report = httpx.get(f"{url}/health", timeout=10).json()
    return {r["runtime"]: (r["role"], r["pid"]) for r in report["runtimes"]}


@pytest.mark.timeout(300)
def test_requests_survive_killed_and_stopped_runtimes(tmp_path):
    model = make_model("tiny", tmp_path / MODEL, seed=0)
    references = reference_texts(str(model), PROMPTS, MAX_TOKENS)
    tag = uuid.uuid4().hex
    # A stream pauses while its runtime is replaced; on a busy host a replacement can take most of a minute to load,
    # so the stall watchdog (60 s by default, not what this test is about) gets more room.
    flags = ["--model", str(model), "--attn-ranks", "2", "--expert-ranks", "3", "--server-max-restarts", "20",
             "--server-stall-timeout-s", "300"]  # fmt: skip
    srv = ServerProcess(flags, env={"AMOE_TEST_TAG": tag, "SPT_NOENV": "1"})
    rng = random.Random(7)
    chaos: list[str] = []
    with srv as url:
        start = time.monotonic()
        with ClosedLoop(url, MODEL, PROMPTS, references, MAX_TOKENS, workers=24) as load:
            for at, kind in ((4, "expert"), (14, "attention"), (24, "expert"), (34, "attention")):
                time.sleep(max(0.0, start + at - time.monotonic()))
                victim = rng.choice([rt for rt, (role, _) in runtimes(url).items() if role == kind])
                os.kill(runtimes(url)[victim][1], signal.SIGKILL)
                chaos.append(f"t={time.monotonic() - start:.0f}s kill {kind} runtime {victim}")
            time.sleep(max(0.0, start + 40 - time.monotonic()))
            stopped = runtimes(url)[rng.choice([2, 3, 4])][1]
            os.kill(stopped, signal.SIGSTOP)
            chaos.append(f"t={time.monotonic() - start:.0f}s stop pid {stopped}")
            threading.Timer(
                20, lambda: os.kill(stopped, signal.SIGCONT) if psutil.pid_exists(stopped) else None
            ).start()
            time.sleep(max(0.0, start + 64 - time.monotonic()))  # the stopped one is replaced by now
            last_fault = time.monotonic()
        health = httpx.get(f"{url}/health", timeout=10).json()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        pids = [p.pid for p in tagged(tag)]
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

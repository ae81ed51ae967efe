"""Self-healing on the gloo tensor plane (`--parallel aep --transport gloo`): an expert runtime, then an attention
runtime, killed (SIGKILL) while 8 greedy streams run. Each is replaced with new groups with its peers while the
survivors keep serving; every stream ends with exactly the text of a run without faults, /health is "ok" again and
every KV block is free. (The NCCL variant is tests/gpu/test_gpu_healing.py.)"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.checked_load import ClosedLoop, reference_texts
from amoe.testing.servers import ServerProcess

MODEL = "tiny-heal-gloo"
MAX_TOKENS = 40
PROMPTS = [[1, 5 + i, 60 + 11 * i, 9] for i in range(8)]
WAIT_S = 120.0  # hang guard for each phase


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.1)


def kill_mid_stream(url: str, load: ClosedLoop, role: str) -> int:
    """SIGKILL a runtime of `role` while streams are receiving tokens; wait until it is back. Its runtime id."""
    streamed = sum(len(o.token_times) for o in load.outcomes)
    wait_until(lambda: sum(len(o.token_times) for o in load.outcomes) > streamed + 20, "tokens streaming")
    victim = next(r for r in health(url)["runtimes"] if r["role"] == role)
    restarts = victim["restarts"]
    os.kill(victim["pid"], signal.SIGKILL)
    back = lambda: health(url)["runtimes"][victim["runtime"]]["restarts"] > restarts  # noqa: E731
    wait_until(lambda: back() and health(url)["status"] == "ok", f"{role} runtime {victim['runtime']} back")
    return victim["runtime"]


@pytest.mark.timeout(400)
def test_streams_survive_killed_runtimes_on_the_gloo_plane(tmp_path):
    model = make_model("tiny", tmp_path / MODEL, seed=0)
    references = reference_texts(str(model), PROMPTS, MAX_TOKENS)
    config = AmoeConfig().replace(
        model={"path": str(model)}, parallel={"attn_ranks": 2, "expert_ranks": 3}, transport={"plane": "gloo"}
    )
    srv = ServerProcess(config, env={"AMOE_DEVICE": "cpu"})
    with srv as url:
        with ClosedLoop(url, MODEL, PROMPTS, references, MAX_TOKENS, workers=8) as load:
            expert = kill_mid_stream(url, load, "expert")
            attention = kill_mid_stream(url, load, "attention")
            done = len([o for o in load.outcomes if o.ended])
            wait_until(lambda: len([o for o in load.outcomes if o.ended]) > done + 8, "serving on after both")
        report = health(url)
    assert load.outcomes and not load.failed, [(o.prompt, o.error) for o in load.failed][:5]
    assert not load.mismatched, [(o.prompt, o.text[:60]) for o in load.mismatched][:5]
    assert report["status"] == "ok", report
    assert [r["restarts"] for r in report["runtimes"] if r["runtime"] in (expert, attention)] == [1, 1]
    assert sum(r["restarts"] for r in report["runtimes"]) == 2  # the survivors were never restarted
    assert all(kv["free_blocks"] == kv["total_blocks"] for kv in report["kv"]), report["kv"]
    assert any("gloo transport" in line for line in srv.lines)  # the served plane was gloo
    assert not any("self-healing is off" in line for line in srv.lines)

"""Self-healing on the NCCL tensor plane (`--parallel aep --device cuda --transport nccl`, one runtime per GPU): the
expert runtime, then the attention runtime, killed (SIGKILL) while greedy streams run. Each replacement gets new
NCCL groups with its peer (one per direction, keyed by both processes' generations) while the survivor keeps serving;
every stream ends with exactly the text the same server gave before any fault, /health is "ok" again, every KV block
is free. The CPU suite runs the same on gloo (tests/test_healing_planes.py)."""

from __future__ import annotations

import httpx
import pytest
from test_healing_planes import MAX_TOKENS, PROMPTS, health, kill_mid_stream, wait_until

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.checked_load import ClosedLoop
from amoe.testing.servers import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

MODEL = "tiny-heal-nccl"


def fault_free_texts(url: str) -> list[str]:
    """Each prompt's greedy text from the server before any fault: the reference the streams must equal."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return [
        httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=120).json()["choices"][0][
            "text"
        ]
        for p in PROMPTS
    ]


@pytest.mark.timeout(900)
def test_streams_survive_killed_runtimes_on_the_nccl_plane(tmp_path):
    model = make_model("tiny", tmp_path / MODEL, seed=0)
    config = AmoeConfig().replace(
        model={"path": str(model), "dtype": "float32"}, device={"kind": "cuda"}, transport={"plane": "nccl"},
        parallel={"attn_ranks": 1, "expert_ranks": 1},
    )  # fmt: skip
    srv = ServerProcess(config, startup_timeout_s=300)
    with srv as url:
        references = fault_free_texts(url)
        with ClosedLoop(url, MODEL, PROMPTS, references, MAX_TOKENS, workers=8) as load:
            kill_mid_stream(url, load, "expert")
            kill_mid_stream(url, load, "attention")
            done = len([o for o in load.outcomes if o.ended])
            wait_until(lambda: len([o for o in load.outcomes if o.ended]) > done + 8, "serving on after both")
        report = health(url)
    assert any("nccl transport" in line for line in srv.lines), "\n".join(srv.lines)
    assert load.outcomes and not load.failed, [(o.prompt, o.error) for o in load.failed][:5]
    assert not load.mismatched, [(o.prompt, o.text[:60]) for o in load.mismatched][:5]
    assert report["status"] == "ok" and [r["restarts"] for r in report["runtimes"]] == [1, 1], report
    assert all(kv["free_blocks"] == kv["total_blocks"] for kv in report["kv"]), report["kv"]

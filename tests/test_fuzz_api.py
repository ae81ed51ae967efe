"""The API fuzzed from its own OpenAPI schema (schemathesis) against a live server with 2 attention + 2 expert
runtimes: ~200 generated requests, none answered with a 5xx, the server healthy and every KV block free after.
(bench/fuzz_api.py runs the same with 1000+.)"""

import time

import httpx
import pytest

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.fuzz import fuzz
from amoe.testing.servers import ServerProcess


@pytest.mark.timeout(300)
def test_generated_requests_never_get_a_server_error(tmp_path):
    model = make_model("tiny", tmp_path / "fuzz-model", seed=0)
    config = AmoeConfig().replace(
        model={"path": str(model), "max_model_len": 64}, parallel={"attn_ranks": 2, "expert_ranks": 2}
    )
    with ServerProcess(config, startup_timeout_s=120) as url:
        report = fuzz(url, 200, seed=1)
        assert report.requests >= 200
        assert report.ok, "\n".join(report.server_errors[:10])
        assert sum(n for status, n in report.by_status.items() if status == 200) > 0  # some were valid
        assert sum(n for status, n in report.by_status.items() if 400 <= status < 500) > 0
        deadline = time.monotonic() + 30
        while True:
            health = httpx.get(url + "/health", timeout=10).json()
            if health["running"] == 0 and all(k["free_blocks"] == k["total_blocks"] for k in health["kv"]):
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        assert health["status"] == "ok"

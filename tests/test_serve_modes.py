"""`amoe serve --parallel ep|pingpong` through the real server equals the single-process reference (greedy, tiny
model); `--executor emulated` with a model profile (no checkpoint) answers a request with max_tokens tokens."""

import asyncio
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from amoe.llm import LLM
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams

PROMPTS = [[1], [1, 5, 9, 200], [1] + list(range(30, 45)), [1] + list(range(100, 140))]
MAX_TOKENS = [9, 6, 7, 5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("modes") / "tiny-modes", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=str(model_dir))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params)]


class Server:
    """`amoe serve --port 0 FLAGS` as a child process; the URL is parsed from its log."""

    def __init__(self, *flags: str) -> None:
        env = {**os.environ, "AMOE_LOG_LEVEL": "INFO"}
        cmd = [sys.executable, "-m", "amoe", "serve", "--port", "0", *flags]
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def __enter__(self) -> str:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            for line in self.lines:
                if match := re.search(r"amoe serve: listening on (http://\S+)$", line):
                    return match.group(1)
            assert self.proc.poll() is None, "server exited early:\n" + "\n".join(self.lines)
            time.sleep(0.05)
        raise AssertionError("no listening line:\n" + "\n".join(self.lines))

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(2)
        try:
            assert self.proc.wait(30) == 0, "\n".join(self.lines)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


async def _complete_all(url: str, prompts, max_tokens, model=None) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt, n):
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags",
    [
        ("--parallel", "ep", "--attn-ranks", "2"),
        (
            "--parallel",
            "pingpong",
            "--attn-ranks",
            "1",
            "--expert-ranks",
            "2",
            "--parallel-micro-batches",
            "2",
        ),
    ],
    ids=["ep", "pingpong"],
)
def test_sync_modes_match_reference(model_dir, reference, flags):
    with Server("--model", str(model_dir), *flags) as url:
        answers = asyncio.run(_complete_all(url, PROMPTS, MAX_TOKENS))
        health = httpx.get(f"{url}/health").json()
    assert [a["choices"][0]["text"] for a in answers] == reference
    assert health["status"] == "ok" and health["mode"] == flags[1]


@pytest.mark.timeout(120)
def test_emulated_profile_serves_max_tokens():
    flags = (
        "--executor", "emulated", "--executor-profile", "mixtral-8x7b-mqa", "--executor-top-k", "1",
        "--routing", "skew-exp", "--time-scale", "2", "--attn-ranks", "1", "--expert-ranks", "2",
    )  # fmt: skip
    with Server(*flags) as url:
        answers = asyncio.run(_complete_all(url, [[11, 12, 13, 14], [20] * 30], [7, 3]))
        health = httpx.get(f"{url}/health").json()
    assert [a["usage"]["completion_tokens"] for a in answers] == [7, 3]
    assert answers[0]["model"] == "mixtral-8x7b-mqa"
    assert health["executor"]["time_scale"] == 2.0
    # Memory, not cache.num_blocks, bounds the KV cache of an emulated A100 80GB: millions of tokens.
    assert health["kv"][0]["total_blocks"] * 16 > 1_000_000

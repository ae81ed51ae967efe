"""Routing traces of the real server: `amoe serve --offload-record FILE` on a model, fed prompts, then stopped."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from amoe.errors import ConfigError

_LISTENING = re.compile(r"amoe serve: listening on (http://\S+)$")
START_TIMEOUT_S = 120.0


def record_served(model_dir: Path, prompts: list[list[int]], record: Path, max_tokens: int) -> None:
    """Serve `model_dir` (AEP: one attention and two expert runtimes) with the routing recorded to `record`, send
    every prompt (greedy, `max_tokens` each, eight at a time) and stop the server, which flushes the record."""
    cmd = [
        sys.executable, "-m", "amoe", "serve", "--model", str(model_dir), "--port", "0", "--parallel", "aep",
        "--attn-ranks", "1", "--expert-ranks", "2", "--offload-record", str(record),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stderr), daemon=True).start()
    try:
        url = _wait_listening(proc, lines)
        asyncio.run(_complete_all(url, prompts, max_tokens))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not record.is_file():
        raise ConfigError(f"the recording server exited {proc.returncode}: {lines[-1] if lines else ''}")


def _wait_listening(proc: subprocess.Popen, lines: list[str]) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in list(lines):
            if match := _LISTENING.search(line):
                return match.group(1)
        if proc.poll() is not None:
            raise ConfigError(f"the recording server exited {proc.returncode}: {lines[-1] if lines else ''}")
        time.sleep(0.1)
    raise ConfigError(f"the recording server did not start within {START_TIMEOUT_S:.0f} s")


async def _complete_all(url: str, prompts: list[list[int]], max_tokens: int) -> None:
    import httpx

    limit = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt: list[int]) -> None:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with limit:
                (await client.post("/v1/completions", json=body)).raise_for_status()

        await asyncio.gather(*(one(p) for p in prompts))

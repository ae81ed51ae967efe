"""Load whose every answer is checked: streaming greedy completions of a fixed set of prompts, each compared with
its reference text, for chaos and soak runs (tests/test_chaos.py, bench/chaos.py, bench/soak.py).

`ClosedLoop` keeps N requests in flight; `OpenLoop` starts requests at a steady rate. Both run on their own event
loop thread and record, per request, whether it completed, whether its text equals the reference, and when each
of its tokens arrived.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    prompt: int  # index into the prompt set
    started: float
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None
    ended: float = 0.0

    @property
    def completed(self) -> bool:
        return self.error is None


def reference_texts(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """What the single-process reference engine generates for each prompt (greedy, no eos)."""
    from amoe.llm import LLM
    from amoe.sampling_params import SamplingParams

    llm = LLM(model=model_dir)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [out.outputs[0].text for out in outputs]


class _Load(abc.ABC):
    def __init__(
        self, url: str, model: str, prompts: list[list[int]], references: list[str], max_tokens: int
    ):
        self.url, self.model, self.prompts = url, model, prompts
        self.references, self.max_tokens = references, max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="checked-load", daemon=True
        )
        self._next = itertools.count()

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout_s: float = 180.0) -> None:
        """Start no new request; wait for those in flight."""
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def mismatched(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.completed and o.text != self.references[o.prompt]]

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.completed]

    @abc.abstractmethod
    async def _main(self) -> None:
        """Issue requests until stopped."""

    async def _one(self, client: httpx.AsyncClient) -> None:
        i = next(self._next) % len(self.prompts)
        outcome = Outcome(i, time.monotonic())
        self.outcomes.append(outcome)
        body = {
            "model": self.model,
            "prompt": self.prompts[i],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome.error = event["error"]["message"]
                        return
                    outcome.token_times.append(time.monotonic())
                    outcome.text += event["choices"][0]["text"]
        except httpx.HTTPError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        finally:
            outcome.ended = time.monotonic()


class ClosedLoop(_Load):
    """`workers` requests always in flight, each starting the next prompt as soon as it ends."""

    def __init__(self, *args, workers: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers

    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:

            async def worker() -> None:
                while not self._stop.is_set():
                    await self._one(client)

            await asyncio.gather(*(worker() for _ in range(self.workers)))


class OpenLoop(_Load):
    """A request every 1/rate seconds, however many are in flight."""

    def __init__(self, *args, rate: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rate = rate

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
            tasks, start = [], time.monotonic()
            for n in itertools.count():
                if self._stop.is_set():
                    break
                await asyncio.sleep(max(0.0, start + n / self.rate - time.monotonic()))
                tasks.append(asyncio.ensure_future(self._one(client)))
            await asyncio.gather(*tasks)

"""LocalBackend's threading with a scripted fake engine: delivery, abort on close, idleness, engine death."""

import asyncio
import threading
import time

import pytest

from amoe.backends.local import LocalBackend
from amoe.engine.request import EngineOutput
from amoe.errors import RequestError, RequestFailed


class FakeBlocks:
    def __init__(self, total: int) -> None:
        self.num_total_blocks = total
        self.used: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - sum(self.used.values())


class FakeEngine:
    """Emits token 7 per step per request until max_tokens; step number `fail_on_step` raises."""

    def __init__(self, fail_on_step: int | None = None) -> None:
        self.blocks = FakeBlocks(8)
        self.requests: dict[str, list] = {}
        self.steps = 0
        self.idle_checks = 0
        self.aborted: list[str] = []
        self.fail_on_step = fail_on_step
        self.thread_names: set[str] = set()

    def add_request(self, request_id, prompt_token_ids, params):
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        self.requests[request_id] = [params.max_tokens, 0]
        self.blocks.used[request_id] = 1

    def has_unfinished(self):
        self.idle_checks += 1
        return bool(self.requests)

    def step(self):
        self.thread_names.add(threading.current_thread().name)
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom in the model")
        time.sleep(0.002)  # a model step takes time; lets the event loop run in between
        outputs = []
        for request_id, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] >= state[0]
            if done:
                self._drop(request_id)
            outputs.append(
                EngineOutput(request_id, [7], finished=done, finish_reason="length" if done else None)
            )
        return outputs

    def abort_all(self):
        ids = list(self.requests)
        for request_id in ids:
            self._drop(request_id)
        return ids

    def sequences(self, request_id):
        return [0]

    def abort(self, request_id, index=None):
        if request_id in self.requests:
            self.aborted.append(request_id)
            self._drop(request_id)

    def _drop(self, request_id):
        del self.requests[request_id]
        del self.blocks.used[request_id]


class Params:
    num_sequences = 1

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


async def collect(backend, request_id, max_tokens, prompt=(1, 2)):
    return [d async for d in backend.generate(request_id, list(prompt), Params(max_tokens))]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.mark.timeout(20)
def test_tokens_stream_back_from_the_engine_thread():
    engine = FakeEngine()

    async def scenario():
        backend = LocalBackend(lambda: engine, block_size=16)
        await backend.start()
        try:
            results = await asyncio.gather(collect(backend, "a", 3), collect(backend, "b", 5))
        finally:
            await backend.shutdown()
        return results, backend

    (a, b), backend = run(scenario())
    assert sum(len(d.token_ids) for d in a) == 3 and a[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in b) == 5 and b[-1].finish_reason == "length"
    assert engine.thread_names == {"amoe-engine"}
    assert backend.health()["status"] == "stopped"


@pytest.mark.timeout(20)
def test_closing_the_stream_early_aborts_the_request_and_frees_its_blocks():
    engine = FakeEngine()

    async def scenario():
        backend = LocalBackend(lambda: engine, block_size=16)
        await backend.start()
        try:
            stream = backend.generate("long", [1], Params(10_000))
            await anext(stream)
            assert backend.kv_usage()[0].free_blocks == 7
            await stream.aclose()
            for _ in range(200):
                if backend.kv_usage()[0].free_blocks == 8:
                    break
                await asyncio.sleep(0.01)
        finally:
            await backend.shutdown()
        return backend

    backend = run(scenario())
    assert engine.aborted == ["long"]
    assert backend.kv_usage()[0].free_blocks == 8


@pytest.mark.timeout(20)
def test_the_engine_thread_sleeps_when_idle():
    engine = FakeEngine()

    async def scenario():
        backend = LocalBackend(lambda: engine, block_size=16)
        await backend.start()
        try:
            await collect(backend, "a", 2)
            await asyncio.sleep(0.1)
            checks = engine.idle_checks
            await asyncio.sleep(0.5)
            return engine.idle_checks - checks
        finally:
            await backend.shutdown()

    assert run(scenario()) == 0


@pytest.mark.timeout(20)
def test_a_rejected_request_fails_alone():
    engine = FakeEngine()

    async def scenario():
        backend = LocalBackend(lambda: engine, block_size=16)
        await backend.start()
        try:
            with pytest.raises(RequestError, match="empty"):
                await collect(backend, "bad", 2, prompt=())
            return await collect(backend, "good", 2), backend.health()
        finally:
            await backend.shutdown()

    good, health = run(scenario())
    assert good[-1].finish_reason == "length" and health["status"] == "ok"


@pytest.mark.timeout(20)
def test_an_engine_step_that_raises_fails_its_requests_and_the_backend_serves_on():
    engine = FakeEngine(fail_on_step=3)

    async def scenario():
        backend = LocalBackend(lambda: engine, block_size=16)
        await backend.start()
        try:
            results = await asyncio.gather(
                collect(backend, "a", 100), collect(backend, "b", 100), return_exceptions=True
            )
            late = await collect(backend, "late", 2)
            return results, late, backend.health()
        finally:
            await backend.shutdown()

    results, late, health = run(scenario())
    assert all(isinstance(r, RequestFailed) and "boom in the model" in str(r) for r in results)
    assert late[-1].finish_reason == "length" and health["status"] == "ok"
    assert engine.blocks.used == {}  # the failed requests' KV was freed

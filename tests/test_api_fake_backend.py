"""The API layer against a scripted backend: API keys, the 503 queue bound, engine death, stop-string aborts."""

import asyncio

import httpx
import pytest

from amoe.errors import EngineDeadError
from coordinator.api_server import create_app
from coordinator.backend import Backend, RankKV, TokenDelta
from coordinator.validation import ModelInfo

MODEL = "fake"
BLOCK = 16


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def encode_chat(self, messages, add_generation_prompt=True):
        return self.encode(
            "".join(f"<{m['role']}>{m['content']}" for m in messages), add_special_tokens=False
        )


class CharDetokenizer:
    def add(self, token_id):
        return chr(token_id)

    def flush(self):
        return ""


class ScriptedBackend(Backend):
    """Generates the characters of `script` (repeated); waits on `gate` before each token when it is set."""

    def __init__(self, total_blocks=4, script="abcdefgh"):
        self.total_blocks = total_blocks
        self.script = script
        self.gate: asyncio.Event | None = None
        self.dead = False
        self.die_after: int | None = None  # tokens generated before the engine "dies"
        self.active: set[str] = set()
        self.aborted: list[str] = []

    @property
    def block_size(self):
        return BLOCK

    async def start(self):
        pass

    async def shutdown(self):
        pass

    async def generate(self, request_id, prompt_token_ids, sampling_params, rank=0):
        if self.dead:
            raise EngineDeadError("engine thread died: boom")
        self.active.add(request_id)
        finished = False
        try:
            for i in range(sampling_params.max_tokens):
                if self.gate is not None:
                    await self.gate.wait()
                await asyncio.sleep(0)
                if i == self.die_after:
                    self.dead = True
                if self.dead:
                    raise EngineDeadError("engine thread died: boom")
                finished = i + 1 == sampling_params.max_tokens
                yield TokenDelta([ord(self.script[i % len(self.script)])], "length" if finished else None)
        finally:
            self.active.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    def abort(self, request_id):
        pass

    def health(self):
        return {"status": "dead", "error": "boom"} if self.dead else {"status": "ok"}

    def kv_usage(self):
        return [RankKV(free_blocks=self.total_blocks, total_blocks=self.total_blocks)]


def make_client(backend, **kwargs):
    app = create_app(
        backend, CharTokenizer(), ModelInfo(MODEL, 64, 100_000), lambda ids: CharDetokenizer(), **kwargs
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=10)


def completion(**extra):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.mark.timeout(20)
def test_api_key_is_required_everywhere_but_health():
    async def scenario():
        async with make_client(ScriptedBackend(), api_key="sesame") as client:
            good = {"Authorization": "Bearer sesame"}
            for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
                    response = await client.request(method, path, json=completion(), headers=bad)
                    assert response.status_code == 401, (bad, path)
                    assert response.json()["error"]["code"] == "invalid_api_key"
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/v1/models", headers=good)).status_code == 200
            response = await client.post("/v1/completions", json=completion(), headers=good)
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == "abcd"

    run(scenario())


@pytest.mark.timeout(20)
def test_a_full_waiting_queue_answers_503_and_waiters_run_later():
    backend = ScriptedBackend(total_blocks=4)  # 64 tokens: exactly one request of prompt 3 + 61 new tokens

    async def scenario():
        backend.gate = asyncio.Event()
        async with make_client(backend, max_waiting=1) as client:
            body = completion(max_tokens=61)
            first = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(client.post("/v1/completions", json=body))  # waits for KV
            await asyncio.sleep(0.05)
            third = await client.post("/v1/completions", json=body)
            assert third.status_code == 503
            error = third.json()["error"]
            assert error["type"] == "server_error" and "max_waiting" in error["message"]
            health = (await client.get("/health")).json()
            assert (health["running"], health["waiting"]) == (1, 1)
            backend.gate.set()
            assert (await first).status_code == 200
            assert (await second).status_code == 200

    run(scenario())


@pytest.mark.timeout(20)
def test_a_dead_engine_fails_requests_with_503_and_health_reports_it():
    backend = ScriptedBackend()

    async def scenario():
        backend.gate = asyncio.Event()
        async with make_client(backend) as client:
            pending = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await asyncio.sleep(0.05)
            backend.dead = True
            backend.gate.set()
            response = await pending
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
            assert (await client.post("/v1/completions", json=completion())).status_code == 503
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "dead"

    run(scenario())


@pytest.mark.timeout(20)
def test_an_engine_death_mid_stream_becomes_an_error_event():
    backend = ScriptedBackend()
    backend.die_after = 2

    async def scenario():
        async with make_client(backend) as client:
            response = await client.post("/v1/completions", json=completion(stream=True))
        lines = [line for line in response.text.splitlines() if line]
        assert response.status_code == 200  # the headers went out before the engine died
        assert '"text":"a"' in lines[0] and '"text":"b"' in lines[1]
        assert '"engine_dead"' in lines[-2] and lines[-1] == "data: [DONE]"

    run(scenario())


@pytest.mark.timeout(20)
def test_a_stop_string_aborts_the_backend_request():
    backend = ScriptedBackend(script="abcdefgh")

    async def scenario():
        async with make_client(backend) as client:
            response = await client.post("/v1/completions", json=completion(max_tokens=40, stop="de"))
            body = response.json()
            assert body["choices"][0] == {
                "index": 0,
                "text": "abc",
                "logprobs": None,
                "finish_reason": "stop",
            }
            assert body["usage"]["completion_tokens"] == 5
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 40,
                    "stop": "c",
                },
            )
            assert chat.json()["choices"][0]["message"]["content"] == "ab"

    run(scenario())
    assert len(backend.aborted) == 2 and not backend.active

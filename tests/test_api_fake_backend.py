"""The API layer against a scripted backend: API keys, the 503 queue bound, engine death, stop-string aborts, the
order of a stream's choices."""

import asyncio
import json
import re

import httpx
import pytest
from factories import CharDetokenizer, CharTokenizer, streamed_choices

from amoe.config import ServerSection
from amoe.errors import EngineDeadError
from amoe.logprobs import Logprobs
from coordinator.api.app import create_app
from coordinator.api.validation import ModelInfo
from coordinator.requests.backend import Backend, RankKV, TokenDelta

MODEL = "fake"
BLOCK = 16


class ScriptedBackend(Backend):
    """Generates the characters of `script` (repeated); waits on `gate` before each token when it is set."""

    def __init__(self, total_blocks=4, script="abcdefgh"):
        self.total_blocks = total_blocks
        self.script = script
        self.gate: asyncio.Event | None = None
        self.dead = False
        self.die_after: int | None = None  # tokens generated before the engine "dies"
        self.delay = 0.0  # seconds per token
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
                await asyncio.sleep(self.delay)
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
        async with make_client(backend, server=ServerSection(max_waiting=1)) as client:
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


class BurstBackend(ScriptedBackend):
    """Sequence i of a request makes lengths[i] tokens (ending "length" at max_tokens, else "stop"): the script from
    place len(prompt) + i on, each with its log-probability. A request's deltas come all at once, round-robin over
    its running sequences, with nothing awaited between them: an engine step, or a backlog, that outran the API's
    loop."""

    def __init__(self, lengths: list[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.lengths = lengths

    async def generate(self, request_id, prompt_token_ids, sampling_params, rank=0):
        max_tokens = sampling_params.max_tokens
        lengths = [min(n, max_tokens) for n in self.lengths[: sampling_params.num_sequences]]
        for t in range(max(lengths)):
            for i, length in enumerate(lengths):
                if t >= length:
                    continue
                token = ord(self.script[(len(prompt_token_ids) + i + t) % len(self.script)])
                end = ("length" if length == max_tokens else "stop") if t + 1 == length else None
                logprobs = Logprobs([token], [-0.5 - t], [1], [[token]], [[-0.5 - t]])
                yield TokenDelta([token], end, i, logprobs if sampling_params.logprobs is not None else None)


@pytest.mark.timeout(20)
def test_each_streamed_choice_of_a_list_of_prompts_ends_once_after_all_its_text():
    """n=2 over two prompts, each prompt's deltas all there before the API sends its first chunk, sequence 1 ending
    ("stop") before sequence 0 ("length"): each choice's finish_reason comes once, on its last chunk; each chunk
    carries the log-probabilities of its own text; the stream adds up to the whole response, usage last."""
    backend = BurstBackend([4, 2], total_blocks=8, script="abcdefghijklmnop")
    body = completion(prompt=["ab", "abcd"], n=2, logprobs=1)

    async def scenario():
        async with make_client(backend) as client:
            whole = await client.post("/v1/completions", json=body)
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            streamed = await client.post("/v1/completions", json=stream)
        return whole.json(), streamed.text

    whole, text = run(scenario())
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "defg", "length"), (1, "ef", "stop"), (2, "fghi", "length"), (3, "gh", "stop"),
    ]  # fmt: skip
    lines = [line for line in text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    chunks = streamed_choices(events)
    assert sorted(chunks) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        mine = chunks[choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"], choice["index"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"], choice["index"]
        assert all("".join(c["logprobs"]["tokens"]) == c["text"] for c in mine), mine
    assert events[-1]["usage"] == whole["usage"]


# ---- parameters amoe does not implement: refused by name, their no-op values accepted

UNSUPPORTED_CASES = [
    ("length_penalty", 2.0),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"),
    ("suffix", "tail"),
    ("use_beam_search", True),
    ("audio", {"voice": "alloy", "format": "wav"}),
]
CHAT_SERVES = (
    "tools",
    "tool_choice",
)  # completions refuse them; chat serves them (tests/test_tool_calls_api.py)
NOOPS = {
    "logprobs": None,
    "top_logprobs": 0,
    "echo": False,
    "best_of": 1,
    "n": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "tools": [],
    "tool_choice": "none",
    "suffix": None,
    "stop_token_ids": [3],  # supported, not a no-op
    "some_field_no_client_sends": 7,  # unknown fields may be ignored
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("param", "value"), UNSUPPORTED_CASES, ids=[f"{p}={v}" for p, v in UNSUPPORTED_CASES]
)
def test_unsupported_parameters_are_refused_by_name(param, value):
    routes = [("/v1/completions", completion()), ("/v1/chat/completions", chat_body())]
    if param in CHAT_SERVES:
        routes = routes[:1]

    async def scenario():
        async with make_client(ScriptedBackend()) as client:
            for path, body in routes:
                response = await client.post(path, json={**body, param: value})
                assert response.status_code == 400, (path, response.text)
                error = response.json()["error"]
                assert error["param"] == param and "not supported" in error["message"]

    run(scenario())


@pytest.mark.timeout(20)
def test_no_op_values_and_what_benchmark_clients_send_are_accepted():
    # What `vllm bench serve` sends for the openai-completions backend, and the openai SDK's explicit nulls.
    vllm_bench = {
        **completion(max_tokens=3),
        "repetition_penalty": 1.0,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }

    async def scenario():
        async with make_client(ScriptedBackend()) as client:
            assert (await client.post("/v1/completions", json={**completion(), **NOOPS})).status_code == 200
            # `tools: []` is a 400 in chat, as in vLLM and OpenAI (tests/test_tool_calls_api.py).
            noops = {k: v for k, v in NOOPS.items() if k != "tools"}
            chat = {**chat_body(), **noops, "logprobs": False, "parallel_tool_calls": True}
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
            streamed = await client.post("/v1/completions", json=vllm_bench)
            assert streamed.status_code == 200 and '"usage"' in streamed.text

    run(scenario())


def chat_body(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


# ---- a failure at any stage fails that request alone, logged with its id


class FlakyTokenizer(CharTokenizer):
    def encode(self, text, add_special_tokens=True):
        if "boom-tokenize" in text:
            raise RuntimeError("tokenizer bug")
        return super().encode(text, add_special_tokens)


class FlakyDetokenizer(CharDetokenizer):
    def add(self, token_id):
        if token_id == ord("c"):
            raise RuntimeError("detokenizer bug")
        return super().add(token_id)


class FlakyBackend(ScriptedBackend):
    async def generate(self, request_id, prompt_token_ids, sampling_params, rank=0):
        if prompt_token_ids[-1] == ord("R"):
            raise RuntimeError("backend bug")
        async for delta in super().generate(request_id, prompt_token_ids, sampling_params, rank):
            yield delta


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stage", ["tokenize", "admission", "runtime", "detokenize"])
def test_a_failure_at_any_stage_fails_that_request_alone(stage, caplog):
    backend = FlakyBackend(total_blocks=64, script="abcdefgh" if stage == "detokenize" else "abababab")

    def detokenizer(prompt_ids):  # fails on the doomed request's text ("hi") only
        return FlakyDetokenizer() if prompt_ids[-1] == ord("i") else CharDetokenizer()

    app = create_app(backend, FlakyTokenizer(), ModelInfo(MODEL, 64, 100_000), detokenizer)
    if stage == "admission":
        balancer = app.state.served.runner.balancer
        admit = balancer.admit

        async def flaky_admit(request_id, num_tokens):
            if num_tokens == 11:  # the doomed request's size
                raise RuntimeError("balancer bug")
            return await admit(request_id, num_tokens)

        balancer.admit = flaky_admit
    prompt = {"tokenize": "boom-tokenize", "admission": "xyzxyz", "runtime": "R", "detokenize": "hi"}[stage]

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
            doomed = client.post("/v1/completions", json=completion(prompt=prompt, max_tokens=4))
            fine = client.post("/v1/completions", json=completion(prompt="ok", max_tokens=4))
            doomed, fine = await asyncio.gather(doomed, fine)
            health = await client.get("/health")
            return doomed, fine, health

    doomed, fine, health = run(scenario())
    assert doomed.status_code == 500 and doomed.json()["error"]["type"] == "server_error", doomed.text
    assert fine.status_code == 200 and len(fine.json()["choices"][0]["text"]) == 4, fine.text
    assert health.status_code == 200 and health.json()["running"] == 0
    assert any(re.search(r"request \d+", r.getMessage()) and r.exc_info for r in caplog.records), caplog.text


@pytest.mark.timeout(20)
def test_a_request_past_its_deadline_ends_with_504():
    backend = ScriptedBackend(total_blocks=64)

    async def scenario():
        backend.gate = asyncio.Event()  # never set: no token ever comes
        async with make_client(backend, server=ServerSection(stall_timeout_s=0.3)) as client:
            stalled = await client.post("/v1/completions", json=completion())
        assert stalled.status_code == 504 and "no token" in stalled.json()["error"]["message"]
        backend.gate, backend.delay = None, 0.05
        async with make_client(backend, server=ServerSection(request_timeout_s=0.5)) as client:
            response = await client.post("/v1/completions", json=completion(max_tokens=50))  # 2.5 s of tokens
        assert response.status_code == 504 and "deadline" in response.json()["error"]["message"]

    run(scenario())
    assert not backend.active  # every stream was closed, so the backend aborted it

"""End to end: the coordinator API on the local backend with the tiny checkpoint, driven by the openai client."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from amoe.config import AmoeConfig
from amoe.llm import LLM
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.serve import AmoeServer
from amoe.tokenizer import Tokenizer

MODEL_NAME = "tiny-api"
MAX_MODEL_LEN = 2048  # the tiny preset's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("ckpt") / MODEL_NAME, seed=0)


@pytest.fixture(scope="module")
def server(model_dir):
    config = AmoeConfig().replace(model={"path": str(model_dir)}, server={"port": 0, "drain_timeout_s": 2.0})
    srv = AmoeServer(config)
    thread = threading.Thread(target=asyncio.run, args=(srv.run(),), name="test-api-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started.wait(0.1):
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
    yield srv
    srv.request_exit()
    thread.join(30)
    assert not thread.is_alive(), "the server thread did not stop"
    assert not [t for t in threading.enumerate() if t.name == "amoe-engine"], (
        "the engine thread was left behind"
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir)


def greedy(llm, prompt, max_tokens):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]


def wait_until_kv_free(server, timeout=15.0):  # an abort frees KV once its token is back at the head
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (kv,) = server.backend.kv_usage()
        if kv.free_blocks == kv.total_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"KV blocks still in use: {server.backend.kv_usage()}")


def num_requests(server, outcome: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "amoe_coordinator_requests"
        for s in family.samples
        if s.labels.get("outcome") == outcome
    )


def wait_until_aborted(server, count: float, timeout=15.0) -> None:
    deadline = time.monotonic() + timeout
    while num_requests(server, "aborted") < count:
        assert time.monotonic() < deadline, f"{count} aborted requests expected"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_greedy_completion_equals_the_local_engine(client, llm):
    expected = greedy(llm, "The quick brown fox", 12)
    got = client.completions.create(
        model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12, temperature=0
    )
    assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == MODEL_NAME
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.prompt_tokens == len(llm.tokenizer.encode("The quick brown fox"))


@pytest.mark.timeout(60)
def test_token_id_prompts_equal_the_local_engine(client, llm):
    prompt = [1, 17, 300, 42, 9]
    expected = greedy(llm, prompt, 10)
    for form in (prompt, [prompt]):
        got = client.completions.create(model=MODEL_NAME, prompt=form, max_tokens=10, temperature=0)
        assert got.choices[0].text == expected.text
        assert got.usage.prompt_tokens == len(prompt)


@pytest.mark.timeout(60)
def test_chat_uses_the_checkpoint_template_and_equals_the_local_engine(client, llm, model_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt_ids = tokenizer.encode_chat(messages)
    assert prompt_ids == tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert prompt_ids.count(tokenizer.bos_token_id) == 1  # the template writes <s>; no second one is added
    expected = greedy(llm, prompt_ids, 10)
    got = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


@pytest.mark.timeout(60)
def test_max_completion_tokens_limits_chat(client):
    got = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"


@pytest.mark.timeout(60)
def test_streaming_completion_with_usage(client):
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


@pytest.mark.timeout(60)
def test_streaming_chat_with_usage(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10)
    whole = client.chat.completions.create(**kwargs, temperature=0)
    stream = client.chat.completions.create(
        **kwargs, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.timeout(60)
def test_streaming_without_usage_ends_with_done(server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert "usage" not in json.loads(events[0][len("data: ") :])


@pytest.mark.timeout(60)
def test_stop_string_cuts_the_text_and_finishes_with_stop(client, llm):
    full = greedy(llm, "A stop test", 16).text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    expected = full[: full.find(stop)]
    kwargs = dict(model=MODEL_NAME, prompt="A stop test", max_tokens=16, temperature=0, stop=[stop])
    got = client.completions.create(**kwargs)
    assert got.choices[0].text == expected and got.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.timeout(60)
def test_32_concurrent_requests(server):
    async def one(aclient, i):
        kwargs = dict(model=MODEL_NAME, prompt=f"request number {i}", max_tokens=8, temperature=0)
        if i % 2 == 0:
            result = await aclient.completions.create(**kwargs)
            return result.choices[0].finish_reason, result.usage.completion_tokens
        stream = await aclient.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert len(results) == 32
    for finish_reason, num_tokens in results:
        assert finish_reason in ("stop", "length") and 1 <= num_tokens <= 8
    wait_until_kv_free(server)


@pytest.mark.timeout(60)
def test_info_endpoints(server, client):
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["kv"][0]["total_blocks"] > 0
    assert httpx.get(f"{server.url}/version").json()["version"]
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/v1/completions" in schema["paths"]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'amoe_coordinator_requests_total{endpoint="completions",outcome="success"}' in metrics
    assert "amoe_coordinator_generation_tokens_total" in metrics


LONG = {"model": MODEL_NAME, "prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.mark.timeout(60)
def test_client_disconnecting_mid_stream_frees_its_kv(server):
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=30
    ) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        (kv,) = server.backend.kv_usage()
        assert kv.free_blocks < kv.total_blocks  # the request holds blocks while it streams
    wait_until_kv_free(server)
    assert 'outcome="aborted"' in httpx.get(f"{server.url}/metrics").text


@pytest.mark.timeout(60)
def test_client_disconnecting_from_a_non_streaming_request_frees_its_kv(server):
    aborted = num_requests(server, "aborted")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    # Ended first: free KV alone could be a request that has not reached the engine yet.
    wait_until_aborted(server, aborted + 1)
    wait_until_kv_free(server)
    assert httpx.get(f"{server.url}/health").json()["running"] == 0


_TOO_LONG_PROMPT = [5] * MAX_MODEL_LEN

BAD_REQUESTS = [
    # (endpoint, raw body or JSON object, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", b'{"model": "tiny-api", "prompt": "\xff\xfe"}', 400, None),
    ("completions", {"prompt": "hi"}, 400, "model"),
    ("completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("completions", {"model": MODEL_NAME, "prompt": 5}, 400, None),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("completions", {"model": MODEL_NAME, "prompt": _TOO_LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("completions", {"model": MODEL_NAME, "prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"model": MODEL_NAME, "prompt": []}, 400, "prompt"),
    ("completions", {"model": MODEL_NAME, "prompt": ["a", [1, 2]]}, 400, "prompt"),  # text and ids mixed
    ("completions", {"model": MODEL_NAME, "prompt": "\ud800"}, 400, "prompt"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "n": 129}, 400, "n"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "n": 1, "best_of": 2, "stream": True},
        400,
        "best_of",
    ),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "allowed_token_ids": [5, 4096]},
        400,
        "allowed_token_ids",
    ),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "guided_regex": "a(b"}, 400, "guided_regex"),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "guided_json": {"type": "bogus"}},
        400,
        "guided_json",
    ),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "guided_json": {}, "guided_regex": "a"},
        400,
        "guided_regex",
    ),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "guided_grammar": "root ::= ("},
        400,
        "guided_grammar",
    ),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "structured_outputs": {}},
        400,
        "structured_outputs",
    ),
    (
        "completions",
        {"model": MODEL_NAME, "prompt": "hi", "structured_outputs": {"jsonx": {}}},
        400,
        "structured_outputs",
    ),
    (
        "completions",
        {
            "model": MODEL_NAME,
            "prompt": "hi",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        400,
        "response_format",
    ),
    (
        "chat/completions",
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "x"}],
            "guided_choice": ["a"],
            "response_format": {"type": "json_object"},
        },
        400,
        "guided_choice",
    ),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": -1}, 400, None),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "top_p": 0}, 400, None),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("chat/completions", {"model": MODEL_NAME, "messages": "hello"}, 400, "messages"),
    ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    (
        "chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
]


@pytest.mark.timeout(60)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    for endpoint, body, status, param in BAD_REQUESTS:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(
            f"{server.url}/v1/{endpoint}",
            content=content,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        case = f"{endpoint} {body!r}"
        assert response.status_code == status, f"{case}: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, case
        assert error["message"] and error["type"] == "invalid_request_error", case
        if param is not None:
            assert error["param"] == param, f"{case}: {error}"
        if status == 404:
            assert error["code"] == "model_not_found"
    got = client.completions.create(model=MODEL_NAME, prompt="still alive?", max_tokens=3)
    assert got.usage.completion_tokens >= 1
    wait_until_kv_free(server)

"""Tool calling through the API, as the OpenAI SDK uses it: `tools` → `tool_calls` → a `tool` message → the answer.

On a random-weight checkpoint served by `amoe serve`, a named function and `required` are forced by the grammar:
whatever the model, the calls name the tools and their arguments validate against the tools' schemas, streamed
(assembled by the SDK's own stream helper) and not. `auto` is read by the server's parser; a scripted backend
writes the families' own call formats so that the served parser has calls to read.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from factories import CharDetokenizer, CharTokenizer, server_in_thread
from openai.lib.streaming.chat import ChatCompletionStreamState

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from coordinator.api.app import create_app
from coordinator.api.tools import ToolServing
from coordinator.api.validation import ModelInfo
from coordinator.requests.backend import Backend, RankKV, TokenDelta

MODEL = "tiny-tools"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}, "format": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls) -> None:
    """Each call names a tool and its arguments are JSON its schema accepts; its id is the server's parser's
    (mistral: nine letters and digits, which Mistral's templates check when the call comes back)."""
    assert calls
    for call in calls:
        assert call.type == "function" and len(call.id) == 9 and call.id.isalnum()
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, **body):
    """The completion the SDK's stream helper assembles from the server's chunks."""
    with client.chat.completions.stream(model=MODEL, **body) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The SDK against `amoe serve` on a random-weight tiny checkpoint (amoe's template renders tools), with
    `--tool-call-parser mistral --enable-auto-tool-choice` (the format amoe's template writes calls in)."""
    model_dir = make_model("tiny", tmp_path_factory.mktemp("tools") / "tiny", seed=0)
    config = AmoeConfig().replace(
        model={"path": str(model_dir)},
        parallel={"mode": "local"},
        server={"port": 0, "drain_timeout_s": 2.0, "served_model_name": MODEL, "tool_call_parser": "mistral",
                "enable_auto_tool_choice": True},
    )  # fmt: skip
    with server_in_thread(config) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.timeout(300)
def test_the_sdks_function_calling_flow_with_a_named_function(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": named, "max_tokens": 60, "temperature": 0}
    reply = client.chat.completions.create(model=MODEL, **body)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    again = streamed(client, **body)
    assert again.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in again.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    # The call and its result go back in the history; the model answers (under `auto`, the server's parser).
    call = choice.message.tool_calls[0]
    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "high_c": 24}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length") and isinstance(
        answer.choices[0].message.content, str
    )
    rendered = httpx.post(
        f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
        json={"model": MODEL, "messages": history, "tools": TOOLS},
        timeout=30,
    ).json()
    assert rendered["count"] == answer.usage.prompt_tokens > reply.usage.prompt_tokens


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_name_the_tools_with_arguments_their_schemas_accept(client, parallel):
    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 1.0,
            "n": 3, "seed": 0, "parallel_tool_calls": parallel}  # fmt: skip
    reply = client.chat.completions.create(model=MODEL, **body)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1 or parallel
    assert parallel is False or any(len(c.message.tool_calls) > 1 for c in reply.choices)  # calls in parallel
    again = streamed(client, **body)
    assert [
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls] for c in again.choices
    ] == [[(t.function.name, t.function.arguments) for t in c.message.tool_calls] for c in reply.choices]


@pytest.mark.timeout(300)
def test_required_calls_keep_references_into_a_tools_defs(client):
    """vLLM's schema gathers every tool's $defs at the top of the array's schema, where their $refs point."""
    place = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
             "additionalProperties": False}  # fmt: skip
    route = {"type": "object", "$defs": {"place": place}, "additionalProperties": False,
             "properties": {"start": {"$ref": "#/$defs/place"}, "end": {"$ref": "#/$defs/place"}},
             "required": ["start", "end"]}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "plan_route", "parameters": route}}]
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=tools, tool_choice="required", max_tokens=200, temperature=1.0, n=3,
        seed=3,
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert call.function.name == "plan_route"
            jsonschema.validate(json.loads(call.function.arguments), route)


@pytest.mark.timeout(300)
def test_forced_arguments_stream_in_pieces_after_a_first_delta_with_the_id_and_name(client):
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "stream": True}  # fmt: skip
    url = f"{client.base_url}chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    first = calls[0][0]
    assert first["index"] == 0 and first["type"] == "function" and len(first["id"]) == 9
    assert first["function"]["name"] == "get_time" and isinstance(first["function"]["arguments"], str)
    assert len(calls) > 3 and all(set(c[0]) == {"index", "function"} for c in calls[1:])
    assert all(set(c[0]["function"]) == {"arguments"} for c in calls[1:])
    arguments = "".join(c[0]["function"]["arguments"] for c in calls)
    jsonschema.validate(json.loads(arguments), TIME)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    state = ChatCompletionStreamState()  # the SDK assembles the same call from these chunks
    for chunk in chunks:
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(chunk))
    (call,) = state.get_final_completion().choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == (first["id"], "get_time", arguments)


@pytest.mark.timeout(300)
def test_the_eos_that_ends_an_answer_is_not_its_text(client):
    """The mistral parser needs special tokens in the text (its marker is one), so an answer under `auto` keeps
    them; the eos that ends it is no text, as in vLLM, unless include_stop_str_in_output asks for it."""
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "logit_bias": {"2": 100}}  # </s> at once
    for extra in ({"tools": TOOLS}, {"extra_body": {"skip_special_tokens": False}}, {}):
        reply = client.chat.completions.create(model=MODEL, **body, **extra)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("", "stop"), extra
        assert reply.usage.completion_tokens == 1
    kept = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    reply = client.chat.completions.create(model=MODEL, **body, extra_body=kept)
    assert reply.choices[0].message.content == "</s>"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tools": []}, "tools", "`tools` must not be an empty array"),
        ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_mood"}}}, "tool_choice",
         "does not match any of the specified `tools`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "Invalid value for `function`"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "non-empty string"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "must be"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "defined twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
         "JSON schema of an object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"x": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools", "invalid"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}],
          "tool_choice": "required"}, "tools", "$defs"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "either use constraints for structured outputs or tools"),
        ({"tools": TOOLS, "messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
          "function": {"name": "get_time", "arguments": "{not json"}}]}]}, "messages", "not valid JSON"),
        ({"tools": TOOLS, "messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
          "function": {"name": "get_time", "arguments": "[1]"}}]}]}, "messages", "must be a JSON object"),
        ({"tools": TOOLS, "messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}, "messages",
         "chat template rejected"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_a_400_naming_the_parameter(client, extra, param, message):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **extra}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**body, stream=stream)
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
        assert message in err.value.body["message"], err.value.body


# ---- `auto`, read by the server's parser from a scripted backend's output


class CallScriptBackend(Backend):
    """Writes `script` (one character a token; sequence i of a request writes scripts[i % len]), then stops."""

    def __init__(self, *scripts: str) -> None:
        self.scripts = scripts

    @property
    def block_size(self):
        return 16

    async def start(self):
        pass

    async def shutdown(self):
        pass

    async def generate(self, request_id, prompt_token_ids, sampling_params, rank=0):
        texts = [self.scripts[i % len(self.scripts)] for i in range(sampling_params.n)]
        for at in range(max(map(len, texts))):
            for index, text in enumerate(texts):
                if at < len(text):
                    yield TokenDelta([ord(text[at])], "stop" if at + 1 == len(text) else None, index=index)
                    await asyncio.sleep(0)

    def abort(self, request_id):
        pass

    def health(self):
        return {"status": "ok"}

    def kv_usage(self):
        return [RankKV(free_blocks=512, total_blocks=512)]


def scripted(*scripts: str, parser: str | None = "hermes", auto: bool = True) -> openai.AsyncOpenAI:
    app = create_app(
        CallScriptBackend(*scripts), CharTokenizer(), ModelInfo(MODEL, 4096, 100_000, tools=ToolServing(parser, auto)),
        lambda ids, **_: CharDetokenizer(),
    )  # fmt: skip
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1", timeout=10)
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


QWEN_CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
AUTO = [
    ("hermes", QWEN_CALLS, "Let me check.\n"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
     '```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}}]', None),
]  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("parser", "script", "content"), AUTO, ids=[a[0] for a in AUTO])
def test_auto_reads_the_models_calls_with_the_servers_parser(parser, script, content):
    async def scenario():
        client = scripted(script, parser=parser)
        body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 500}
        reply = await client.chat.completions.create(**body)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"}),
        ]  # fmt: skip
        assert len({c.id for c in choice.message.tool_calls}) == 2
        async with client.chat.completions.stream(**body) as stream:
            async for _ in stream:
                pass
            again = await stream.get_final_completion()
        # The stream opens with content "" beside the role, as vLLM's does: the SDK keeps it.
        assert (
            again.choices[0].finish_reason == "tool_calls"
            and (again.choices[0].message.content or None) == content
        )
        assert [(c.function.name, c.function.arguments) for c in again.choices[0].message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]

    run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "script",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}\n</tool_call>',
        '<tool_call>\n{"name": "get_horoscope", "arguments": {}}\n</tool_call>',
        "<tool_call>\nnot even json",
    ],
)
def test_a_malformed_call_under_auto_comes_back_as_content(script):
    async def scenario():
        client = scripted(script)
        body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 500}
        reply = await client.chat.completions.create(**body)
        assert reply.choices[0].message.content == script and not reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "stop"
        async with client.chat.completions.stream(**body) as stream:
            async for _ in stream:
                pass
            again = await stream.get_final_completion()
        assert again.choices[0].message.content == script and not again.choices[0].message.tool_calls

    run(scenario())


@pytest.mark.timeout(60)
def test_each_streamed_choice_assembles_its_own_calls():
    async def scenario():
        client = scripted(QWEN_CALLS, "No tool needed.")
        body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 500, "n": 3}
        async with client.chat.completions.stream(**body) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
        got = [(c.finish_reason, c.message.content, len(c.message.tool_calls or [])) for c in final.choices]
        assert got == [("tool_calls", "Let me check.\n", 2), ("stop", "No tool needed.", 0),
                       ("tool_calls", "Let me check.\n", 2)]  # fmt: skip

    run(scenario())


@pytest.mark.timeout(60)
def test_tool_choice_none_and_a_server_without_auto_read_no_calls():
    async def scenario():
        body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 500}
        reply = await scripted(QWEN_CALLS).chat.completions.create(**body, tool_choice="none")
        assert reply.choices[0].message.content == QWEN_CALLS and reply.choices[0].finish_reason == "stop"
        for parser, auto in (("hermes", False), (None, False)):
            with pytest.raises(openai.BadRequestError) as err:  # vLLM's answer, word for word
                await scripted(QWEN_CALLS, parser=parser, auto=auto).chat.completions.create(**body)
            assert err.value.body["message"] == (
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        plain = await scripted("hello", parser=None, auto=False).chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=9
        )
        assert plain.choices[0].message.content == "hello"  # without tools, nothing changes

    run(scenario())

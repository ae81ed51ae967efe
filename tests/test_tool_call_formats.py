"""The tool-call wire formats read on the formats' own examples, whole and piece by piece.

The examples are the families' own: Qwen's function-calling guide (QwenLM/Qwen3, docs/source/framework/
function_call.md, "The output texts should be like"), vLLM's parser tests (tests/tool_parsers/
test_hermes_tool_parser.py, test_deepseekv3_tool_parser.py, test_mistral_tool_parser.py) and the DeepSeek-V3 parser's
docstring (vllm/entrypoints/openai/tool_parsers/deepseekv3_tool_parser.py). The chat templates' own renderings of
calls (tests/test_tool_chat_templates.py) are read back too. Whatever the pieces, the stream assembles to the whole
reading; a malformed call is content, never an error.
"""

from __future__ import annotations

import json
import random

import pytest

from amoe.tool_calls.json_scan import JsonScanner
from amoe.tool_calls.output import ToolCallOutput, ToolCallPlan

WEATHER = frozenset({"get_current_temperature", "get_temperature_date", "get_weather", "search_hotels",
                     "get_current_time", "test_function", "send_message", "final_answer", "get_db_config",
                     "search", "add", "get_current_weather", "get_age", "multiply", "add_this_and_that"})  # fmt: skip

QWEN_GUIDE = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01"}}\n</tool_call>'
)
DEEPSEEK_DOCSTRING = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n"
    '{"location": "Beijing"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n'
    '```json\n{"location": "Beijing"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_PARALLEL = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Tokyo", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
    'search_hotels\n```json\n{"location": "Tokyo", "check_in": "2025-01-15"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_TYPES = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>test_function\n```json\n"
    '{"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": true, "null_field": null, '
    '"array_field": ["a", "b", "c"], "object_field": {"nested": "value"}, "empty_array": [], "empty_object": {}}\n'
    "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)

# (parser, model output, expected content, expected calls as (name, arguments parsed))
EXAMPLES = [
    ("hermes", QWEN_GUIDE, "", [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
    ]),
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>', "",
     [("final_answer", {"trigger": True})]),
    # vLLM reads a call to the output's end when its end tag never comes.
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}', "",
     [("final_answer", {"trigger": True})]),
    ("hermes", 'Sure, let me check the weather.<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}'
     "</tool_call>", "Sure, let me check the weather.", [("get_weather", {"city": "NYC"})]),
    ("hermes", '<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call><tool_call>{"name": "search", '
     '"arguments": {"q": "dogs"}}</tool_call>', "", [("search", {"q": "cats"}), ("search", {"q": "dogs"})]),
    # Granite 4's arguments, a string holding the object: decoded once.
    ("hermes", '<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n'
     "</tool_call>", "", [("get_db_config", {"param": "max_connections"})]),
    ("hermes", "This is some prior text that has nothing to do with tool calling.",
     "This is some prior text that has nothing to do with tool calling.", []),
    ("deepseek_v3", DEEPSEEK_DOCSTRING, "", [("get_current_weather", {"location": "Beijing"})] * 2),
    ("deepseek_v3", DEEPSEEK_PARALLEL, "", [
        ("get_weather", {"city": "Tokyo", "unit": "celsius"}),
        ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"}),
    ]),
    ("deepseek_v3", DEEPSEEK_TYPES, "", [("test_function", json.loads(DEEPSEEK_TYPES.split("\n")[2]))]),
    ("deepseek_v3", "Let me check the weather for you.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Let me check the weather for you.", [("get_weather", {"city": "Paris"})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>send_message\n```json\n"
     '{"text": "He said \\"hello\\"", "path": "C:\\\\Users\\\\file", "newline": "line1\\nline2"}\n'
     "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "",
     [("send_message", {"text": 'He said "hello"', "path": "C:\\Users\\file", "newline": "line1\nline2"})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', "", [("add", {"a": 3.5, "b": 4})]),
    ("mistral", '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, '
     '"name": "get_current_weather"}]', "",
     [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]),
    ("mistral", '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', "",
     [("get_age", {"name": "John Doe"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
     '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]', "", [
        ("add", {"a": 3.5, "b": 4}),
        ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"}),
    ]),
    ("mistral", 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello",
     [("add", {"a": 1, "b": 2})]),
    # Tokenizer v11 on: NAME{arguments} after each marker.
    ("mistral", '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "", [("add_this_and_that", {"a": 3.5, "b": 4})]),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', "",
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ("mistral", "This is a test", "This is a test", []),
]  # fmt: skip

# Malformed calls (vLLM's own malformed examples among them): the whole output is content.
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}'),
    ("hermes", 'Let me see <tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": "hello"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "final_answer"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": tru}}\n</tool_call>'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Tokyo"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek_v3", '<｜tool▁calls▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Tokyo"}\n'
     "```<｜tool▁calls▁end｜>"),
    ("mistral", "[TOOL_CALLS] not json at all"),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": [1, 2]}]'),
]  # fmt: skip


def read(parser: str, text: str, pieces: list[str] | None = None, **plan) -> tuple[ToolCallOutput, list]:
    """The whole reading, and the deltas of reading it in `pieces` (default: one piece)."""
    output = ToolCallOutput(ToolCallPlan(plan.pop("mode", "auto"), WEATHER, parser=parser, **plan))
    deltas = [output.feed(piece) for piece in (pieces or [text])] + [output.finish()]
    return output, [d for d in deltas if d]


def assembled(deltas: list) -> tuple[str, list[tuple[str, str, str]]]:
    """What a client makes of the deltas: the content, and per call index its id, name and arguments."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.content
        for c in delta.calls:
            if c.id is not None:
                assert c.index not in calls and c.index == len(calls), "a call starts once, in order"
                calls[c.index] = [c.id, c.name, ""]
            calls[c.index][2] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


def splits(text: str, seed: int) -> list[list[str]]:
    """The text in one piece, a character at a time, and in random pieces (token-sized to line-sized)."""
    rng = random.Random(seed)
    cuts, at = [], 0
    while at < len(text):
        cuts.append(text[at : at + rng.randint(1, 12)])
        at += len(cuts[-1])
    return [[text], list(text), cuts]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), EXAMPLES)
def test_the_formats_own_examples_read_as_their_calls_whole_and_streamed(parser, text, content, calls):
    whole, _ = read(parser, text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert all(c.arguments == c.arguments.strip() for c in whole.calls)  # the JSON the model wrote, no more
    for pieces in splits(text, seed=len(text)):
        output, deltas = read(parser, text, pieces)
        assert assembled(deltas) == (output.content, [(c.id, c.name, c.arguments) for c in output.calls])
        assert (output.content, [(c.name, c.arguments) for c in output.calls]) == (
            whole.content, [(c.name, c.arguments) for c in whole.calls],
        )  # fmt: skip


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_a_malformed_call_is_content_whole_and_streamed(parser, text):
    for pieces in splits(text, seed=7):
        output, deltas = read(parser, text, pieces)
        assert (output.content, output.calls) == (text, [])
        assert assembled(deltas) == (text, [])


def test_a_call_the_model_chose_is_sent_only_once_it_is_complete():
    """Under `auto` a call may still turn out to be content, so nothing of it goes out before its end: its name
    and its whole arguments come in one delta."""
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _, deltas = read("hermes", text, list(text))
    with_calls = [d for d in deltas if d.calls]
    assert len(with_calls) == 1 and with_calls[0].calls[0].arguments == '{"city": "Paris"}'
    assert "".join(d.content for d in deltas[: deltas.index(with_calls[0])]) == "Checking."


def test_content_waits_only_while_it_may_begin_a_marker():
    output = ToolCallOutput(ToolCallPlan("auto", WEATHER, parser="hermes"))
    assert output.feed("a < b and <tool").content == "a < b and "
    assert output.feed("box>").content == "<toolbox>"
    assert output.finish().content == ""


def test_what_follows_the_calls_is_content_not_lost():
    text = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]\nextra trailing data'
    output, _ = read("mistral", text)
    assert [c.name for c in output.calls] == ["add"] and output.content == "extra trailing data"


def test_parallel_tool_calls_false_keeps_the_first_call_and_the_rest_as_content():
    output, _ = read("hermes", QWEN_GUIDE, parallel=False)
    assert [c.name for c in output.calls] == ["get_current_temperature"]
    assert output.content.startswith("<tool_call>\n") and "get_temperature_date" in output.content


def test_forced_calls_stream_their_arguments_as_written():
    """`named` and `required` outputs follow a grammar: the arguments go out piece by piece, the first delta
    carrying the id and name."""
    args = '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'
    output, deltas = read(None, args, list(args), mode="named", function="get_temperature_date")
    assert [c.name for c in output.calls] == ["get_temperature_date"] and output.calls[0].arguments == args
    assert deltas[0].calls[0].name == "get_temperature_date" and deltas[0].calls[0].arguments == "{"
    assert len(deltas) == len(args) and assembled(deltas)[1][0][2] == args
    calls = '[{"name": "add", "parameters": {"a": 1}}, {"name": "search", "parameters": {"q": "x"}}]'
    output, deltas = read(None, calls, list(calls), mode="required")
    assert [(c.name, c.arguments) for c in output.calls] == [("add", '{"a": 1}'), ("search", '{"q": "x"}')]
    assert assembled(deltas)[1] == [(c.id, c.name, c.arguments) for c in output.calls]


def test_a_forced_call_cut_short_keeps_what_was_sent():
    output, _ = read(None, '{"location": "San Fr', mode="named", function="get_temperature_date")
    assert [(c.name, c.arguments) for c in output.calls] == [("get_temperature_date", '{"location": "San Fr')]
    assert output.content == ""


def test_ids_are_vllms_or_mistrals_nine_characters():
    output, _ = read("hermes", QWEN_GUIDE)
    assert all(c.id.startswith("chatcmpl-tool-") for c in output.calls)
    assert len({c.id for c in output.calls}) == 2
    output, _ = read("mistral", EXAMPLES[-4][1], id_style="mistral")
    assert len(output.calls[0].id) == 9 and output.calls[0].id.isalnum()


# ---- the JSON scanner against json.loads


def _json_samples(rng: random.Random, n: int) -> list[str]:
    """Valid JSON texts of every kind, and each cut and corrupted at a random place."""
    atoms = [
        '"a\\u00e9\\n\\"b"',
        "-0.5e+3",
        "0",
        "12",
        "true",
        "false",
        "null",
        '""',
        "[]",
        "{}",
        "1E9",
        '"\\/"',
    ]
    out = []
    for _ in range(n):
        value = rng.choice(atoms)
        for _ in range(rng.randint(0, 4)):
            if rng.random() < 0.5:
                value = "[" + ", ".join([value] * rng.randint(1, 3)) + "]"
            else:
                value = "{" + ",".join(f' "k{i}" : {value}' for i in range(rng.randint(1, 3))) + " }"
        out.append(value)
        cut = rng.randint(0, len(value))
        out.append(
            value[:cut] + rng.choice(["", "}", "]", ",", ":", "x", '"', "01", "-", "\\q", "\x01", " "])
        )
    return out + ["01", "1.", "-", "1e", "[1,]", '{"a" 1}', '{"a":1,}', "[1 2]", "tru", '"\\u12g4"', "{,}"]


def test_the_scanner_accepts_exactly_what_json_loads_accepts():
    rng = random.Random(5)
    for text in _json_samples(rng, 400):
        for step in (1, 3, len(text) or 1):
            scanner, pos = JsonScanner(), 0
            while pos < len(text) and not (scanner.done or scanner.failed):
                pos = scanner.scan(text[: min(len(text), pos + step)], pos)
            scanner.end_of_input()
            try:
                json.loads(text)
                valid = True
            except json.JSONDecodeError:
                valid = False
            complete = scanner.done and not scanner.failed and text[pos:].strip() == ""
            assert complete == valid, (text, step, scanner.done, scanner.failed, pos)


def test_the_scanner_finds_each_top_level_members_key_and_value():
    text = '{"name": "add", "arguments": {"a": [1, {"b": 2}], "c": "}"}, "n": -1.5} tail'
    scanner = JsonScanner()
    end = scanner.scan(text, 0)
    assert scanner.done and text[end:] == " tail"
    spans = {m.key: text[m.start : m.end] for m in scanner.members}
    assert spans == {"name": '"add"', "arguments": '{"a": [1, {"b": 2}], "c": "}"}', "n": "-1.5"}


@pytest.mark.parametrize(
    ("parser", "good", "bad"),
    [
        ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
         '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>'),
        ("mistral", '[TOOL_CALLS]add{"a": 1}', "[TOOL_CALLS]no_such_tool{}"),
    ],
)  # fmt: skip
def test_a_malformed_call_after_a_good_one_is_content_from_its_own_marker_on(parser, good, bad):
    for pieces in splits(good + bad, seed=3):
        output, deltas = read(parser, good + bad, pieces)
        assert ([c.name for c in output.calls], output.content) == (["add"], bad)

"""Tool calling in a chat request, as vLLM serves it: `tools`, `tool_choice` and `parallel_tool_calls` checked with
vLLM's messages, the conversation (calls and their results included) as chat templates take it, and how the output
becomes calls: forced by a grammar (`required`, a named function: vLLM's JSON schemas) or read by the server's
parser (`auto`, which needs --enable-auto-tool-choice and --tool-call-parser)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from amoe.tool_calls.formats import PARSERS
from amoe.tool_calls.output import ToolCallPlan
from coordinator.api.openai_errors import bad_request
from coordinator.api.protocol import ChatCompletionRequest, ChatMessage

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_NO_PARAMETERS = {"type": "object", "properties": {}}  # what a function without `parameters` takes (vLLM's)


@dataclass(frozen=True)
class ToolServing:
    """The server's tool-calling flags (vLLM's --tool-call-parser and --enable-auto-tool-choice)."""

    parser: str | None = None
    auto: bool = False


@dataclass(frozen=True)
class ChatTools:
    """What a chat request's tools ask of the server."""

    template_tools: list[dict] | None = None  # for the chat template, as sent
    plan: ToolCallPlan | None = None  # how the output becomes calls (None: it is content)
    schema: dict | None = None  # the JSON the output must be (a forced choice), for the grammar
    keep_special_tokens: bool = False  # the parser's markers are special tokens


def chat_tools(req: ChatCompletionRequest, serving: ToolServing) -> ChatTools:
    """The request's tool settings checked (a 400 naming the parameter at fault) and turned into a plan."""
    tools = _checked_tools(req.tools)
    choice = _checked_choice(req.tool_choice, tools)
    if choice == "none":
        return ChatTools(template_tools=req.tools)
    parallel = req.parallel_tool_calls is not False
    names = frozenset(tools)
    id_style = PARSERS[serving.parser].ID_STYLE if serving.parser else "random"
    if choice == "auto":
        if not (serving.auto and serving.parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        plan = ToolCallPlan("auto", names, parser=serving.parser, parallel=parallel, id_style=id_style)
        keep = PARSERS[serving.parser].NEEDS_SPECIAL_TOKENS
        return ChatTools(req.tools, plan, keep_special_tokens=keep)
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        plan = ToolCallPlan("named", names, function=name, id_style=id_style)
        return ChatTools(req.tools, plan, schema=_object_schema(tools[name]))
    plan = ToolCallPlan("required", names, parallel=parallel, id_style=id_style)
    return ChatTools(req.tools, plan, schema=_calls_schema(tools, parallel))


def check_tools(tools: list[dict]) -> list[dict]:
    """`tools` as sent, once checked (a 400 naming it if one is malformed)."""
    _checked_tools(tools)
    return tools


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the chat template: text content ("" when none), an assistant's tool
    calls with their arguments parsed into objects (templates iterate them), a tool result's call id."""
    out = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.role == "assistant" and message.tool_calls:
            entry["tool_calls"] = [_history_call(call, f"messages[{i}].tool_calls[{j}]")
                                   for j, call in enumerate(message.tool_calls)]  # fmt: skip
        if message.role == "tool" and message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out


def _checked_tools(tools: list[dict] | None) -> dict[str, dict]:
    """Function name → its parameters schema (or None), in order."""
    if tools is None:
        return {}
    if not tools:
        raise bad_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{where}.function.name' must be a non-empty string", "tools")
        if name in out:
            raise bad_request(f"'{where}.function.name': the function {name!r} is defined twice", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not (
            isinstance(parameters, dict) and parameters.get("type", "object") == "object"
        ):
            raise bad_request(f"'{where}.function.parameters' must be a JSON schema of an object", "tools")
        if not isinstance(function.get("description", ""), str):
            raise bad_request(f"'{where}.function.description' must be a string", "tools")
        out[name] = parameters
    return out


def _checked_choice(choice: str | dict | None, tools: dict[str, dict]) -> str | dict:
    """none, auto, required or a named function, with vLLM's defaults (auto with tools, none without)."""
    if choice is None:
        return "auto" if tools else "none"
    if choice == "none":
        return choice
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice in ("auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise bad_request(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are '
            "supported.",
            "tool_choice",
        )
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}", "tool_choice"
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}", "tool_choice"
        )
    if name not in tools:
        raise bad_request(
            "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"
        )
    return choice


def _object_schema(parameters: dict | None) -> dict:
    """A named function's arguments: its parameters schema (vLLM's), an object in any case."""
    schema = copy.deepcopy(parameters) if parameters else dict(_NO_PARAMETERS)
    schema.setdefault("type", "object")
    return schema


def _calls_schema(tools: dict[str, dict], parallel: bool) -> dict:
    """`required`: a JSON array of one or more {"name", "parameters"} objects, each naming one of the tools with
    arguments its schema accepts (vLLM's schema, the tools' $defs gathered at the top where their $refs point;
    and no other members, which vLLM's allows and nothing reads), at most one with parallel_tool_calls false."""
    items, defs = [], {}
    for name, parameters in tools.items():
        schema = _object_schema(parameters)
        own = schema.pop("$defs", {})
        if not isinstance(own, dict):
            raise bad_request(f"the parameters of {name!r} have a $defs that is not an object", "tools")
        for key, value in own.items():
            if key in defs and defs[key] != value:
                raise bad_request(
                    f"Tool definition '{key}' has multiple schemas, which is not supported.", "tools"
                )
            defs[key] = value
        items.append({
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,  # a call is its name and parameters: nothing else to write
        })  # fmt: skip
    out: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        out["maxItems"] = 1
    if defs:
        out["$defs"] = defs
    return out


def _history_call(call: dict, where: str) -> dict:
    """An assistant's earlier call as templates take it: as sent, its arguments parsed into an object (vLLM's
    chat_utils does the same; "" or none is {})."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise bad_request(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', "messages")
    if not isinstance(function.get("name"), str):
        raise bad_request(f"'{where}.function.name' must be a string", "messages")
    if "id" in call and not isinstance(call["id"], str):
        raise bad_request(f"'{where}.id' must be a string", "messages")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise bad_request(f"'{where}.function.arguments' is not valid JSON ({exc})", "messages") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"'{where}.function.arguments' must be a JSON object", "messages")
    return {**call, "function": {**function, "arguments": arguments}}

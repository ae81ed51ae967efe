"""One sequence's output as an assistant message with tool calls: what each piece of text adds (a stream's delta)
and, at its end, the whole message. The same reading gives both, so a stream assembles to the response.

How sure a call must be before it is sent depends on who wrote it. A call the model chose (`auto`) goes out only
once it is complete and well formed: until then it may still turn out to be content, and a stream cannot take back
what it sent. A call the grammar forced (`named`, `required`) is well formed by construction, so its arguments go
out as they are written.
"""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Literal

from amoe.tool_calls.formats import PARSERS, NamedReader, RequiredReader
from amoe.tool_calls.reader import Broken, CallArguments, CallEnd, CallStart, Event, FormatReader, Text

_MISTRAL_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCallPlan:
    """How a chat request's output becomes tool calls: read in the model's own format (`auto`, with `parser`),
    or read as the JSON a grammar forced (`named`: `function`'s arguments; `required`: a list of calls)."""

    mode: Literal["auto", "named", "required"]
    tool_names: frozenset[str]
    parser: str | None = None  # auto: a name of PARSERS
    function: str | None = None  # named
    parallel: bool = True  # parallel_tool_calls: false allows one call
    id_style: str = "random"  # FormatReader.ID_STYLE of the server's parser

    def reader(self) -> FormatReader:
        if self.mode == "named":
            return NamedReader(self.tool_names, self.function or "")
        max_calls = None if self.parallel else 1
        if self.mode == "required":
            return RequiredReader(self.tool_names, max_calls)
        return PARSERS[self.parser or ""](self.tool_names, max_calls)


def tool_call_id(style: str) -> str:
    """A new call's id: vLLM's `chatcmpl-tool-<hex>`, or nine letters and digits for Mistral's templates."""
    if style == "mistral":
        return "".join(secrets.choice(_MISTRAL_ID_CHARS) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class CallDelta:
    """What one delta adds to call `index`: its id and name the first time, then more of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class OutputDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class ToolCallOutput:
    """Reads one sequence's text, fed piece by piece, under a ToolCallPlan."""

    def __init__(self, plan: ToolCallPlan) -> None:
        self._reader = plan.reader()
        self._sure_only = plan.mode == "auto"  # send a call only once it is complete (see the module's doc)
        self._id_style = plan.id_style
        self.content = ""
        self.calls: list[ToolCall] = []  # sent, or being sent
        self._open: ToolCall | None = None  # being read
        self._open_sent = False

    def feed(self, text: str) -> OutputDelta:
        return self._apply(self._reader.feed(text))

    def finish(self) -> OutputDelta:
        """At the output's end: what is still to send (a call cut short stays as far as it was sent, if it was)."""
        return self._apply(self._reader.finish())

    def _apply(self, events: list[Event]) -> OutputDelta:
        delta = OutputDelta()
        for event in events:
            if isinstance(event, Text):
                self._add_content(delta, event.text)
            elif isinstance(event, CallStart):
                self._open = ToolCall(tool_call_id(self._id_style), event.name, "")
                self._open_sent = not self._sure_only
                if self._open_sent:
                    self._send(delta, self._open, "")
            elif isinstance(event, CallArguments) and self._open is not None:
                self._open.arguments += event.text
                if self._open_sent:
                    self._send(delta, self._open, event.text)
            elif isinstance(event, CallEnd) and self._open is not None:
                if not self._open_sent:
                    self._send(delta, self._open, self._open.arguments)
                self._open, self._open_sent = None, False
            elif isinstance(event, Broken):
                if not self._open_sent:
                    self._add_content(delta, event.text)
                self._open, self._open_sent = None, False
        return delta

    def _add_content(self, delta: OutputDelta, text: str) -> None:
        self.content += text
        delta.content += text

    def _send(self, delta: OutputDelta, call: ToolCall, arguments: str) -> None:
        if not self.calls or self.calls[-1] is not call:
            self.calls.append(call)
            delta.calls.append(CallDelta(len(self.calls) - 1, arguments, call.id, call.name))
        elif delta.calls and delta.calls[-1].index == len(self.calls) - 1:
            delta.calls[-1].arguments += arguments
        else:
            delta.calls.append(CallDelta(len(self.calls) - 1, arguments))

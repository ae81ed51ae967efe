"""A chat choice's output as OpenAI's assistant message: its text, or, when the request may call tools, its content
and tool calls (amoe.tool_calls), whole or as a stream's deltas, which the OpenAI SDK assembles into the same
message."""

from __future__ import annotations

from amoe.logprobs import Logprobs, concat
from amoe.tool_calls.output import OutputDelta, ToolCallOutput, ToolCallPlan
from coordinator.api.protocol import (
    AssistantMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    MessageToolCall,
)


def whole_message(
    plan: ToolCallPlan, text: str, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """A finished choice's message and finish reason ("tool_calls" once it called one and stopped on its own)."""
    output = ToolCallOutput(plan)
    output.feed(text)
    output.finish()
    calls = [
        MessageToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in output.calls
    ]
    content = output.content if output.content or not calls else None
    return AssistantMessage(content=content, tool_calls=calls or None), _finish_reason(output, finish_reason)


class StreamedMessages:
    """The choices of one chat stream as deltas; each choice's log-probabilities wait for the delta that sends
    their tokens' text (a call is sent only once it is complete, so its tokens' wait with it)."""

    def __init__(self, plan: ToolCallPlan | None) -> None:
        self._plan = plan
        self._outputs: dict[int, ToolCallOutput] = {}
        self._logprobs: dict[int, list[Logprobs]] = {}

    def feed(
        self, index: int, text: str, logprobs: Logprobs | None
    ) -> tuple[DeltaMessage | None, Logprobs | None]:
        """The delta choice `index` has to send for this text (None: nothing yet), with its log-probabilities."""
        if logprobs is not None:
            self._logprobs.setdefault(index, []).append(logprobs)
        if self._plan is None:
            delta = DeltaMessage(content=text) if text else None
        else:
            delta = _delta(self._output(index).feed(text))
        return delta, (self._take_logprobs(index) if delta is not None else None)

    def finish(
        self, index: int, finish_reason: str | None
    ) -> tuple[DeltaMessage | None, str | None, Logprobs | None]:
        """At choice `index`'s end: a last delta (or None), its finish reason, and the log-probabilities not sent."""
        if self._plan is None:
            return None, finish_reason, self._take_logprobs(index)
        output = self._output(index)
        delta = _delta(output.finish())
        return delta, _finish_reason(output, finish_reason), self._take_logprobs(index)

    def _output(self, index: int) -> ToolCallOutput:
        if index not in self._outputs:
            self._outputs[index] = ToolCallOutput(self._plan)
        return self._outputs[index]

    def _take_logprobs(self, index: int) -> Logprobs | None:
        pending = self._logprobs.pop(index, None)
        return concat(pending) if pending else None


def _delta(out: OutputDelta) -> DeltaMessage | None:
    if not out:
        return None
    calls = [
        DeltaToolCall(
            index=c.index, id=c.id, type="function" if c.id is not None else None,
            function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
        )
        for c in out.calls
    ]  # fmt: skip
    return DeltaMessage(content=out.content or None, tool_calls=calls or None)


def _finish_reason(output: ToolCallOutput, finish_reason: str | None) -> str | None:
    return "tool_calls" if output.calls and finish_reason == "stop" else finish_reason

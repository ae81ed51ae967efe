"""The tool-call wire formats: those the served families write on their own (read under `tool_choice: "auto"`,
chosen by `--tool-call-parser` with vLLM's names) and the JSON a forced `tool_choice` makes any model write."""

from __future__ import annotations

from amoe.tool_calls.reader import FormatReader, Reading


class HermesReader(FormatReader):
    """Hermes 2 Pro's format, which Qwen2.5 and Qwen3 write: each call a JSON object with "name" and "arguments"
    in its own `<tool_call>...</tool_call>` block, after any content (vLLM's `hermes`). An output that ends
    before its last block's end tag keeps that complete call, as vLLM reads it."""

    START, END = "<tool_call>", "</tool_call>"

    def _read(self) -> Reading:
        if (yield from self._content((self.START,))) is None:
            return
        start = self._pos - len(self.START)
        while True:
            yield from self._skip_ws()
            index = yield from self._call_object("arguments")
            if index is None:
                return (yield from self._fail(start))
            yield from self._skip_ws()
            if (yield from self._peek()) is not None and not (yield from self._literal(self.END)):
                return (yield from self._fail(start))
            if not (yield from self._next_call(index, self.START)):
                return
            start = self._pos - len(self.START)


class DeepSeekV3Reader(FormatReader):
    """DeepSeek-V3's tool-call tokens (vLLM's `deepseek_v3`): after any content, `<｜tool▁calls▁begin｜>`, then per
    call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and its arguments in a ```json fence, closed by
    `<｜tool▁call▁end｜>`; `<｜tool▁calls▁end｜>` ends the calls."""

    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def _read(self) -> Reading:
        if (yield from self._content((self.CALLS_BEGIN,))) is None:
            return
        start = self._pos - len(self.CALLS_BEGIN)
        while True:
            yield from self._skip_ws()
            if (yield from self._peek()) is None:  # the output ended before the calls' end token: they stand
                return
            if (yield from self._literal(self.CALLS_END)):
                return (yield from self._nothing_more())
            index = yield from self._call()
            if index is None:
                return (yield from self._fail(start))
            start = self._pos

    def _call(self) -> Reading:
        if not (yield from self._literal(self.CALL_BEGIN)):
            return None
        if (yield from self._until(self.SEP, limit=32)) != "function":
            return None
        name = yield from self._until("\n", limit=256)
        index = self._start_call(name) if name is not None else None
        if index is None or not (yield from self._literal("```json")):
            return None
        yield from self._skip_ws()
        if not (yield from self._arguments(index)):
            return None
        yield from self._skip_ws()
        if not ((yield from self._literal("```")) and (yield from self._literal(self.CALL_END))):
            return None
        self._end_call(index)
        return index


class MistralReader(FormatReader):
    """Mistral's `[TOOL_CALLS]` (vLLM's `mistral`): the calls as a JSON array of {"name", "arguments"} objects, as
    Mistral-7B-Instruct-v0.3 and Mixtral-8x22B-Instruct write them, or, from tokenizer v11 on, `NAME{arguments}`
    after each `[TOOL_CALLS]`. The marker is a special token, kept in the text while a request may call tools."""

    START = "[TOOL_CALLS]"
    NEEDS_SPECIAL_TOKENS = True
    ID_STYLE = "mistral"

    def _read(self) -> Reading:
        if (yield from self._content((self.START,))) is None:
            return
        start = self._pos - len(self.START)
        yield from self._skip_ws()
        if (yield from self._peek()) == "[":
            self._pos += 1
            return (yield from self._call_array(start, "arguments"))
        while True:
            name = yield from self._until("{", limit=256)
            index = self._start_call(name) if name is not None else None
            if index is not None:
                self._pos -= 1  # the "{" opens the arguments
            if index is None or not (yield from self._arguments(index)):
                return (yield from self._fail(start))
            if not (yield from self._next_call(index, self.START)):
                return
            start = self._pos - len(self.START)


class RequiredReader(FormatReader):
    """What `tool_choice: "required"` makes the model write (vLLM's schema): a JSON array of one or more
    {"name", "parameters"} objects."""

    def _read(self) -> Reading:
        yield from self._skip_ws()
        start = self._pos
        if not (yield from self._literal("[")):
            return (yield from self._fail(start))
        yield from self._call_array(start, "parameters")


class NamedReader(FormatReader):
    """What a named `tool_choice` makes the model write (vLLM's schema): that function's arguments, one JSON
    object."""

    def __init__(self, tool_names: frozenset[str], function: str) -> None:
        super().__init__(tool_names | {function}, max_calls=1)
        self._function = function

    def _read(self) -> Reading:
        index = self._start_call(self._function)
        yield from self._skip_ws()
        if not (yield from self._arguments(index)):
            return (yield from self._fail(0))
        self._end_call(index)
        yield from self._nothing_more()


# --tool-call-parser: vLLM's names for the formats the served families write.
PARSERS: dict[str, type[FormatReader]] = {
    "hermes": HermesReader,
    "deepseek_v3": DeepSeekV3Reader,
    "mistral": MistralReader,
}

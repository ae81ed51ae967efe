"""Reading a model's output as content and tool calls, piece by piece, whatever the wire format.

A format is a generator (`FormatReader._read`) written as if the whole output were there: it asks for the next
character, a literal, a JSON value, and yields whenever the text that has arrived cannot answer yet. Each piece fed
in resumes it. What it reads comes out as events: content, a call's start (its name), its arguments' text as it is
read, its end; a call that turns out malformed comes out as `Broken`, its raw text, and from there on everything is
content.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass

from amoe.tool_calls.json_scan import JsonScanner, Member

_WS = " \t\n\r"


@dataclass(frozen=True)
class Text:
    """Content: text that is no tool call."""

    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of a call's arguments, exactly as the model wrote them (JSON)."""

    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int


@dataclass(frozen=True)
class Broken:
    """The call being read is malformed: its raw text so far; all that follows is content."""

    text: str


Event = Text | CallStart | CallArguments | CallEnd | Broken
Reading = Generator[None, None, object]


class FormatReader:
    """One output's reader in one wire format: `feed` each piece of text, `finish` at its end; both return the
    events the text completed. `tool_names` are the callable functions (a call to another is malformed);
    `max_calls` caps the calls (a call past it is read as content)."""

    # Whether the format's markers are special tokens, which the output's text must keep (vLLM's mistral parser).
    NEEDS_SPECIAL_TOKENS = False
    # The ids its calls get: "random" (vLLM's chatcmpl-tool-...) or "mistral" (nine letters and digits, which
    # Mistral's chat templates insist on when the calls come back in the history).
    ID_STYLE = "random"

    def __init__(self, tool_names: frozenset[str], max_calls: int | None = None) -> None:
        self._tools = tool_names
        self._max_calls = max_calls
        self._text = ""  # what has arrived, from absolute position _base on
        self._base = 0
        self._pos = 0  # absolute position of the next character to read
        self._ended = False
        self._events: list[Event] = []
        self._num_calls = 0
        self._reading = self._run()
        self._alive = True

    def feed(self, text: str) -> list[Event]:
        self._text += text
        return self._resume()

    def finish(self) -> list[Event]:
        self._ended = True
        return self._resume()

    def _read(self) -> Reading:  # the format: overridden
        yield from self._passthrough()

    def _run(self) -> Reading:
        yield from self._read()
        yield from self._passthrough()  # a format that stops early leaves the rest as content, never drops it

    def _resume(self) -> list[Event]:
        if self._alive:
            try:
                next(self._reading)
            except StopIteration:
                self._alive = False
        events, self._events = self._events, []
        return events

    # ---- positions in the text that has arrived

    @property
    def _end(self) -> int:
        return self._base + len(self._text)

    def _slice(self, start: int, end: int) -> str:
        return self._text[start - self._base : end - self._base]

    def _trim(self) -> None:
        """Forget what has been read: only while no call is open (a broken call's raw text starts at its start)."""
        self._text = self._text[self._pos - self._base :]
        self._base = self._pos

    def _emit(self, event: Event) -> None:
        if not isinstance(event, (Text, CallArguments)) or event.text:
            self._events.append(event)

    # ---- reading steps (generators: `x = yield from self._step()`)

    def _wait(self) -> Generator[None, None, bool]:
        """Wait for more text; False once none will come."""
        if self._ended:
            return False
        yield
        return True

    def _peek(self) -> Generator[None, None, str | None]:
        """The next character, not consumed; None at the end of the output."""
        while self._pos >= self._end:
            if not (yield from self._wait()):
                return None
        return self._text[self._pos - self._base]

    def _skip_ws(self) -> Reading:
        while (ch := (yield from self._peek())) is not None and ch in _WS:
            self._pos += 1

    def _literal(self, word: str) -> Generator[None, None, bool]:
        """Consume `word` if the text goes on with it."""
        while True:
            have = self._slice(self._pos, self._pos + len(word))
            if have == word:
                self._pos += len(word)
                return True
            if not word.startswith(have) or not (yield from self._wait()):
                return False

    def _until(self, stop: str, limit: int) -> Generator[None, None, str | None]:
        """The text before `stop` (consumed, and `stop` with it); None if `stop` is not within `limit` characters."""
        while True:
            found = self._text.find(stop, self._pos - self._base, self._pos - self._base + limit + len(stop))
            if found >= 0:
                text = self._slice(self._pos, self._base + found)
                self._pos = self._base + found + len(stop)
                return text
            if self._end - self._pos >= limit + len(stop) or not (yield from self._wait()):
                return None

    def _content(self, markers: tuple[str, ...]) -> Generator[None, None, str | None]:
        """Content up to the first of `markers`, sent as it arrives but for a tail that may begin one; the marker
        read past, or None at the end of the output."""
        while True:
            rel = self._pos - self._base
            hits = [(at, m) for m in markers if (at := self._text.find(m, rel)) >= 0]
            if hits:
                at, marker = min(hits)
                self._emit(Text(self._text[rel:at]))
                self._pos = self._base + at
                self._trim()  # from the marker on: a broken call's raw text starts with it
                self._pos += len(marker)
                return marker
            keep = max(_prefix_tail(self._text, m, rel) for m in markers)
            self._emit(Text(self._text[rel : len(self._text) - keep]))
            self._pos = self._end - keep
            self._trim()
            if not (yield from self._wait()):
                self._emit(Text(self._slice(self._pos, self._end)))
                self._pos = self._end
                return None

    def _passthrough(self) -> Reading:
        """Everything from here on is content."""
        while True:
            self._emit(Text(self._slice(self._pos, self._end)))
            self._pos = self._end
            self._trim()
            if not (yield from self._wait()):
                return

    def _fail(self, start: int) -> Reading:
        """The call that began at `start` is malformed: its text and all that follows are content."""
        self._emit(Broken(self._slice(start, self._end)))
        self._pos = self._end
        yield from self._passthrough()

    # ---- calls

    def _next_call(self, index: int, marker: str) -> Reading:
        """Call `index` has ended: True when `marker` opens another call after it; False when the output ends there
        or, having failed the rest as content, when anything else follows."""
        self._end_call(index)
        yield from self._skip_ws()
        start = self._pos
        if (yield from self._peek()) is None:
            return False
        if not (yield from self._literal(marker)):
            yield from self._fail(start)
            return False
        return True

    def _start_call(self, name: object) -> int | None:
        """A call of `name` begins: its index, or None if it may not (an unknown function, one call too many)."""
        if not isinstance(name, str) or name not in self._tools:
            return None
        if self._max_calls is not None and self._num_calls >= self._max_calls:
            return None
        index, self._num_calls = self._num_calls, self._num_calls + 1
        self._emit(CallStart(index, name))
        return index

    def _end_call(self, index: int) -> None:
        self._emit(CallEnd(index))

    def _arguments(self, index: int) -> Generator[None, None, bool]:
        """A call's arguments: one JSON object, sent on as it is read."""
        if (yield from self._peek()) != "{":
            return False
        scanner = JsonScanner()
        while True:
            read = scanner.scan(self._text, self._pos - self._base) + self._base
            if scanner.failed:
                return False
            self._emit(CallArguments(index, self._slice(self._pos, read)))
            self._pos = read
            if scanner.done:
                return True
            if not (yield from self._wait()):
                return False

    def _call_object(self, arguments_key: str) -> Generator[None, None, int | None]:
        """A call written as one JSON object with its "name" and its arguments (an object, or a string holding
        one, as vLLM reads it) under `arguments_key`, in either order; other members are ignored. The call's index,
        or None if it is malformed."""
        if (yield from self._peek()) != "{":
            return None
        scanner, index, sent = JsonScanner(), None, -1
        while True:
            self._pos = scanner.scan(self._text, self._pos - self._base) + self._base
            if scanner.failed:
                return None
            members = {m.key: m for m in reversed(scanner.members)}  # the first of a repeated key counts
            name, args = members.get("name"), members.get(arguments_key)
            if index is None and name is not None and name.end is not None:
                index = self._start_call(json.loads(self._text[name.start : name.end]))
                if index is None:
                    return None
            if index is not None and args is not None and args.start >= 0:
                sent = self._send_arguments(index, args, sent)
                if sent is None:
                    return None
            if scanner.done:
                return index if args is not None and args.end is not None else None
            if not (yield from self._wait()):
                return None

    def _send_arguments(self, index: int, args: Member, sent: int) -> int | None:
        """Send what has been read of a call object's arguments past `sent` (positions in _text, which no call
        trims); where they have been sent to, or None if they are no object."""
        if self._text[args.start] == "{":
            upto = args.end if args.end is not None else self._pos - self._base
            self._emit(CallArguments(index, self._text[max(sent, args.start) : upto]))
            return upto
        if self._text[args.start] != '"':
            return None
        if args.end is None or sent == args.end:  # a string goes out whole, once read
            return sent
        text = _object_in_string(self._text[args.start : args.end])
        if text is None:
            return None
        self._emit(CallArguments(index, text))
        return args.end

    def _call_array(self, start: int, arguments_key: str) -> Reading:
        """Calls as the items of a JSON array (its "[" read already), each a `_call_object`."""
        while True:
            yield from self._skip_ws()
            index = yield from self._call_object(arguments_key)
            if index is None:
                return (yield from self._fail(start))
            yield from self._skip_ws()
            ch = yield from self._peek()
            if ch not in (",", "]", None):
                return (yield from self._fail(start))
            self._end_call(index)
            if ch is None:  # the output ended before the array did: its complete calls stand
                return
            self._pos += 1
            start = self._pos
            if ch == "]":
                return (yield from self._nothing_more())

    def _nothing_more(self) -> Reading:
        """Only whitespace may follow the calls: anything else is content."""
        yield from self._skip_ws()
        if (yield from self._peek()) is not None:
            yield from self._fail(self._pos)


def _object_in_string(literal: str) -> str | None:
    """The JSON object a JSON string literal holds, as text; None if it holds none."""
    text = json.loads(literal)
    try:
        return text if isinstance(json.loads(text), dict) else None
    except json.JSONDecodeError:
        return None


def _prefix_tail(text: str, marker: str, start: int) -> int:
    """The length of the longest end of text[start:] that begins `marker` (and may become it)."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - n :]):
            return n
    return 0

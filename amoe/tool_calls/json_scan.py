"""Where a JSON value ends in text that arrives piece by piece, its syntax checked (RFC 8259) on the way.

A tool call's arguments stream to the client as the model writes them, so their end must be found without waiting
for the whole output, and a broken call must be caught at the character that breaks it. One scanner reads one
value; for an object at the top it also records each member's key and where its value lies, which is all a
tool-call format needs to pick out a call's name and arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}

# What the scanner waits for between tokens.
_VALUE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER_VALUE, _VALUE_OR_CLOSE = range(6)
# Inside a number: the part being read (RFC 8259's number grammar); a number can end only in the _ENDS states.
_MINUS, _ZERO, _INT, _POINT, _FRACTION, _EXP, _EXP_SIGN, _EXP_DIGITS = range(8)
_ENDS = (_ZERO, _INT, _FRACTION, _EXP_DIGITS)


@dataclass
class Member:
    """One member of the top-level object: its key, and where its value starts and (once read) ends."""

    key: str
    start: int
    end: int | None = None


class JsonScanner:
    """Reads one JSON value from a growing text: `scan` takes what has arrived, stops right after the value, and
    reports a syntax error as `failed` (at the offending character, never later)."""

    def __init__(self) -> None:
        self.done = False
        self.failed = False
        self.members: list[Member] = []  # of the top-level object, in order
        self._stack: list[str] = []  # open containers, "{" or "["
        self._expect = _VALUE
        self._scalar: str | None = None  # inside a string, escape, \\u, number or literal
        self._number = _MINUS
        self._pending = ""  # a literal's remaining letters, or a \\u escape's count of hex digits still due
        self._string_start = 0  # where the string being read starts (a top-level key is decoded from it)
        self._is_key = False

    def scan(self, text: str, pos: int) -> int:
        """Read text[pos:]; the position after the last character read (the value's end once `done`)."""
        while pos < len(text) and not (self.done or self.failed):
            if self._scalar is not None:
                pos = self._in_scalar(text, pos)
            else:
                pos = self._between(text, pos)
        return pos

    def end_of_input(self) -> None:
        """No more text comes: a top-level number ends here; anything else still open is incomplete."""
        if self._scalar == "number" and not self._stack and self._number in _ENDS:
            self._scalar = None
            self.done = True

    def _between(self, text: str, pos: int) -> int:
        ch = text[pos]
        if ch in _WS:
            return pos + 1
        expect = self._expect
        if expect == _COLON:
            self._check(ch == ":")
            self._expect = _VALUE
            return pos + 1
        if expect in (_KEY_OR_CLOSE, _KEY):
            if ch == "}" and expect == _KEY_OR_CLOSE:
                return self._close(pos)
            self._check(ch == '"')
            self._start_string(pos, is_key=True)
            return pos + 1
        if expect == _AFTER_VALUE:
            top = self._stack[-1]
            if ch == ",":
                self._expect = _KEY if top == "{" else _VALUE
                return pos + 1
            self._check(ch == ("}" if top == "{" else "]"))
            return self._close(pos)
        if expect == _VALUE_OR_CLOSE and ch == "]":
            return self._close(pos)
        return self._start_value(ch, pos)

    def _start_value(self, ch: str, pos: int) -> int:
        if len(self._stack) == 1 and self._stack[0] == "{" and self.members:
            self.members[-1].start = pos  # a top-level member's value starts here
        if ch in "{[":
            self._stack.append(ch)
            self._expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        elif ch == '"':
            self._start_string(pos, is_key=False)
        elif ch == "-" or ch in _DIGITS:
            self._scalar, self._number = "number", _MINUS if ch == "-" else (_ZERO if ch == "0" else _INT)
        elif ch in _LITERALS:
            self._scalar, self._pending = "literal", _LITERALS[ch]
        else:
            self.failed = True
        return pos + 1

    def _start_string(self, pos: int, is_key: bool) -> None:
        self._scalar, self._string_start, self._is_key = "string", pos, is_key

    def _in_scalar(self, text: str, pos: int) -> int:
        kind, ch = self._scalar, text[pos]
        if kind == "string":
            if ch == '"':
                self._scalar = None
                self._end_string(text, pos + 1)
            elif ch == "\\":
                self._scalar = "escape"
            else:
                self._check(ch >= " ")  # control characters must be escaped
        elif kind == "escape":
            self._check(ch in _ESCAPES or ch == "u")
            self._scalar, self._pending = ("unicode", "xxxx") if ch == "u" else ("string", "")
        elif kind == "unicode":
            self._check(ch in _HEX)
            self._pending = self._pending[1:]
            if not self._pending:
                self._scalar = "string"
        elif kind == "literal":
            self._check(ch == self._pending[0])
            self._pending = self._pending[1:]
            if not self._pending:
                self._scalar = None
                self._value_done(pos + 1)
        else:
            return self._in_number(ch, pos)
        return pos + 1

    def _in_number(self, ch: str, pos: int) -> int:
        state, digit = self._number, ch in _DIGITS
        if state == _MINUS and digit:
            self._number = _ZERO if ch == "0" else _INT
        elif state in (_INT, _FRACTION, _EXP_DIGITS) and digit:
            pass
        elif state in (_ZERO, _INT) and ch == ".":
            self._number = _POINT
        elif state == _POINT and digit:
            self._number = _FRACTION
        elif state in (_ZERO, _INT, _FRACTION) and ch in "eE":
            self._number = _EXP
        elif state == _EXP and ch in "+-":
            self._number = _EXP_SIGN
        elif state in (_EXP, _EXP_SIGN) and digit:
            self._number = _EXP_DIGITS
        else:  # the number ended at the previous character: this one is read again, after it
            self._check(state in _ENDS)
            self._scalar = None
            self._value_done(pos)
            return pos
        return pos + 1

    def _end_string(self, text: str, end: int) -> None:
        if not self._is_key:
            self._value_done(end)
            return
        if len(self._stack) == 1:  # a key of the top-level object
            self.members.append(Member(json.loads(text[self._string_start : end]), start=-1))
        self._expect = _COLON

    def _close(self, pos: int) -> int:
        self._stack.pop()
        self._value_done(pos + 1)
        return pos + 1

    def _value_done(self, end: int) -> None:
        if self.failed:
            return
        if not self._stack:
            self.done = True
            return
        if len(self._stack) == 1 and self._stack[0] == "{" and self.members:
            self.members[-1].end = end
        self._expect = _AFTER_VALUE

    def _check(self, ok: bool) -> None:
        if not ok:
            self.failed = True

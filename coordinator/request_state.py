"""Per-request output state: incremental detokenization, stop strings and what text is safe to send yet."""

from __future__ import annotations

from typing import Protocol

from amoe.request_rules import StopMatcher


class Detokenizer(Protocol):
    """Turns token ids, one at a time, into newly completed text (amoe.tokenizer.IncrementalDetokenizer)."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class RequestState:
    """Text generated so far for one request, cut at the first stop string."""

    def __init__(self, detokenizer: Detokenizer, stop: list[str], num_prompt_tokens: int) -> None:
        self._detokenizer = detokenizer
        self._stops = StopMatcher(stop)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.text = ""
        self._sent = 0  # characters of self.text already handed out
        self.finish_reason: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_ids: list[int], finish_reason: str | None) -> None:
        """Add the engine's new tokens; a stop string found in the text finishes the request with "stop"."""
        if self.is_finished:
            return
        self.num_output_tokens += len(token_ids)
        new = "".join(self._detokenizer.add(t) for t in token_ids)
        if finish_reason is not None:
            new += self._detokenizer.flush()  # an incomplete last character comes out as U+FFFD
        self.text += new
        cut = self._stops.feed(new)  # linear in the output: only the new text is scanned
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
        else:
            self.finish_reason = finish_reason

    def take_text(self) -> str:
        """New text that can be sent now: all of it once finished, else all but a possible stop-string prefix."""
        end = len(self.text) if self.is_finished else len(self.text) - self._stops.pending
        if end <= self._sent:
            return ""
        chunk = self.text[self._sent : end]
        self._sent = end
        return chunk

"""Per-request output state: incremental detokenization, stop strings and what text is safe to send yet."""

from __future__ import annotations

from typing import Protocol


class Detokenizer(Protocol):
    """Turns token ids, one at a time, into newly completed text (amoe.tokenizer.IncrementalDetokenizer)."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class RequestState:
    """Text generated so far for one request, cut at the first stop string."""

    def __init__(self, detokenizer: Detokenizer, stop: list[str], num_prompt_tokens: int) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
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
        start = max(0, len(self.text) - self._max_stop_len + 1)  # a match may begin in the old text
        self.text += "".join(self._detokenizer.add(t) for t in token_ids)
        if finish_reason is not None:
            self.text += self._detokenizer.flush()  # an incomplete last character comes out as U+FFFD
        cut = self._find_stop(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
        else:
            self.finish_reason = finish_reason

    def take_text(self) -> str:
        """New text that can be sent now: all of it once finished, else all but a possible stop-string prefix."""
        end = len(self.text) if self.is_finished else len(self.text) - self._stop_prefix_len()
        if end <= self._sent:
            return ""
        chunk = self.text[self._sent : end]
        self._sent = end
        return chunk

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of the text that could still grow into a stop string (held back)."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _find_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

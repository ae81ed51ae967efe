"""Per-request output state: incremental detokenization, stop strings and what text is safe to send yet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from amoe.logprobs import Logprobs, concat
from amoe.request_rules import StopMatcher


class Detokenizer(Protocol):
    """Turns token ids, one at a time, into newly completed text (amoe.tokenizer.IncrementalDetokenizer)."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class OutputChunk:
    """What one sequence has to send, fixed when it was taken: a consumer may hold it while the sequence goes on
    (the prompts of one API call run in tasks of their own), so nothing here may be read from the live state."""

    index: int  # which of the request's sequences
    text: str
    finish_reason: str | None  # set on the sequence's last chunk only
    logprobs: Logprobs  # of the tokens whose text this is (empty when not asked)
    prompt_logprobs: Logprobs | None
    state: RequestState  # the sequence's output as it goes on: its whole text and counts once it has finished

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """Text generated so far for one request, cut at the first stop string.

    Linear in the output: the text is kept as pieces (joined once, when asked for) and only the unsent tail is
    ever sliced, so a long generation costs no repeated copies of everything before it.
    """

    def __init__(
        self,
        detokenizer: Detokenizer,
        stop: list[str],
        num_prompt_tokens: int,
        include_stop_str: bool = False,
        index: int = 0,
        end_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._detokenizer = detokenizer
        self._end_token_ids = end_token_ids  # a token that ends the output (eos, stop_token_ids): not text
        self._stops = StopMatcher(stop)
        self._include_stop_str = (
            include_stop_str  # vLLM's include_stop_str_in_output: cut after it, not before
        )
        self.index = index  # which of the request's sequences (n > 1)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self._parts: list[str] = []  # the text, piece by piece
        self._length = 0  # characters in _parts
        self._unsent: list[str] = []  # the text's end not yet handed out, piece by piece
        self._sent = 0  # characters already handed out
        self.finish_reason: str | None = None
        # Log-probabilities, when the request asked (or best_of ranks by them): of the output tokens (delta by
        # delta, the unsent ones apart) and of the prompt's tokens 1.. (shared by the request's sequences).
        self._logprobs: list[Logprobs] = []
        self._unsent_logprobs: list[Logprobs] = []
        self.prompt_logprobs: Logprobs | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All the text so far (after a stop string: up to it)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def append(
        self, token_ids: list[int], finish_reason: str | None, logprobs: Logprobs | None = None
    ) -> None:
        """Add the engine's new tokens (with their log-probabilities, if asked); a stop string found in the text
        finishes the request with "stop"."""
        if self.is_finished:
            return
        if logprobs is not None:
            self._logprobs.append(logprobs)
            self._unsent_logprobs.append(logprobs)
        self.num_output_tokens += len(token_ids)
        shown = token_ids
        if finish_reason == "stop" and token_ids and token_ids[-1] in self._end_token_ids:
            shown = token_ids[:-1]  # vLLM's: the token that stopped the output is not detokenized
        new = "".join(self._detokenizer.add(t) for t in shown)
        if finish_reason is not None:
            new += self._detokenizer.flush()  # an incomplete last character comes out as U+FFFD
        cut = self._stops.feed(new)  # linear in the output: only the new text is scanned
        if cut is not None and self._include_stop_str:
            cut += len(self._stops.matched)
        if cut is not None:  # the stop string starts at `cut` in the whole text: keep what comes before it
            new = new[: max(0, cut - self._length)]
            self._parts, self._length = [self.text[:cut]], min(cut, self._length)
            self._unsent = ["".join(self._unsent)[: max(0, cut - self._sent)]]
            self.finish_reason = "stop"
        else:
            self.finish_reason = finish_reason
        self._parts.append(new)
        self._unsent.append(new)
        self._length += len(new)

    def take_chunk(self) -> OutputChunk | None:
        """The new text that can be sent now, with those tokens' log-probabilities and, once finished, the finish
        reason; None while nothing can (the new text may be a stop string's start): the log-probabilities wait."""
        text = self.take_text()
        if not text and not self.is_finished:
            return None
        logprobs = self._take_logprobs()
        return OutputChunk(self.index, text, self.finish_reason, logprobs, self.prompt_logprobs, self)

    def take_text(self) -> str:
        """New text that can be sent now: all of it once finished, else all but a possible stop-string prefix."""
        end = self._length if self.is_finished else self._length - self._stops.pending
        if end <= self._sent:
            return ""
        unsent = "".join(self._unsent)  # at most what is new since the last call, plus a held-back prefix
        chunk, rest = unsent[: end - self._sent], unsent[end - self._sent :]
        self._unsent = [rest] if rest else []
        self._sent = end
        return chunk

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' log-probabilities (best_of ranks by it; 0 when none were computed)."""
        return sum(sum(part.logprobs) for part in self._logprobs)

    @property
    def logprobs(self) -> Logprobs:
        """The log-probabilities of every output token so far (empty if not asked)."""
        return concat(self._logprobs)

    def _take_logprobs(self) -> Logprobs:
        """Those not handed out yet: they go with the text a stream sends now."""
        unsent, self._unsent_logprobs = self._unsent_logprobs, []
        return concat(unsent)

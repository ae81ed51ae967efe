"""LLM: offline batch generation in one process (vLLM-style `LLM(...).generate(...)`) on the local engine."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amoe.engine.config import EngineConfig
from amoe.engine.local import LocalEngine
from amoe.errors import RequestError
from amoe.generation_config import sampling_defaults
from amoe.logprobs import Logprobs, concat
from amoe.request_rules import StopMatcher
from amoe.sampling_params import SamplingParams
from amoe.tokenizer import TOKENIZER_FILE, IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int]


@dataclass(frozen=True)
class Logprob:
    """vLLM's: one token's log-probability at a position, its rank there (1: the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# vLLM's per-position form: the token there and the k most likely, token id -> Logprob
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length"
    # The sum of its tokens' log-probabilities, when they were computed (logprobs asked, or best_of ranked it).
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # per token, when SamplingParams.logprobs asked


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None for the first token; when asked


@dataclass
class _Pending:
    """One sequence being generated: its tokens so far and, with a tokenizer, its text so far."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stops: StopMatcher
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_cut: int | None = None  # where the text ends when a stop string ended the request
    index: int = 0  # which of the prompt's sequences (n > 1)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: Logprobs | None = None  # the prompt's, on its first sequence

    @property
    def cumulative_logprob(self) -> float:
        """best_of ranks by it."""
        return sum(sum(part.logprobs) for part in self.logprobs)

    @property
    def text(self) -> str:
        if self.detokenizer is None:
            return ""
        return self.detokenizer.text if self.stop_cut is None else self.detokenizer.text[: self.stop_cut]


class LLM:
    """A model served in-process: `LLM(path).generate(["Hello"], SamplingParams(temperature=0))`."""

    def __init__(
        self, model: str | Path | None = None, *, generation_config: str = "auto", **engine_options: Any
    ) -> None:
        """model: a Hugging Face checkpoint directory (None: the shipped default model); generation_config:
        where generate()'s default sampling parameters come from, as vLLM's (amoe.generation_config); engine_options:
        fields of amoe.engine.config.EngineConfig (block_size, num_kv_blocks, max_num_seqs, dtype, seed, ...)."""
        if model is None:
            from amoe.model.make import default_model_path

            model = default_model_path()
        self.model_dir = Path(model)
        self._defaults = sampling_defaults(self.model_dir, generation_config)
        self.engine = LocalEngine(self.model_dir, EngineConfig.from_options(**engine_options))
        self.tokenizer = _load_tokenizer(self.model_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) and return the outputs in input order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        pending: list[list[_Pending]] = []  # per prompt, its sequences
        try:
            for prompt, params in zip(prompt_list, params_list):
                pending.append(self._submit(prompt, params))
            by_id = {(p.request_id, p.index): p for seqs in pending for p in seqs}
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    seq = by_id[(out.request_id, out.index)]
                    if out.logprobs is not None:
                        seq.logprobs.append(out.logprobs)
                    if out.prompt_logprobs is not None:
                        seq.prompt_logprobs = out.prompt_logprobs
                    self._absorb(seq, out.new_token_ids, out.finish_reason)
        except BaseException:  # a bad prompt or an interrupt must not leave requests behind in the engine
            for seqs in pending:
                self.engine.abort(seqs[0].request_id)
            raise
        return [self._to_output(seqs) for seqs in pending]

    def _submit(self, prompt: PromptInput, params: SamplingParams) -> list[_Pending]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.model_dir} has no tokenizer.json: pass token ids instead of text")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            token_ids, text = list(prompt), None
        request_id = next(self._ids)
        self.engine.add_request(request_id, token_ids, params)
        return [
            _Pending(
                request_id,
                text,
                token_ids,
                params,
                self._detokenizer(token_ids, params),
                StopMatcher(params.stop),
                index=index,
            )  # fmt: skip
            for index in range(params.num_sequences)
        ]

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)

    def _absorb(self, pending: _Pending, new_token_ids: list[int], finish_reason: str | None) -> None:
        """Add a step's tokens and text; a stop string in the new text ends the request (text cut before it)."""
        pending.token_ids += new_token_ids
        pending.finish_reason = finish_reason
        if pending.detokenizer is None:
            return
        for token in new_token_ids:
            cut = pending.stops.feed(pending.detokenizer.add(token))
            if cut is not None:  # a stop string ends the sequence: the text is cut before it (or after it)
                if pending.params.include_stop_str_in_output:
                    cut += len(pending.stops.matched)
                pending.stop_cut, pending.finish_reason = cut, "stop"
                self.engine.abort(pending.request_id, pending.index)
                return
        if finish_reason is not None:
            pending.detokenizer.flush()

    def _to_output(self, seqs: list[_Pending]) -> RequestOutput:
        """The prompt's n completions (best_of > n: the n of highest cumulative log-probability)."""
        first, params = seqs[0], seqs[0].params
        if params.ranks_sequences:
            seqs = sorted(seqs, key=lambda p: p.cumulative_logprob, reverse=True)[: params.n]
        completions = [self._completion(i, p) for i, p in enumerate(seqs)]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None, *self._positions(first.prompt_logprobs)]
        return RequestOutput(
            first.request_id, first.prompt, first.prompt_token_ids, completions, True, prompt_logprobs
        )

    def _completion(self, index: int, seq: _Pending) -> CompletionOutput:
        computed = seq.params.num_logprobs is not None
        logprobs = self._positions(concat(seq.logprobs)) if seq.params.logprobs is not None else None
        cumulative = seq.cumulative_logprob if computed else None
        return CompletionOutput(index, seq.text, seq.token_ids, seq.finish_reason, cumulative, logprobs)

    def _positions(self, logprobs: Logprobs) -> list[PositionLogprobs]:
        """vLLM's form: per position, the token there first, then the k most likely (ranks 1..k)."""

        def text(token_id: int) -> str | None:
            return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None

        out = []
        for i, token in enumerate(logprobs.token_ids):
            entry = {token: Logprob(logprobs.logprobs[i], logprobs.ranks[i], text(token))}
            for rank, (top_id, value) in enumerate(logprobs.top(i), start=1):
                entry.setdefault(top_id, Logprob(value, rank, text(top_id)))
            out.append(entry)
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() samples with when given no SamplingParams: the generation config's defaults, as in vLLM."""
        return SamplingParams(**self._defaults)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise RequestError(f"got {len(params)} sampling params for {count} prompts")
        return params


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """A str, a list of str, one token-id list, or a list of token-id lists → a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if not all(isinstance(p, str) or _is_token_list(p) for p in prompts):
        raise RequestError("prompts must be a string, a list of strings, or token-id list(s)")
    return prompts


def _is_token_list(prompt: object) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)


def _load_tokenizer(model_dir: Path) -> Tokenizer | None:
    if not (model_dir / TOKENIZER_FILE).exists():
        logger.info("[llm] %s has no tokenizer: token-id prompts only", model_dir)
        return None
    return Tokenizer.from_dir(model_dir)

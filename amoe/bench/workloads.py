"""What each benchmark request asks for: a prompt of some length and a number of output tokens.

The AMoE paper's §5 workloads draw each request's input and output lengths independently and uniformly (inclusive)
from a range:

    short       input 30–70     output 70–130
    medium      input 50–150    output 50–250
    reasonable  input 100–300   output 100–500

`random` is vLLM's random dataset: lengths uniform in [L·(1−r), L·(1+r)] for --input-len / --output-len L and
--range-ratio r. `sharegpt:PATH` replays a ShareGPT-style JSON file (see `sharegpt_requests`).

Prompts are token ids when the server accepts them (exact lengths, no tokenizer needed), otherwise text. The output
length is not left to the model: the client forces it with max_tokens and ignore_eos.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from amoe.errors import ConfigError

logger = logging.getLogger(__name__)

PAPER_WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "short": ((30, 70), (70, 130)),
    "medium": ((50, 150), (50, 250)),
    "reasonable": ((100, 300), (100, 500)),
}
WORKLOAD_NAMES = (*PAPER_WORKLOADS, "random", "sharegpt:PATH")
PROMPT_FORMATS = ("ids", "text")

# Without a tokenizer we do not know the vocabulary: ids in this range exist in every tokenizer we serve (amoe's
# demo tokenizer has 1024) and skip the lowest ids, where unk/bos/eos and other special tokens live.
_DEFAULT_ID_RANGE = (10, 1000)
# Without a tokenizer, a word of English text is about 1.3 tokens for Llama/Mixtral-style BPE tokenizers.
TOKENS_PER_WORD = 1.3
# vLLM's ShareGPT filter: shorter prompts or replies make degenerate requests.
_MIN_SHAREGPT_TOKENS = 4
# Common words that most BPE tokenizers encode as one token each after a space: filler for text prompts.
_FILLER_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they you "
    "were her she there one all we their has been if more when will would who so no"
)


class PromptTokenizer(Protocol):
    """What the benchmark needs from a tokenizer (amoe.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: prompt_len is the intended prompt length in tokens (exact for id prompts)."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Length ranges (inclusive) for synthetic workloads, or a ShareGPT file."""

    name: str
    input_range: tuple[int, int] = (0, 0)
    output_range: tuple[int, int] = (0, 0)
    sharegpt_path: Path | None = None


def make_workload(
    spec: str, input_len: int = 1024, output_len: int = 128, range_ratio: float = 0.0
) -> Workload:
    """Parse --workload: a paper workload name, `random` (with the length flags) or `sharegpt:PATH`."""
    if spec in PAPER_WORKLOADS:
        input_range, output_range = PAPER_WORKLOADS[spec]
        return Workload(spec, input_range, output_range)
    if spec == "random":
        return Workload(spec, _ratio_range(input_len, range_ratio), _ratio_range(output_len, range_ratio))
    if spec.startswith("sharegpt:"):
        path = Path(spec.removeprefix("sharegpt:")).expanduser()
        if not path.is_file():
            raise ConfigError(f"ShareGPT file {str(path)!r} does not exist")
        return Workload("sharegpt", sharegpt_path=path)
    raise ConfigError(f"unknown workload {spec!r}; expected one of {', '.join(WORKLOAD_NAMES)}")


def _ratio_range(length: int, ratio: float) -> tuple[int, int]:
    if length < 1:
        raise ConfigError(f"lengths must be >= 1; got {length}")
    if not 0 <= ratio < 1:
        raise ConfigError(f"--range-ratio must be in [0, 1); got {ratio}")
    return max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))


def make_requests(
    workload: Workload,
    num_requests: int,
    *,
    seed: int = 0,
    prompt_format: str = "ids",
    tokenizer: PromptTokenizer | None = None,
    max_model_len: int | None = None,
) -> list[RequestSpec]:
    """The run's requests, the same for the same arguments."""
    if prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"prompt format must be one of {PROMPT_FORMATS}; got {prompt_format!r}")
    # A stream of its own, so that the arrival times (seeded with the same --seed) are not correlated with lengths.
    rng = np.random.default_rng((seed, 1))
    if workload.sharegpt_path is not None:
        return sharegpt_requests(workload.sharegpt_path, num_requests, rng, tokenizer, max_model_len)
    build = _id_prompt if prompt_format == "ids" else _text_prompt
    return [
        RequestSpec(build(prompt_len, rng, tokenizer), prompt_len, output_len)
        for prompt_len, output_len in sample_lengths(workload, num_requests, rng)
    ]


def steady_state_requests(workload: Workload, num_requests: int, *, seed: int = 0) -> list[RequestSpec]:
    """`num_requests` id-prompt requests as a deployment in steady state holds them, for decode-only emulation
    (amoe.perf.studies.steady).

    In steady state a running request is one picked with probability proportional to its output length, part-way
    through it: it has generated a uniform part `a` of its `o` tokens (the length bias of
    amoe.perf.model.cost_model.mean_decode_context). Decode-only emulation takes a prompt's KV as written, so to the
    server such a request is one whose prompt is `a` tokens longer and which has `o - a` tokens left to generate."""
    (in_lo, in_hi), (out_lo, out_hi) = workload.input_range, workload.output_range
    if workload.sharegpt_path is not None or out_lo < 1:
        raise ConfigError(f"steady-state requests need a synthetic workload; got {workload.name!r}")
    rng = np.random.default_rng((seed, 2))
    outputs = np.arange(out_lo, out_hi + 1)
    out = rng.choice(outputs, size=num_requests, p=outputs / outputs.sum())
    inp = rng.integers(in_lo, in_hi + 1, size=num_requests)
    age = (rng.random(num_requests) * out).astype(np.int64)  # uniform on [0, o)
    return [
        RequestSpec(_id_prompt(int(i + a), rng, None), int(i + a), int(o - a))
        for i, a, o in zip(inp, age, out)
    ]


def sample_lengths(workload: Workload, num_requests: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(input, output) lengths, each uniform over its inclusive range."""
    (in_lo, in_hi), (out_lo, out_hi) = workload.input_range, workload.output_range
    inputs = rng.integers(in_lo, in_hi + 1, size=num_requests)
    outputs = rng.integers(out_lo, out_hi + 1, size=num_requests)
    return list(zip(inputs.tolist(), outputs.tolist()))


def _id_prompt(length: int, rng: np.random.Generator, tokenizer: PromptTokenizer | None) -> list[int]:
    # Random ids: no two prompts share a prefix, so a prefix cache cannot flatter the server.
    low, high = (_DEFAULT_ID_RANGE[0], tokenizer.vocab_size) if tokenizer else _DEFAULT_ID_RANGE
    return rng.integers(low, high, size=length).tolist()


def _text_prompt(length: int, rng: np.random.Generator, tokenizer: PromptTokenizer | None) -> str:
    words = [str(w) for w in rng.choice(_FILLER_TEXT.split(), size=2 * length)]
    if tokenizer is None:
        return " ".join(words[: max(1, round(length / TOKENS_PER_WORD))])
    # The fewest words that reach the length; token counts grow with the word count, so bisect.
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi) // 2
        if count_tokens(" ".join(words[:mid]), tokenizer, is_prompt=True) >= length:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def count_tokens(text: str, tokenizer: PromptTokenizer | None, is_prompt: bool = False) -> int:
    """Tokens in `text`: exact with a tokenizer, else estimated as words × 1.3.

    A prompt counts as the server encodes it, with the special tokens its tokenizer adds (e.g. a BOS); a reply
    counts as generated, without them.
    """
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=is_prompt))
    return round(len(text.split()) * TOKENS_PER_WORD)


def sharegpt_requests(
    path: Path,
    num_requests: int,
    rng: np.random.Generator,
    tokenizer: PromptTokenizer | None = None,
    max_model_len: int | None = None,
) -> list[RequestSpec]:
    """Requests from a ShareGPT JSON list of {"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}.

    The prompt is the first human turn (sent as text); the output length is the token count of the reply that
    follows it. Pairs with fewer than 4 tokens on either side, or longer than max_model_len together, are skipped.
    Entries are taken in a seeded random order; if too few are usable, they are reused.
    """
    entries = _load_json_list(path)

    def count(text: str, is_prompt: bool) -> int:
        return count_tokens(text, tokenizer, is_prompt)

    chosen: list[RequestSpec] = []
    for index in rng.permutation(len(entries)).tolist():
        spec = _sharegpt_request(entries[index], count, max_model_len)
        if spec is not None:
            chosen.append(spec)
            if len(chosen) == num_requests:
                return chosen
    if not chosen:
        raise ConfigError(f"{path}: no usable conversation (human turn then gpt reply, fitting the model)")
    logger.warning(
        "%s has only %d usable conversations for %d requests; reusing them", path, len(chosen), num_requests
    )
    return [chosen[i] for i in rng.integers(0, len(chosen), size=num_requests).tolist()]


def _load_json_list(path: Path) -> list[Any]:
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read ShareGPT file {path}: {e}") from None
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: a ShareGPT file is a JSON list of conversations")
    return entries


def _sharegpt_request(
    entry: Any, count: Callable[[str, bool], int], max_model_len: int | None
) -> RequestSpec | None:
    pair = next(_human_gpt_pairs(entry), None)
    if pair is None:
        return None
    prompt, reply = pair
    prompt_len, output_len = count(prompt, True), count(reply, False)
    if prompt_len < _MIN_SHAREGPT_TOKENS or output_len < _MIN_SHAREGPT_TOKENS:
        return None
    if max_model_len is not None and prompt_len + output_len > max_model_len:
        return None
    return RequestSpec(prompt, prompt_len, output_len)


def _human_gpt_pairs(entry: Any) -> Iterator[tuple[str, str]]:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return
    for turn, reply in zip(turns, turns[1:]):
        if _is_turn(turn, "human") and _is_turn(reply, "gpt"):
            yield turn["value"], reply["value"]


def _is_turn(turn: Any, speaker: str) -> bool:
    return isinstance(turn, dict) and turn.get("from") == speaker and isinstance(turn.get("value"), str)

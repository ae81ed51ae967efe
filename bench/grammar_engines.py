"""Which grammar engine for structured output: the token mask's cost per token, side by side in one run.

    .venv/bin/python bench/grammar_engines.py [--vocab 128000] [--repeats 5]

Each engine (llguidance, xgrammar, outlines-core; those installed) follows the same JSON document, token by token,
for the same JSON schema: per token it computes the mask of allowed tokens into a bitmask, then accepts the token.
Two vocabularies: the test checkpoints' byte-level BPE (1024 tokens) and a synthetic one of `--vocab` tokens (no
real tokenizer can be fetched here: its tokens are the byte alphabet, the words of amoe's corpus with and without a
leading space, JSON punctuation runs and letter n-grams of the corpus, the shape of a Llama-3-sized vocabulary).
Also reported: the time to compile the schema for a tokenizer (paid once per request, or once per schema with a
cache). Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
DOCUMENT = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["mathematics", "poetry", '
    '"engines", "notes"], "address": {"city": "London", "zip": "W1"}}'
)


class Vocab:
    """Tokens as bytes, an eos id, and a greedy longest-match tokenizer over them (what each engine is given)."""

    def __init__(self, tokens: list[bytes], eos: int) -> None:
        self.tokens, self.eos = tokens, eos
        self.index = {t: i for i, t in enumerate(tokens) if t}
        self.longest = max(len(t) for t in tokens)

    def encode(self, data: bytes) -> list[int]:
        ids, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                tid = self.index.get(data[i : i + n])
                if tid is not None:
                    ids.append(tid)
                    i += n
                    break
        return ids


def test_vocab() -> Vocab:
    """The test checkpoints' tokenizer (amoe.tokenizer.write_tokenizer), its tokens as the bytes they decode to."""
    import tokenizers

    from amoe.tokenizer import write_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(tmp, 1024)
        backend = tokenizers.Tokenizer.from_file(f"{tmp}/tokenizer.json")
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    vocab = backend.get_vocab()
    tokens = [b""] * backend.get_vocab_size()
    for text, tid in vocab.items():
        tokens[tid] = b"" if text.startswith("<") and text.endswith(">") else bytes(byte_of[c] for c in text)
    return Vocab(tokens, eos=2)


def synthetic_vocab(size: int) -> Vocab:
    from amoe.tokenizer import _corpus

    corpus = _corpus()
    seen: dict[bytes, None] = {b"": None, **{bytes([b]): None for b in range(256)}}
    words = corpus.split()
    for w in words:
        for form in (w, " " + w, w.lower(), " " + w.lower(), '"' + w, w + '"'):
            seen.setdefault(form.encode(), None)
    for run in ('{"', '":', '": "', '",', '", "', '"]', '"}', "}}", "},", ": [", ", ", "  ", "    ", "\n"):
        seen.setdefault(run.encode(), None)
    text = corpus.encode()
    n = 2
    while len(seen) < size and n <= 12:
        for i in range(len(text) - n):
            seen.setdefault(text[i : i + n], None)
            if len(seen) >= size:
                break
        n += 1
    letters = b"abcdefghijklmnopqrstuvwxyz"
    k = 0
    while len(seen) < size:  # letter triples and quads, if the corpus runs out
        a, b, c, d = k % 26, (k // 26) % 26, (k // 676) % 26, k // 17576
        seen.setdefault(
            bytes([letters[a], letters[b], letters[c]]) + (bytes([letters[d % 26]]) if d else b""), None
        )
        k += 1
    return Vocab(list(seen)[:size], eos=0)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table (what byte-level BPE tokens are written in)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# ---- one runner per engine: compile(vocab) -> step(token) closures


def llguidance_runner(vocab: Vocab) -> tuple[float, Callable[[list[int]], None]]:
    import llguidance

    class _Wrapped:
        eos_token_id, bos_token_id, special_token_ids = vocab.eos, None, [vocab.eos]
        tokens = vocab.tokens

        def __call__(self, s: bytes | str) -> list[int]:
            return vocab.encode(s if isinstance(s, bytes) else s.encode())

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()))
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - start

    def run(ids: list[int]) -> None:
        m = matcher.deep_copy()
        for t in ids:
            m.compute_bitmask()
            assert m.consume_token(t), m.get_error()

    return compile_s, run


def xgrammar_runner(vocab: Vocab) -> tuple[float, Callable[[list[int]], None]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(vocab.tokens, vocab_type=xgr.VocabType.RAW, stop_token_ids=[vocab.eos])
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA)
    )
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, len(vocab.tokens))

    m = xgr.GrammarMatcher(compiled)

    def run(ids: list[int]) -> None:
        m.reset()
        for t in ids:
            m.fill_next_token_bitmask(bitmask)
            assert m.accept_token(t)

    return compile_s, run


def outlines_runner(vocab: Vocab) -> tuple[float, Callable[[list[int]], None]]:
    import outlines_core
    import torch

    by_token: dict[bytes, list[int]] = {}
    for i, t in enumerate(vocab.tokens):
        if t and i != vocab.eos:
            by_token.setdefault(t, []).append(i)
    voc = outlines_core.Vocabulary(vocab.eos, by_token)
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, voc)
    compile_s = time.perf_counter() - start
    mask = torch.zeros((len(vocab.tokens) + 31) // 32, dtype=torch.int32)

    guide = outlines_core.Guide(index)

    def run(ids: list[int]) -> None:
        guide.reset()
        for t in ids:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            guide.advance(t)

    return compile_s, run


ENGINES = {
    "llguidance": ("llguidance", llguidance_runner),
    "xgrammar": ("xgrammar", xgrammar_runner),
    "outlines-core": ("outlines_core", outlines_runner),
}


def measure(vocab: Vocab, repeats: int) -> dict[str, dict[str, float]]:
    ids = vocab.encode(DOCUMENT.encode())
    out = {}
    for name, (module, runner) in ENGINES.items():
        if importlib.util.find_spec(module) is None:
            continue
        compile_s, run = runner(vocab)
        run(ids)  # warm: lazily built lexer states are not what a long generation pays per token
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(ids)
            times.append((time.perf_counter() - start) / len(ids))
        out[name] = {"compile_ms": compile_s * 1e3, "us_per_token": statistics.median(times) * 1e6}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128000, help="size of the synthetic vocabulary")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = {}
    for label, vocab in (
        ("test-1024", test_vocab()),
        (f"synthetic-{args.vocab}", synthetic_vocab(args.vocab)),
    ):
        results[label] = measure(vocab, args.repeats)
    print(f"{'vocabulary':<20} {'engine':<14} {'compile ms':>11} {'mask+accept us/token':>21}")
    for label, engines in results.items():
        for name, r in engines.items():
            print(f"{label:<20} {name:<14} {r['compile_ms']:>11.1f} {r['us_per_token']:>21.1f}")
    print(json.dumps({"bench": "grammar_engines", "schema_tokens": len(DOCUMENT), "results": results}))


if __name__ == "__main__":
    main()

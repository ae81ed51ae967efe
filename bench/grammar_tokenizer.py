"""What building the grammar's tokenizer costs a process, once, per tokenizer shape: amoe's table of each token's
bytes (amoe.token_bytes) against llguidance's own tokenizer.json reader, side by side in one run.

    .venv/bin/python bench/grammar_tokenizer.py [--vocab 128000] [--repeats 3]

Synthetic vocabularies of `--vocab` tokens (no real tokenizer can be fetched here), one per shape the supported
families ship: byte-level BPE (GPT-2's byte alphabet, words with and without "Ġ"), sentencepiece BPE with byte
fallback (<0x00>..<0xFF>, words with and without "▁", Replace + ByteFallback + Fuse + Strip) and the same with a
Metaspace decoder. Columns: the byte table alone, the first structured request's check (table, llguidance's
tokenizer and a json_object grammar), and llguidance's reader where it reads the shape. Prints a table and a
final JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from amoe.structured import Grammars, compile_grammar
from amoe.token_bytes import ByteVocabulary

_SENTENCEPIECE_DECODER = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
)


def synthetic(shape: str, size: int) -> tuple[str, int]:
    """(tokenizer.json, eos id) of a `size`-token vocabulary of that shape."""
    rng = random.Random(0)
    if shape == "byte-level":
        base = sorted(pre_tokenizers.ByteLevel.alphabet())
        space, letters = "Ġ", [c for c in base if c.isalpha() and c.isascii()]
    else:
        base = [f"<0x{b:02X}>" for b in range(256)]
        space, letters = "▁", [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {piece: 3 + i for i, piece in enumerate(base)}
    while len(vocab) < size:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
        vocab.setdefault(space + word if rng.random() < 0.5 else word, len(vocab))
    if shape == "byte-level":
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
        backend = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
        )
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = (
            decoders.Metaspace(replacement="▁", prepend_scheme="first")
            if shape == "metaspace-decoder"
            else _SENTENCEPIECE_DECODER
        )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return backend.to_str(), 2


def _median_s(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(shape: str, size: int, repeats: int) -> dict[str, float | None]:
    import llguidance

    tokenizer_json, eos = synthetic(shape, size)
    grammar = compile_grammar(json_object=True)
    table = _median_s(lambda: ByteVocabulary(tokenizer_json, size), repeats)
    first = _median_s(lambda: Grammars(tokenizer_json, size, (eos,)).check(grammar), repeats)
    try:
        theirs = _median_s(
            lambda: llguidance.LLTokenizer(tokenizer_json, n_vocab=size, eos_token=eos), repeats
        )
    except ValueError:  # a decoder llguidance's reader does not know
        theirs = None
    return {"byte_table_s": table, "first_check_s": first, "llguidance_reader_s": theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shapes = ("byte-level", "sentencepiece-byte-fallback", "metaspace-decoder")
    results = {shape: measure(shape, args.vocab, args.repeats) for shape in shapes}
    print(f"{'shape':<28} {'byte table s':>13} {'first check s':>14} {'llguidance reader s':>20}")
    for shape, r in results.items():
        theirs = "unsupported" if r["llguidance_reader_s"] is None else f"{r['llguidance_reader_s']:.3f}"
        print(f"{shape:<28} {r['byte_table_s']:>13.3f} {r['first_check_s']:>14.3f} {theirs:>20}")
    print(json.dumps({"bench": "grammar_tokenizer", "vocab": args.vocab, "results": results}))


if __name__ == "__main__":
    main()

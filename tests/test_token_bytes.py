"""Each token's bytes as its tokenizer's decoder writes them, for the tokenizer shapes real checkpoints ship: the
table llguidance masks by, so a grammar's allowed tokens write exactly what the API returns."""

from __future__ import annotations

import json

import llguidance
import pytest
import tokenizers
from factories import sentencepiece_tokenizer_json

from amoe.errors import RequestError, UnsupportedTokenizerError
from amoe.structured import Grammars, compile_grammar
from amoe.token_bytes import ByteVocabulary
from amoe.tokenizer import write_tokenizer

VOCAB = 1024  # the tiny model's ids: more than any of these tokenizers has
EOS = 2  # </s> in every shape here
# Spaces (leading, doubled, tab, newline), non-ASCII characters, and ones outside every small vocabulary (bytes).
TEXTS = [
    "The lighthouse keeper climbed the steps.",
    "  two leading spaces,  doubled\tand\nnew lines\n",
    "Café → naïve, 東京 🙂 123,456.7",
    '{"name": "ada", "year": 1815}',
]
SHAPES = ["byte-level", "sentencepiece-prepend", "sentencepiece-metaspace", "metaspace-decoder"]
# The shapes whose decoder writes every byte (byte-level alphabet, <0xNN> byte fallback): any text round-trips.
WRITES_ANY_TEXT = SHAPES[:3]


@pytest.fixture(scope="module")
def shape_json(tmp_path_factory) -> dict[str, str]:
    """tokenizer.json of each shape: amoe's own byte-level BPE (OLMoE / Qwen / DeepSeek style) and sentencepiece
    BPE with byte fallback laid out as Mixtral ships it, decoded by Replace + ByteFallback (with a Prepend
    normalizer or a Metaspace pre-tokenizer) or by Metaspace."""
    out = tmp_path_factory.mktemp("byte-level")
    write_tokenizer(out, VOCAB)
    return {
        "byte-level": (out / "tokenizer.json").read_text(encoding="utf-8"),
        "sentencepiece-prepend": sentencepiece_tokenizer_json("prepend"),
        "sentencepiece-metaspace": sentencepiece_tokenizer_json("metaspace"),
        "metaspace-decoder": sentencepiece_tokenizer_json("metaspace-decoder"),
    }


def _continuation(backend: tokenizers.Tokenizer, ids: list[int]) -> str:
    """The tokenizer's own decode of `ids` following other text (a decoder strips a first token's space)."""
    before = backend.encode("The", add_special_tokens=True).ids
    return backend.decode(before + ids)[len(backend.decode(before)) :]


@pytest.mark.parametrize("shape", SHAPES)
def test_token_bytes_concatenate_to_the_tokenizers_own_decode(shape_json, shape):
    backend = tokenizers.Tokenizer.from_str(shape_json[shape])
    vocabulary = ByteVocabulary(shape_json[shape], VOCAB)
    for text in TEXTS:
        ids = backend.encode(text, add_special_tokens=False).ids
        written = b"".join(vocabulary.tokens[i] for i in ids)
        assert written.decode("utf-8") == _continuation(backend, ids), (shape, text)


@pytest.mark.parametrize("shape", WRITES_ANY_TEXT)
def test_continuing_encoder_writes_the_text_itself(shape_json, shape, monkeypatch):
    """No prefix space, no special tokens: what llguidance tokenizes is text inside an output, not a prompt;
    the tokenizer's own ids write it (no greedy fallback needed)."""
    vocabulary = ByteVocabulary(shape_json[shape], VOCAB)
    monkeypatch.setattr(vocabulary, "_greedy", lambda data: pytest.fail(f"fell back to greedy on {data!r}"))
    for text in TEXTS:
        assert b"".join(vocabulary.tokens[i] for i in vocabulary.encode(text)) == text.encode(), text


def test_metaspace_decoder_writes_byte_pieces_as_they_read(shape_json):
    """Its <0xNN> pieces decode as six characters: the table says so, and the encoder writes a character no
    piece spells with the tokens that write its bytes, leaving out what none writes."""
    backend = tokenizers.Tokenizer.from_str(shape_json["metaspace-decoder"])
    vocabulary = ByteVocabulary(shape_json["metaspace-decoder"], VOCAB)
    assert vocabulary.tokens[backend.token_to_id("<0xC3>")] == b"<0xC3>"
    assert vocabulary.tokens[backend.token_to_id("▁the")] == b" the"
    ids = vocabulary.encode("the 🙂 end <0x41>")
    assert b"".join(vocabulary.tokens[i] for i in ids) == b"the  end <0x41>"


@pytest.mark.parametrize("shape", WRITES_ANY_TEXT)
def test_llguidance_reads_the_same_bytes_where_it_reads_the_shape(shape_json, shape):
    """llguidance's own tokenizer.json reader knows ByteLevel and ByteFallback decoders: it agrees token for
    token (but for a 0xFF byte, its special-token marker, which its decode leaves out)."""
    vocabulary = ByteVocabulary(shape_json[shape], VOCAB)
    theirs = llguidance.LLTokenizer(shape_json[shape], n_vocab=VOCAB, eos_token=EOS)
    size = tokenizers.Tokenizer.from_str(shape_json[shape]).get_vocab_size(with_added_tokens=True)
    special = set(vocabulary.special_ids)
    ours = [i for i in range(size) if i not in special and vocabulary.tokens[i] != b"\xff"]
    assert len(ours) > size - 10
    assert [theirs.decode_bytes([i]) for i in ours] == [vocabulary.tokens[i] for i in ours]
    assert all(theirs.is_special_token(i) for i in special)


@pytest.mark.parametrize("shape", SHAPES)
def test_grammar_of_one_choice_takes_the_tokenizers_own_ids(shape_json, shape):
    """A choice of one text: its mask allows each of the text's own tokens in turn, and after the last the
    grammar is complete; special tokens are never text."""
    backend = tokenizers.Tokenizer.from_str(shape_json[shape])
    grammars = Grammars(shape_json[shape], VOCAB, (EOS,))
    texts = (
        TEXTS
        if shape in WRITES_ANY_TEXT
        else [_continuation(backend, backend.encode(TEXTS[0], add_special_tokens=False).ids)]
    )
    for text in texts:
        ids = ByteVocabulary(shape_json[shape], VOCAB).encode(text)
        state = grammars.matcher(compile_grammar(choice=[text]))
        for token in ids:
            allowed = state.allowed()
            assert allowed[token] and not allowed[[0, 1, EOS]].any(), (text, token)
            state.accept(token)
        assert state.is_done


@pytest.mark.parametrize("shape", SHAPES)
def test_every_format_checks_and_masks_on_each_shape(shape_json, shape):
    grammars = Grammars(shape_json[shape], VOCAB, (EOS,))
    formats = [
        {"json_object": True},
        {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
        {"regex": "[a-z]+ [0-9]{2}"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "x" [0-9]'},
    ]
    for spec in formats:
        grammar = compile_grammar(**spec, param="structured_outputs")
        grammars.check(grammar, "structured_outputs")
        assert grammars.matcher(grammar).allowed().any(), spec


def _with_decoder(tokenizer_json: str, decoder) -> str:
    spec = json.loads(tokenizer_json)
    spec["decoder"] = decoder
    return json.dumps(spec)


@pytest.mark.parametrize(
    ("decoder", "reason"),
    [
        ({"type": "WordPiece", "prefix": "##", "cleanup": True}, "WordPiece decoder"),
        ({"type": "BPEDecoder", "suffix": "</w>"}, "BPEDecoder decoder"),
        (None, "no decoder"),
        (
            {"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "},
            "replaces by a regex",
        ),
    ],
    ids=["wordpiece", "bpe-suffix", "none", "regex-replace"],
)
def test_a_decoder_without_token_bytes_is_a_typed_error_and_a_400(shape_json, decoder, reason):
    """The bytes of a token such a decoder writes depend on its neighbours: structured output is unavailable,
    said in the request's own parameter (the API's 400), never a server error."""
    tokenizer_json = _with_decoder(shape_json["sentencepiece-metaspace"], decoder)
    with pytest.raises(UnsupportedTokenizerError, match=reason):
        ByteVocabulary(tokenizer_json, VOCAB)
    grammars = Grammars(tokenizer_json, VOCAB, (EOS,))
    for param in ("response_format", "guided_regex"):  # the same reason each time, built once
        with pytest.raises(
            RequestError, match=f"structured output is unavailable for this model: .*{reason}"
        ) as err:
            grammars.check(compile_grammar(regex="[0-9]+"), param)
        assert err.value.param == param


def test_a_model_without_tokenizer_json_says_so(tmp_path):
    grammars = Grammars.for_model(tmp_path, VOCAB, (EOS,))
    with pytest.raises(RequestError, match="has no tokenizer.json") as err:
        grammars.check(compile_grammar(json_object=True), "response_format")
    assert err.value.param == "response_format"


def test_text_no_token_writes_ends_the_output_with_a_warning(shape_json, caplog):
    """A Metaspace decoder has no piece for 🙂 (its byte pieces write "<0xF0>"): once the grammar needs it,
    llguidance allows only the end, as in vLLM, and the rank says why the output stops short."""
    vocabulary = ByteVocabulary(shape_json["metaspace-decoder"], VOCAB)
    state = Grammars(shape_json["metaspace-decoder"], VOCAB, (EOS,)).matcher(
        compile_grammar(choice=["ok 🙂"])
    )
    written = b""
    for _ in range(8):
        allowed = state.allowed().nonzero()[0].tolist()
        if allowed == [EOS]:
            break
        written += vocabulary.tokens[allowed[0]]
        state.accept(allowed[0])
    assert (written, allowed) == (b"ok ", [EOS])
    assert "the output ends short of its grammar" in caplog.text
    state.accept(EOS)
    assert state.is_done

"""Plain helpers shared by tests (fixtures live in conftest.py): prompts and the reference engine's tokens."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import torch

from amoe.config import AmoeConfig
from amoe.testing.servers import ServerProcess


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 1024) -> list[list[int]]:
    """Token-id prompts of the given lengths, each starting with BOS (id 1)."""
    gen = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in lengths]


def reference_tokens(checkpoint: Path, prompts: list[list[int]], params) -> list[list[int]]:
    """What the single-process reference engine generates for each prompt, all batched together."""
    from amoe.engine.config import EngineConfig
    from amoe.engine.local import LocalEngine

    engine = LocalEngine(checkpoint, EngineConfig())
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, params)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in range(len(prompts))]


def transformers_checkpoint(preset_name: str, out_dir: Path, seed: int = 0, packed: bool = False) -> Path:
    """A random-weight checkpoint of a family preset, built by transformers itself: its config class, its model,
    its save_pretrained (one tensor per expert) — or, `packed`, its in-memory state dict (experts packed as
    `mlp.experts.gate_up_proj` / `down_proj`). Weights are seeded like amoe's (norms near 1, a correction bias
    that changes the routing), plus amoe's tokenizer and generation config."""
    import json

    import transformers
    from safetensors.torch import save_file

    from amoe.model.checkpoint import _random_tensor
    from amoe.model.presets import preset
    from amoe.tokenizer import write_tokenizer

    hf = preset(preset_name)
    config_class = transformers.AutoConfig.for_model(hf["model_type"]).__class__
    config = config_class(**{k: v for k, v in hf.items() if k not in ("model_type", "dtype")})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "rotary_emb" not in name:
                tensor.copy_(_random_tensor(name, tuple(tensor.shape), config.initializer_range, gen))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    if packed:
        for old in out_dir.glob("*.safetensors*"):
            old.unlink()
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()}, str(out_dir / "model.safetensors")
        )
    write_tokenizer(out_dir, hf["vocab_size"], model_max_length=hf["max_position_embeddings"])
    generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return out_dir


# ---- log-probabilities against transformers (float32 log-softmax of its logits, teacher-forced)

LOGPROB_TOL = 1e-4


def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy output for `prompt`, and its log-softmax rows [len(prompt) + max_tokens - 1, V]: row i
    scores the token after position i of prompt + output."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        logits = model(torch.tensor([tokens[:-1]])).logits[0]
    return tokens[len(prompt) :], torch.log_softmax(logits.float(), dim=-1)


def check_logprobs(ref: torch.Tensor, tokens: list[int], logprobs, first: int, k: int) -> None:
    """`logprobs` (amoe.logprobs.Logprobs) of tokens[first:] against transformers' rows (ref[i] scores tokens[i+1]):
    values within LOGPROB_TOL, ranks and the top k exactly transformers'."""
    assert logprobs.token_ids == tokens[first:]
    for i, token in enumerate(tokens[first:]):
        row = ref[first - 1 + i]
        assert abs(logprobs.logprobs[i] - float(row[token])) < LOGPROB_TOL, (i, token)
        assert logprobs.ranks[i] == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        assert logprobs.top_ids[i] == top.indices.tolist()
        assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(logprobs.top_logprobs[i], top.values.tolist()))


def check_echo_choice(ref: torch.Tensor, tokens: list[int], choice: dict, k: int) -> None:
    """A completions choice of `echo` + `logprobs: k` over token-id prompt + greedy output `tokens`: each token's
    log-probability (null for the first) and its top k as transformers gives them."""
    lp = choice["logprobs"]
    assert (
        len(lp["tokens"]) == len(tokens) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    )
    for i, token in enumerate(tokens[1:]):
        row = ref[i]
        assert abs(lp["token_logprobs"][i + 1] - float(row[token])) < LOGPROB_TOL, i
        # The token's own and the top k, keyed by text: ids that decode alike (lone bytes: U+FFFD) share a key.
        allowed = [float(row[token]), *row.topk(k).values.tolist()]
        values = lp["top_logprobs"][i + 1].values()
        assert values and all(any(abs(v - a) < LOGPROB_TOL for a in allowed) for v in values), i
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0


class AliveProcess:
    """A runtime process as the cluster manager polls and kills it (for tests that drive the manager by hand)."""

    pid = 4242

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9


def config_of(*flags: str) -> AmoeConfig:
    """The config `amoe serve FLAGS` serves, by the real command line's parser: for tests whose settings read best
    as the flags a user types (the server then gets the config, as every ServerProcess does)."""
    from amoe.cli import build_parser
    from amoe.config import config_from_args

    return config_from_args(build_parser().parse_args(["serve", *flags]))


class CheckedServer(ServerProcess):
    """`with CheckedServer(*flags) as url:` serves the config of `amoe serve FLAGS` (config_of) for the block;
    leaving it, the server must drain on SIGINT and exit 0."""

    def __init__(self, *flags: str) -> None:
        super().__init__(config_of(*flags), startup_timeout_s=90, env={"AMOE_LOG_LEVEL": "INFO"})

    def __exit__(self, *exc: object) -> None:
        code = self.stop(timeout_s=30)
        assert code == 0, "\n".join(self.lines)


class CharTokenizer:
    """A tokenizer double: each character is its code point, 1 is BOS; a chat is its messages' contents, each after
    `<role>` when `roles`."""

    def __init__(self, roles: bool = True) -> None:
        self.roles = roles

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def encode_chat(self, messages, add_generation_prompt=True, tools=None):
        parts = [f"<{m['role']}>{m['content']}" if self.roles else m["content"] for m in messages]
        if tools is not None:  # the tools' names lead, as a chat template lists them
            parts.insert(0, "<tools>" + ",".join(t["function"]["name"] for t in tools))
        return self.encode("".join(parts), add_special_tokens=False)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class CharDetokenizer:
    """Token id i is chr(i): one character per token, nothing held back; `fail_on`: a detokenizer bug raised at
    that character."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.fail_on = fail_on

    def add(self, token_id: int) -> str:
        if chr(token_id) == self.fail_on:
            raise RuntimeError("detokenizer bug")
        return chr(token_id)

    def flush(self) -> str:
        return ""


@contextlib.contextmanager
def server_in_thread(config, start_timeout_s: float = 90.0):
    """`amoe serve` of `config` on a thread of this process (its own event loop), until the block ends."""
    import asyncio

    from amoe.serve import AmoeServer

    srv = AmoeServer(config)
    thread = threading.Thread(target=asyncio.run, args=(srv.run(),), name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not srv.started.wait(0.1):
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
    try:
        yield srv
    finally:
        srv.request_exit()
        thread.join(30)


# ---- streams of several choices, as a client assembles them


def streamed_choices(events: list[dict]) -> dict[int, list[dict]]:
    """The chunks of an SSE stream's choices by index (`events`: its data payloads in order, [DONE] left out),
    checked for what a client that assembles choices by index relies on. OpenAI and vLLM interleave choices in
    no promised order; what they do promise: a choice's finish_reason comes once, on its last chunk, and the usage
    chunk, if any, comes last, after every choice has finished."""
    chunks: dict[int, list[dict]] = {}
    for at, payload in enumerate(events):
        if not payload["choices"]:
            assert payload.get("usage") and at == len(events) - 1, "usage comes once, last"
            continue
        (choice,) = payload["choices"]
        mine = chunks.setdefault(choice["index"], [])
        assert not (mine and mine[-1]["finish_reason"]), f"choice {choice['index']} went on after its finish"
        mine.append(choice)
    unfinished = [index for index, mine in chunks.items() if not mine[-1]["finish_reason"]]
    assert not unfinished, f"choices {unfinished} never finished"
    return chunks


def sentencepiece_tokenizer_json(style: str) -> str:
    """A small sentencepiece-like BPE with byte fallback (<unk> <s> </s>, <0x00>..<0xFF>, then ~340 pieces),
    laid out as Mixtral's tokenizer.json: `prepend` (a Prepend normalizer, Mixtral-8x7B) and `metaspace` (a
    Metaspace pre-tokenizer, later Mistral releases) decode with Replace + ByteFallback + Fuse + Strip;
    `metaspace-decoder` decodes with Metaspace, as `tokenizers` converts a sentencepiece model (its <0xNN> pieces
    then decode as written)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    from amoe.tokenizer import _corpus

    trained = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=70, show_progress=False
    )
    trained.train_from_iterator(_corpus().splitlines(), trainer)
    spec = json.loads(trained.to_str())
    # Mixtral's id layout: <unk> <s> </s>, then <0x00>..<0xFF>, then the pieces.
    pieces = sorted((i, p) for p, i in spec["model"]["vocab"].items() if i >= 3)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab.update({p: len(vocab) + n for n, (_, p) in enumerate(pieces)})
    spec["model"]["vocab"] = vocab
    if style == "prepend":  # Mixtral-8x7B (tokenizers 0.15 era)
        spec["normalizer"] = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        }
        spec["pre_tokenizer"] = None
    else:  # later Mistral releases, and as `tokenizers` converts sentencepiece
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {
            "type": "Metaspace",
            "replacement": "▁",
            "prepend_scheme": "first",
            "split": False,
        }
    if style == "metaspace-decoder":
        spec["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    else:
        spec["decoder"] = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        }
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    return json.dumps(spec, ensure_ascii=False)

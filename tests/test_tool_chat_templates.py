"""Prompts with tools tokenize exactly as transformers' `apply_chat_template(..., tools=...)` renders them, for each
family's chat template (tests/data/chat_templates/SOURCES.md says where each comes from) and amoe's own; and each
family's parser reads back the calls its template writes.

A chat request goes through the API's real preparation (coordinator/api/validation.py) on a tokenizer with the
family's special tokens; transformers (AutoTokenizer from the same files) gets the conversation as vLLM hands it to
the template (vllm/entrypoints/chat_utils.py: text content, "" for none; tool-call arguments parsed from their JSON
strings) and the tools as the client sent them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken

from amoe.tokenizer import Tokenizer, write_tokenizer
from amoe.tool_calls.output import ToolCallOutput, ToolCallPlan
from coordinator.api.protocol import ChatCompletionRequest
from coordinator.api.tools import ToolServing
from coordinator.api.validation import ModelInfo, prepare_chat

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

# (special tokens, other added tokens, tokenizer_config's named tokens, template, tool-call parser)
FAMILIES = {
    "qwen3": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"),
        "hermes",
    ),
    "deepseek_v3": (
        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
        [
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ],
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
        (TEMPLATES / "deepseek_v3.jinja").read_text(encoding="utf-8"),
        "deepseek_v3",
    ),  # fmt: skip
    "mistral_v3": (
        [
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        [],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        (TEMPLATES / "mistral_v3.jinja").read_text(encoding="utf-8"),
        "mistral",
    ),  # fmt: skip
    "amoe": ([], [], {}, None, "mistral"),  # write_tokenizer's own: <unk> <s> </s> and amoe's template
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_temperature",
            # Members in an unusual order, non-ASCII text: the template gets the tools exactly as sent.
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The location, e.g. « San Francisco, CA »"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "°C or °F"},
                },
                "required": ["location"],
            },
            "description": "Get current temperature at a location.",
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_temperature_date",
            "description": "Get temperature at a location and date.",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}, "date": {"type": "string"}},
                "required": ["location", "date"],
            },
        },
    },
]
# The conversation of Qwen's function-calling guide: a question, two calls, their results, the answer, a follow-up.
CALLS = [
    {"id": "call0abcd", "type": "function",
     "function": {"name": "get_current_temperature", "arguments": '{"location": "San Francisco, CA, USA"}'}},
    {"id": "call1efgh", "type": "function",
     "function": {"name": "get_temperature_date",
                  "arguments": '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'}},
]  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."},
    {"role": "user", "content": "What's the temperature in San Francisco now? How about tomorrow?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call0abcd",
     "content": '{"temperature": 26.1, "location": "San Francisco, CA, USA", "unit": "celsius"}'},
    {"role": "tool", "tool_call_id": "call1efgh",
     "content": '{"temperature": 25.9, "location": "San Francisco, CA, USA", "date": "2024-10-01"}'},
    {"role": "assistant", "content": "It is 26.1 °C now and 25.9 °C tomorrow."},
    {"role": "user", "content": "And in Paris?"},
]  # fmt: skip
CONVERSATIONS = {
    "first turn": MESSAGES[:2],
    "calls and results": MESSAGES[:5],
    "after the answer": MESSAGES,
}


def family_dir(root: Path, family: str, tool_use_only: bool = False) -> Path:
    """A tokenizer with the family's special and added tokens, its named tokens and its chat template (or, with
    `tool_use_only`, a plain default template and the family's as the named "tool_use" one)."""
    specials, added, named, template, _ = FAMILIES[family]
    out = root / (family + ("-tool-use" if tool_use_only else ""))
    if out.exists():
        return out
    write_tokenizer(out, vocab_size=600)
    if family == "amoe":
        return out
    backend = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    backend.add_special_tokens(specials)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    backend.post_processor = None  # these templates write every special token the prompt has
    backend.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "unk_token", "add_bos_token"):
        config.pop(key, None)
    config.update({k: v for k, v in named.items() if v is not None})
    if tool_use_only:
        plain = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        config["chat_template"] = [
            {"name": "default", "template": plain},
            {"name": "tool_use", "template": template},
        ]
    else:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return out


def as_vllm_hands_it(messages: list[dict]) -> list[dict]:
    """The conversation vLLM renders: content as text ("" for none), tool-call arguments parsed into objects."""
    out = []
    for m in copy.deepcopy(messages):
        m["content"] = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(m)
    return out


def served_prompt(model_dir: Path, messages: list[dict], parser: str, **extra) -> list[int]:
    """The prompt ids the API prepares for a chat request with TOOLS."""
    tokenizer = Tokenizer.from_dir(model_dir)
    body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 1, **extra}
    info = ModelInfo("m", 4096, tokenizer.vocab_size, tools=ToolServing(parser, auto=True))
    return prepare_chat(ChatCompletionRequest(**body), tokenizer, info, 1).prompt_token_ids


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_with_tools_tokenize_as_transformers_renders_them(tmp_path_factory, family, conversation):
    model_dir = family_dir(tmp_path_factory.getbasetemp(), family)
    messages = CONVERSATIONS[conversation]
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    reference = as_vllm_hands_it(messages)
    text = hf.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ids = hf.apply_chat_template(
        reference, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert "get_current_temperature" in text  # the template rendered the tools
    assert Tokenizer.from_dir(model_dir).apply_chat_template(reference, tools=TOOLS) == text
    assert served_prompt(model_dir, messages, FAMILIES[family][4]) == ids
    # The prompt does not depend on how the output may call tools, nor on tool_choice "none".
    assert served_prompt(model_dir, messages, FAMILIES[family][4], tool_choice="none") == ids


def test_the_tool_use_template_renders_when_tools_are_given(tmp_path_factory):
    model_dir = family_dir(tmp_path_factory.getbasetemp(), "qwen3", tool_use_only=True)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    reference = as_vllm_hands_it(MESSAGES[:2])
    ids = hf.apply_chat_template(
        reference, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert served_prompt(model_dir, MESSAGES[:2], "hermes") == ids
    plain = Tokenizer.from_dir(model_dir).apply_chat_template(reference)
    assert plain == hf.apply_chat_template(reference, add_generation_prompt=True, tokenize=False)
    assert plain.startswith("system: ")


# The assistant's turn as each template writes it (between these markers in the rendered conversation), and the
# content before its calls (whitespace aside): Qwen3's (empty) thinking, which is content to a server without a
# reasoning parser.
TURNS = {
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>", "<think>\n\n</think>"),
    "deepseek_v3": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>", ""),
    "mistral_v3": ("[/INST]", "</s>", ""),
    "amoe": ("[/INST]", "</s>", ""),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_parser_reads_back_the_calls_its_template_writes(tmp_path_factory, family):
    """The calls in the history, rendered by the family's template, are what its model writes: the server's
    parser for that family reads them back as the same calls."""
    model_dir = family_dir(tmp_path_factory.getbasetemp(), family)
    tokenizer = Tokenizer.from_dir(model_dir)
    text = tokenizer.apply_chat_template(
        as_vllm_hands_it(MESSAGES[:3]), tools=TOOLS, add_generation_prompt=False
    )
    start, end, content = TURNS[family]
    turn = text[text.index(start) + len(start) :]
    turn = turn[: turn.index(end)] if end in turn else turn
    names = frozenset(t["function"]["name"] for t in TOOLS)
    output = ToolCallOutput(ToolCallPlan("auto", names, parser=FAMILIES[family][4]))
    output.feed(turn)
    output.finish()
    assert output.content.strip() == content
    expected = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS]
    assert [(c.name, json.loads(c.arguments)) for c in output.calls] == expected

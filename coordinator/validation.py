"""From a parsed OpenAI request to what the backend runs: prompt token ids, sampling params, stop strings."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from amoe.errors import RequestError
from amoe.sampling_params import SamplingParams
from coordinator.openai_errors import ApiError, bad_request
from coordinator.protocol import ChatCompletionRequest, CompletionRequest
from coordinator.sampling_options import sampling_options

DEFAULT_COMPLETION_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
)

# Parameters OpenAI or vLLM accept that amoe does not implement, each with the values that ask for nothing (what
# SDKs and benchmark clients send by default, e.g. `vllm bench serve` sends use_beam_search false): those are
# accepted, anything else is refused with a 400 naming the parameter. Never accepted and ignored. (The sampling
# options amoe implements are typed fields of coordinator/protocol.py, read by coordinator/sampling_options.py.)
UNSUPPORTED: dict[str, tuple] = {
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "length_penalty": (None, 1, 1.0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
}


class Tokenizer(Protocol):
    """Prompt token ids as the checkpoint's own tokenizer gives them (amoe.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class ModelInfo:
    """What the API layer needs to know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    grammars: Any = None  # amoe.structured.Grammars of the served tokenizer (None: no structured output)


@dataclass(frozen=True)
class PreparedRequest:
    request_id: int  # the one id of the request from here to the runtimes' wire (unique per server)
    response_id: str  # what the client sees as the response's "id" (OpenAI style: "cmpl-...", "chatcmpl-...")
    prompt_token_ids: list[int]
    max_tokens: int
    sampling_params: Any  # amoe.sampling_params.SamplingParams
    stop: list[str]


def prepare_completion(
    req: CompletionRequest, tokenizer: Tokenizer, model: ModelInfo, request_id: int
) -> PreparedRequest:
    _check_common(req, model)
    prompt_ids = _completion_prompt_ids(req.prompt, tokenizer, model)
    return _prepare(
        req, request_id, "cmpl", prompt_ids, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, model, tokenizer
    )


def prepare_chat(
    req: ChatCompletionRequest, tokenizer: Tokenizer, model: ModelInfo, request_id: int
) -> PreparedRequest:
    _check_common(req, model)
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    for m in messages:
        _check_text(m["content"], "messages")
    try:
        prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    except Exception as exc:  # a checkpoint's template may reject e.g. a system message
        raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return _prepare(req, request_id, "chatcmpl", prompt_ids, max_tokens, None, model, tokenizer, param)


def _check_common(req: CompletionRequest | ChatCompletionRequest, model: ModelInfo) -> None:
    if req.model != model.name:
        raise ApiError(
            404,
            f"The model '{req.model}' does not exist (serving '{model.name}')",
            param="model",
            code="model_not_found",
        )
    _check_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")


def _check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    for name, value in (req.model_extra or {}).items():
        noops = UNSUPPORTED.get(name)
        if noops is not None and not any(_same(value, noop) for noop in noops):
            raise bad_request(f"'{name}' is not supported by amoe (only its default, {noops[-1]!r})", name)


def _same(value: Any, noop: Any) -> bool:
    """Equal, with booleans and null only equal to themselves: in Python 0 == False, but "logprobs": 0 asks for
    something "logprobs": false does not."""
    if isinstance(value, bool) or isinstance(noop, bool) or value is None or noop is None:
        return value is noop
    return value == noop


def _completion_prompt_ids(prompt: Any, tokenizer: Tokenizer, model: ModelInfo) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_text(prompt, "prompt")
        return tokenizer.encode(prompt)  # with the special tokens the checkpoint's tokenizer adds
    if not prompt:
        raise bad_request("'prompt' must not be empty", "prompt")
    bad = next((t for t in prompt if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"'prompt' holds token id {bad}, outside the vocabulary [0, {model.vocab_size})", "prompt"
        )
    return list(prompt)


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"'{param}' is not valid UTF-8 (it contains a lone surrogate)", param) from None


def _prepare(
    req: CompletionRequest | ChatCompletionRequest,
    request_id: int,
    kind: str,
    prompt_ids: list[int],
    max_tokens: int | None,
    default_max_tokens: int | None,
    model: ModelInfo,
    tokenizer: Tokenizer,
    max_tokens_param: str = "max_tokens",
) -> PreparedRequest:
    room = model.max_model_len - len(prompt_ids)
    if room <= 0:
        raise bad_request(
            f"the prompt is {len(prompt_ids)} tokens but the model's context length is {model.max_model_len}",
            "prompt" if kind == "cmpl" else "messages",
        )
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens <= 0:
        raise bad_request(f"'{max_tokens_param}' must be at least 1; got {max_tokens}", max_tokens_param)
    elif max_tokens > room:
        raise bad_request(
            f"'{max_tokens_param}' is {max_tokens} but the prompt ({len(prompt_ids)} tokens) leaves room for only "
            f"{room} in the model's context length of {model.max_model_len}",
            max_tokens_param,
        )
    stop = _stop_strings(req.stop)
    return PreparedRequest(
        request_id=request_id,
        response_id=f"{kind}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling_params=_sampling_params(req, max_tokens, stop, model, tokenizer),
        stop=stop,
    )


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    for s in stops:
        _check_text(s, "stop")
    return stops


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    stop: list[str],
    model: ModelInfo,
    tokenizer: Tokenizer,
) -> Any:
    stop_ids = req.stop_token_ids or []
    bad = next((t for t in stop_ids if t >= model.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"'stop_token_ids' holds token id {bad}, outside the vocabulary [0, {model.vocab_size})",
            "stop_token_ids",
        )
    given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed}
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            **{name: value for name, value in given.items() if value is not None},
            **sampling_options(req, tokenizer, model.vocab_size, model.grammars),
        )
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None

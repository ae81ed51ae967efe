"""From a parsed OpenAI request to what the backend runs: prompt token ids, sampling params, stop strings."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from amoe.errors import RequestError
from amoe.logprobs import MAX_LOGPROBS
from amoe.sampling_params import SamplingParams
from amoe.structured import compile_grammar
from coordinator.api.openai_errors import ApiError, bad_request
from coordinator.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from coordinator.api.sampling_options import sampling_options
from coordinator.api.tools import ToolServing, chat_tools, conversation
from coordinator.requests.prepared import PreparedRequest

DEFAULT_COMPLETION_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
)
# Prompts one completions request may carry (each runs as a request of its own); evaluation harnesses batch a
# few dozen.
MAX_PROMPTS = 256

# Parameters OpenAI or vLLM accept that amoe does not implement, each with the values that ask for nothing (what
# SDKs and benchmark clients send by default, e.g. `vllm bench serve` sends use_beam_search false): those are
# accepted, anything else is refused with a 400 naming the parameter. Never accepted and ignored. (The sampling
# options amoe implements are typed fields of coordinator/api/protocol.py, read by coordinator/api/sampling_options.py.)
UNSUPPORTED: dict[str, tuple] = {
    "echo": (None, False),  # chat's (repeat the last message); completions declare theirs
    "logprob_token_ids": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "length_penalty": (None, 1, 1.0),
    "tools": (None, []),  # completions' (chat serves tools: coordinator/api/tools.py)
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


class ApiTokenizer(Protocol):
    """Prompt token ids as the checkpoint's own tokenizer gives them (amoe.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ModelInfo:
    """What the API layer needs to know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    grammars: Any = None  # amoe.structured.Grammars of the served tokenizer (None: no structured output)
    # --generation-config's defaults (amoe.generation_config): what a request leaves unset; max_tokens also caps
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    tools: ToolServing = ToolServing()  # the server's tool-call parser and whether `auto` may use it
    eos_token_ids: frozenset[int] = (
        frozenset()
    )  # the model's: sampling one ends a request (unless ignore_eos)


def prepare_completions(
    req: CompletionRequest, tokenizer: ApiTokenizer, model: ModelInfo, next_id: Callable[[], int]
) -> list[PreparedRequest]:
    """One prepared request per prompt of `prompt` (a string, token ids, or a list of either), in order, sharing
    the response's id; `next_id()` gives each its request id."""
    _check_common(req, model)
    _check_logprobs(req.logprobs, "logprobs")
    _check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs  # as vLLM: echoed prompt tokens are scored like the output's
    # echo with max_tokens 0: one token runs (its prefill scores the prompt) and is not shown, as in vLLM.
    echo_only = bool(req.echo) and req.max_tokens == 0
    max_tokens = 1 if echo_only else req.max_tokens
    response_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = _completion_prompts(req.prompt, tokenizer, model)
    options = _options(req, tokenizer, model, (req.logprobs, prompt_logprobs))  # once: the prompts share them
    prepared = []
    for index, (prompt_ids, text) in enumerate(prompts):
        if req.echo and text is None:
            text = tokenizer.decode(prompt_ids)
        prepared.append(
            _prepare(
                req, next_id(), "cmpl", prompt_ids, max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, model, options,
                response_id=response_id, prompt_index=index, echo=bool(req.echo), echo_only=echo_only,
                prompt_text=text or "",
            )
        )  # fmt: skip
    return prepared


def prepare_completion(
    req: CompletionRequest, tokenizer: ApiTokenizer, model: ModelInfo, request_id: int
) -> PreparedRequest:
    """The request of a one-prompt completions body."""
    prepared = prepare_completions(req, tokenizer, model, iter([request_id]).__next__)
    return prepared[0]


def prepare_chat(
    req: ChatCompletionRequest, tokenizer: ApiTokenizer, model: ModelInfo, request_id: int
) -> PreparedRequest:
    _check_common(req, model)
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", "messages")
    tools = chat_tools(req, model.tools)
    prompt_ids = encode_conversation(tokenizer, req.messages, tools.template_tools)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    options = _options(req, tokenizer, model, _chat_logprobs(req))
    if tools.schema is not None:
        if "grammar" in options:
            raise bad_request(
                "You can only either use constraints for structured outputs or tools, not both.",
                "tool_choice",
            )
        options["grammar"] = _tool_grammar(tools.schema, model)
    if tools.keep_special_tokens and req.skip_special_tokens is None:
        options["skip_special_tokens"] = False  # the parser reads its markers in the text
    return _prepare(
        req, request_id, "chatcmpl", prompt_ids, max_tokens, None, model, options, param, tool_plan=tools.plan
    )


def encode_conversation(
    tokenizer: ApiTokenizer,
    messages: list[ChatMessage],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The conversation's prompt ids, rendered by the model's chat template (with `tools` when given)."""
    conv = conversation(messages)
    for m in conv:
        check_text(m["content"], "messages")
    extra = {} if tools is None else {"tools": tools}
    try:
        return tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:  # a checkpoint's template may reject e.g. a system message
        raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from None


def _tool_grammar(schema: dict, model: ModelInfo) -> str:
    """The grammar forcing a tool choice's JSON (a tool's bad schema is the client's 400, naming `tools`)."""
    try:
        grammar = compile_grammar(json_schema=schema, param="tools")
        if model.grammars is None:
            raise RequestError("structured output is unavailable for this model", "tool_choice")
        model.grammars.check(grammar, "tools")
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    return grammar


def _chat_logprobs(req: ChatCompletionRequest) -> tuple[int | None, int | None]:
    """(top log-probabilities per output token or None, per prompt token or None), as OpenAI and vLLM check them."""
    _check_logprobs(req.top_logprobs, "top_logprobs")
    _check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("when using 'top_logprobs', 'logprobs' must be set to true", "top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None, req.prompt_logprobs


def _check_logprobs(value: int | None, param: str) -> None:
    if value is None:
        return
    if value < 0:
        raise bad_request(
            f"'{param}' must be an integer in [0, {MAX_LOGPROBS}]; got {value} (-1, the whole vocabulary, is not "
            "supported)",
            param,
        )
    if value > MAX_LOGPROBS:
        raise bad_request(
            f"'{param}' is {value}, more than the {MAX_LOGPROBS} most likely tokens amoe returns per position "
            f"(vLLM's default --max-logprobs)",
            param,
        )


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


def _completion_prompts(
    prompt: Any, tokenizer: ApiTokenizer, model: ModelInfo
) -> list[tuple[list[int], str | None]]:
    """Each prompt's token ids, and its text if it came as text."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request; got {len(prompt)}", "prompt")
        return [_completion_prompt(p, tokenizer, model) for p in prompt]
    return [_completion_prompt(prompt, tokenizer, model)]


def _completion_prompt(
    prompt: Any, tokenizer: ApiTokenizer, model: ModelInfo
) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        return tokenizer.encode(prompt), prompt  # with the special tokens the checkpoint's tokenizer adds
    if not prompt:
        raise bad_request("'prompt' must not be empty", "prompt")
    bad = next((t for t in prompt if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"'prompt' holds token id {bad}, outside the vocabulary [0, {model.vocab_size})", "prompt"
        )
    return list(prompt), None


def check_text(text: str, param: str) -> None:
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
    options: dict[str, Any],
    max_tokens_param: str = "max_tokens",
    *,
    response_id: str | None = None,
    **extra: Any,
) -> PreparedRequest:
    room = model.max_model_len - len(prompt_ids)
    if room <= 0:
        raise bad_request(
            f"the prompt is {len(prompt_ids)} tokens but the model's context length is {model.max_model_len}",
            "prompt" if kind == "cmpl" else "messages",
        )
    cap = model.sampling_defaults.get(
        "max_tokens"
    )  # the generation config's max_new_tokens, as vLLM caps with it
    if max_tokens is None:
        max_tokens = min(v for v in (default_max_tokens, room, cap) if v is not None)
    elif max_tokens <= 0:
        raise bad_request(
            f"'{max_tokens_param}' must be at least 1 (0 only with 'echo'); got {max_tokens}",
            max_tokens_param,
        )
    elif max_tokens > room:
        raise bad_request(
            f"'{max_tokens_param}' is {max_tokens} but the prompt ({len(prompt_ids)} tokens) leaves room for only "
            f"{room} in the model's context length of {model.max_model_len}",
            max_tokens_param,
        )
    elif cap is not None:
        max_tokens = min(max_tokens, cap)
    stop = _stop_strings(req.stop)
    params = _sampling_params(req, max_tokens, stop, model, options)
    return PreparedRequest(
        request_id=request_id,
        response_id=response_id or f"{kind}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling_params=params,
        stop=stop,
        end_token_ids=_end_token_ids(params, model),
        **extra,
    )


def _end_token_ids(params: SamplingParams, model: ModelInfo) -> frozenset[int]:
    """The tokens that end the request when sampled: as in vLLM, the one that does is not part of the text (even
    with skip_special_tokens false) unless include_stop_str_in_output asks for it."""
    if params.include_stop_str_in_output:
        return frozenset()
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else model.eos_token_ids)


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    for s in stops:
        check_text(s, "stop")
    return stops


def _options(
    req: CompletionRequest | ChatCompletionRequest,
    tokenizer: ApiTokenizer,
    model: ModelInfo,
    logprobs: tuple[int | None, int | None],
) -> dict[str, Any]:
    """SamplingParams options beyond the core set: log-probabilities (per output token, per prompt token) and
    coordinator/api/sampling_options.py's, computed once per body (a grammar compiles once for all its prompts)."""
    try:
        options = sampling_options(req, tokenizer, model.vocab_size, model.grammars)
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    return {"logprobs": logprobs[0], "prompt_logprobs": logprobs[1], **options}


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    stop: list[str],
    model: ModelInfo,
    options: dict[str, Any],
) -> SamplingParams:
    stop_ids = req.stop_token_ids or []
    bad = next((t for t in stop_ids if t >= model.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"'stop_token_ids' holds token id {bad}, outside the vocabulary [0, {model.vocab_size})",
            "stop_token_ids",
        )
    given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed}
    chosen = {name: value for name, value in model.sampling_defaults.items() if name != "max_tokens"}
    chosen.update((name, value) for name, value in given.items() if value is not None)
    chosen.update(options)  # the request's own penalties and min_p win over the defaults too
    try:
        return SamplingParams(
            max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos, **chosen
        )
    except RequestError as exc:
        raise bad_request(str(exc), exc.param) from None

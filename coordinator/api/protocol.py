"""OpenAI request and response bodies (the subset amoe serves), as pydantic models for validation and /openapi.json."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from amoe.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

# Strict: OpenAI rejects "max_tokens": "5" or "stream": 1, so wrong JSON types must not be silently coerced.
_STRICT = ConfigDict(strict=True, extra="ignore")
# Request bodies keep their unknown fields, so parameters amoe does not implement can be refused by name
# (coordinator/api/validation.py, UNSUPPORTED) rather than silently ignored.
_REQUEST = ConfigDict(strict=True, extra="allow")

# vLLM's extras that OpenAI's responses lack: in the body only when the request asked for them.
_ONLY_WHEN_ASKED = Field(default=None, exclude_if=lambda value: value is None)

# Every number the engine takes is bounded here, so no value can overflow on its way to a runtime.
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


Penalty = Annotated[
    float, Field(allow_inf_nan=False)
]  # finite; its range is checked with a clear message later


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str | None = None
    # "schema" is a BaseModel attribute: the field takes another name and reads the key through its alias.
    json_schema: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs (StructuredOutputsParams): exactly one of these formats."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    json_: str | dict | None = Field(default=None, alias="json")  # "json" is a BaseModel method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _REQUEST
    model: str
    max_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: Count | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Sampling parameters beyond OpenAI's core set, with vLLM's names and meaning (ranges: SamplingParams).
    best_of: Count | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Penalty | None = None
    min_p: Penalty | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    logit_bias: dict[str, Penalty] | None = None  # OpenAI: token ids as strings
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs (one of them).
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo (the prompt scored, nothing generated: OpenAI's legacy scoring idiom, as vLLM serves it)
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    echo: bool | None = False
    logprobs: int | None = None  # top log-probabilities per token (OpenAI: 0..5; amoe and vLLM: 0..20)
    prompt_logprobs: int | None = None  # vLLM's: of the prompt's tokens


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant's calls ({"id", "type", "function": {"name", "arguments"}}) and a tool result's call id; kept as
    # sent, checked and handed to the chat template by coordinator/api/tools.py.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    # Tool calling (coordinator/api/tools.py): the tools are kept as sent, so the chat template renders exactly
    # what transformers' apply_chat_template(..., tools=...) renders for them.
    tools: list[dict] | None = None
    tool_choice: str | dict | None = (
        None  # none | auto | required | {"type": "function", "function": {"name"}}
    )
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: of the rendered conversation's tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    """OpenAI's completions log-probabilities: per token its text, log-probability (null for a prompt's first),
    the most likely tokens' (text → log-probability; the token's own included) and its offset in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's Logprob, one token of `prompt_logprobs`."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (null for the first), token id (as a JSON key) → its Logprob
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = _ONLY_WHEN_ASKED


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON, as the model wrote it


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the message is tool calls alone, as OpenAI sends it
    tool_calls: list[MessageToolCall] | None = Field(default=None, exclude_if=lambda calls: not calls)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI's chat log-probabilities: per output token, its own and the `top_logprobs` most likely."""

    content: list[TokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = _ONLY_WHEN_ASKED  # vLLM's


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A stream's piece of tool call `index`: its id, type and name come once, first; its arguments in pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "amoe"
    max_model_len: int


class TokenizeCompletionRequest(BaseModel):
    """vLLM's /tokenize of a prompt."""

    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """vLLM's /tokenize of a conversation, rendered with the model's chat template."""

    model_config = _STRICT
    model: str | None = None
    messages: list[ChatMessage]
    tools: list[dict] | None = None  # rendered by the chat template, as in a chat completion
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo = Field(description="OpenAI-shaped error")

"""A request as the API hands it to the request room: token ids and sampling parameters, nothing of HTTP left."""

from __future__ import annotations

from dataclasses import dataclass

from amoe.sampling_params import SamplingParams
from amoe.tool_calls.output import ToolCallPlan


@dataclass(frozen=True)
class PreparedRequest:
    request_id: int  # the one id of the request from here to the runtimes' wire (unique per server)
    response_id: str  # what the client sees as the response's "id" (OpenAI style: "cmpl-...", "chatcmpl-...")
    prompt_token_ids: list[int]
    max_tokens: int
    sampling_params: SamplingParams
    stop: list[str]
    # Its prompt's place in the request's list of prompts: its choices are prompt_index * n + i, i < n.
    prompt_index: int = 0
    echo: bool = False  # completions: the prompt (text, and tokens in logprobs) leads the choice
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (its one generated token is not shown)
    prompt_text: str = ""  # what echo shows: the prompt as given, or its token ids decoded
    tool_plan: ToolCallPlan | None = None  # chat: how the output becomes tool calls (None: it is content)
    end_token_ids: frozenset[int] = frozenset()  # a last token among these ended it: its text is not shown

"""Generation output in the API's shapes: the requests of one API call (one per prompt of a completions list, each
with its n sequences) become its choices, whole or as server-sent events. Choice indices are vLLM's: the i-th
sequence returned for prompt p is choice p * n + i."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator

from amoe.logprobs import Logprobs
from coordinator.api.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echoed,
    positions,
    prompt_logprobs,
)
from coordinator.api.openai_errors import ApiError
from coordinator.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from coordinator.api.tool_messages import StreamedMessages, whole_message
from coordinator.requests.lifetime import RequestLifetime
from coordinator.requests.prepared import PreparedRequest
from coordinator.requests.request_state import RequestState
from coordinator.requests.serving import RequestRunner


class Responder:
    """Runs an API call's requests and shapes what they produce; one per app."""

    def __init__(self, runner: RequestRunner, model: str, texts: TokenTexts) -> None:
        self.runner = runner
        self.model = model  # the served name, as responses carry it
        self.texts = texts  # each token's text, for log-probabilities

    async def complete(self, lifetimes: list[RequestLifetime]) -> CompletionResponse:
        choices = []
        finals = await self._finals(lifetimes)
        for lifetime, states in zip(lifetimes, finals):
            req = lifetime.req
            for i, state in enumerate(_chosen(states, req.sampling_params.n)):
                choices.append(self._completion_choice(req, state, _choice_index(req, i)))
        return CompletionResponse(
            id=lifetimes[0].req.response_id, created=int(time.time()), model=self.model, choices=choices,
            usage=_usage(finals),
        )  # fmt: skip

    def _completion_choice(self, req: PreparedRequest, state: RequestState, index: int) -> CompletionChoice:
        params, texts = req.sampling_params, self.texts
        logprobs = prompt_lp = None
        output_text, output = ("", None) if req.echo_only else (state.text, state.logprobs)
        if params.logprobs is not None:
            echoed_at = echoed(req.prompt_token_ids, state.prompt_logprobs) if req.echo else ()
            logprobs = completion_logprobs(texts, itertools.chain(echoed_at, positions(output)))
        if params.prompt_logprobs is not None and state.prompt_logprobs is not None:
            prompt_lp = prompt_logprobs(texts, req.prompt_token_ids, state.prompt_logprobs)
        return CompletionChoice(
            index=index, text=req.prompt_text + output_text if req.echo else output_text, logprobs=logprobs,
            finish_reason=state.finish_reason, prompt_logprobs=prompt_lp,
        )  # fmt: skip

    async def chat(self, lifetimes: list[RequestLifetime]) -> ChatCompletionResponse:
        (states,) = await self._finals(lifetimes)
        req, texts = lifetimes[0].req, self.texts
        params = req.sampling_params
        choices = []
        for i, state in enumerate(_chosen(states, params.n)):
            message, finish_reason = AssistantMessage(content=state.text), state.finish_reason
            if req.tool_plan is not None:
                message, finish_reason = whole_message(req.tool_plan, state.text, finish_reason)
            logprobs = chat_logprobs(texts, state.logprobs) if params.logprobs is not None else None
            choices.append(
                ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=finish_reason)
            )
        prompt_lp = None
        if params.prompt_logprobs is not None and states[0].prompt_logprobs is not None:
            prompt_lp = prompt_logprobs(texts, req.prompt_token_ids, states[0].prompt_logprobs)
        return ChatCompletionResponse(
            id=req.response_id, created=int(time.time()), model=self.model, choices=choices,
            usage=_usage([states]), prompt_logprobs=prompt_lp,
        )  # fmt: skip

    async def _finals(self, lifetimes: list[RequestLifetime]) -> list[list[RequestState]]:
        """Every prompt's request run to its end: per prompt (in order), its sequences' final states by index."""
        finals: list[dict[int, RequestState]] = [{} for _ in lifetimes]
        async for p, chunk in self.runner.run_all(lifetimes):
            finals[p][chunk.index] = chunk.state
        out = []
        for lifetime, states in zip(lifetimes, finals):
            num_seqs = lifetime.req.sampling_params.num_sequences
            if len(states) != num_seqs or not all(s.is_finished for s in states.values()):
                raise ApiError(500, "the backend ended the request without finishing it", type="server_error")
            out.append([states[i] for i in range(num_seqs)])
        return out

    async def completion_events(
        self, lifetimes: list[RequestLifetime], include_usage: bool
    ) -> AsyncIterator[str]:
        first, created = lifetimes[0].req, int(time.time())
        usage_field = {"usage": None} if include_usage else {}
        started: set[int] = set()  # choices with a chunk sent
        offsets: dict[int, int] = {}  # per choice, its next text_offset: its tokens' texts so far, end to end
        finals: list[dict[int, RequestState]] = [{} for _ in lifetimes]
        async for p, chunk in self.runner.run_all(lifetimes):
            req = lifetimes[p].req
            index = _choice_index(req, chunk.index)
            echo_now = req.echo and index not in started  # each choice starts with the prompt
            started.add(index)
            text, output = chunk.text, chunk.logprobs
            if req.echo_only:  # the prompt alone: its generated token is not shown
                text, output = "", None
            if echo_now:
                text = req.prompt_text + text
            logprobs = None
            if req.sampling_params.logprobs is not None:
                echoed_at = echoed(req.prompt_token_ids, chunk.prompt_logprobs) if echo_now else ()
                at = itertools.chain(echoed_at, positions(output))
                logprobs = completion_logprobs(self.texts, at, offset=offsets.get(index, 0))
                if logprobs.tokens:  # the next chunk's tokens go on from there, as in the whole response
                    offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            choice = CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=chunk.finish_reason
            )
            body = CompletionResponse(
                id=first.response_id, created=created, model=self.model, choices=[choice]
            )
            yield event(body.model_dump(exclude={"usage"}) | usage_field)
            finals[p][chunk.index] = chunk.state
        if include_usage and any(finals):
            usage = _usage([list(states.values()) for states in finals if states])
            final = CompletionResponse(
                id=first.response_id, created=created, model=self.model, choices=[], usage=usage
            )
            yield event(final.model_dump())

    async def chat_events(self, lifetimes: list[RequestLifetime], include_usage: bool) -> AsyncIterator[str]:
        req, created = lifetimes[0].req, int(time.time())
        exclude = set() if include_usage else {"usage"}
        asked = req.sampling_params.logprobs is not None

        def chunk(delta: DeltaMessage, index: int, finish_reason: str | None = None, logprobs=None) -> str:
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            body = ChatCompletionChunk(
                id=req.response_id, created=created, model=self.model, choices=[choice]
            )
            payload = body.model_dump(exclude=exclude)
            payload["choices"][0]["delta"] = delta.model_dump(
                exclude_none=True
            )  # as OpenAI: absent, not null
            return event(payload)

        for index in range(req.sampling_params.n):  # OpenAI opens every choice of a chat stream with the role
            yield chunk(DeltaMessage(role="assistant", content=""), index)
        states: dict[int, RequestState] = {}
        deltas = StreamedMessages(req.tool_plan)
        async for _, out in self.runner.run_all(lifetimes):
            states[out.index] = out.state
            # Tokens' log-probabilities go with the delta that sends their text, or with the choice's end.
            delta, logprobs = deltas.feed(out.index, out.text, out.logprobs if asked else None)
            if delta is not None:
                yield chunk(delta, out.index, logprobs=self._chat_logprobs(logprobs))
            if out.is_finished:
                delta, finish_reason, logprobs = deltas.finish(out.index, out.finish_reason)
                if delta is not None:
                    yield chunk(delta, out.index, logprobs=self._chat_logprobs(logprobs))
                    logprobs = None
                yield chunk(DeltaMessage(), out.index, finish_reason, self._chat_logprobs(logprobs))
        if include_usage and states:
            final = ChatCompletionChunk(
                id=req.response_id, created=created, model=self.model, choices=[],
                usage=_usage([list(states.values())]),
            )  # fmt: skip
            yield event(final.model_dump())

    def _chat_logprobs(self, logprobs: Logprobs | None) -> ChatLogprobs | None:
        return chat_logprobs(self.texts, logprobs) if logprobs is not None and len(logprobs) else None


def _choice_index(req: PreparedRequest, i: int) -> int:
    """The i-th sequence returned for its prompt: choice prompt_index * n + i, as vLLM numbers them."""
    return req.prompt_index * req.sampling_params.n + i


def _chosen(states: list[RequestState], n: int) -> list[RequestState]:
    """The n returned: all of them, or with best_of > n the n of highest cumulative log-probability (vLLM's
    ranking), in that order."""
    if len(states) == n:
        return states
    return sorted(states, key=lambda s: s.cumulative_logprob, reverse=True)[:n]


def _usage(finals: list[list[RequestState]]) -> Usage:
    """Per prompt (its sequences' states): each prompt counts once; every generated token counts, those of
    best_of's discarded sequences too."""
    return Usage.of(
        sum(states[0].num_prompt_tokens for states in finals),
        sum(s.num_output_tokens for states in finals for s in states),
    )


def event(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

"""The OpenAI-compatible HTTP API: routes, streaming as server-sent events, disconnect handling (a client that
leaves ends its request's lifetime at once, coordinator/lifetime.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from amoe import __version__
from amoe.config import ServerSection
from amoe.errors import AmoeError
from coordinator.auth import ApiKeyMiddleware, authorized
from coordinator.backend import Backend
from coordinator.body_limit import BodyLimitMiddleware
from coordinator.lifetime import RequestLifetime
from coordinator.load_balancer import LoadBalancer
from coordinator.metrics import CoordinatorMetrics
from coordinator.openai_errors import (
    ApiError,
    ErrorResponse,
    from_exception,
    install_error_handlers,
    internal_error,
)
from coordinator.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    Usage,
)
from coordinator.request_state import Detokenizer, RequestState
from coordinator.serving import RequestRunner
from coordinator.validation import ModelInfo, Tokenizer, prepare_chat, prepare_completion

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503, 504)
}


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def _client_gone(request: Request, exc: ClientDisconnected) -> Response:
    logger.info("client disconnected from %s; its request was aborted", request.url.path)
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


@dataclass
class _Served:
    """What every route needs; one per app."""

    runner: RequestRunner
    tokenizer: Tokenizer
    model: ModelInfo
    created: int
    request_ids: Iterator[int]  # the server's request ids: unique, one per prepared request
    api_key: str | None


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    model: ModelInfo,
    make_detokenizer: Callable[[list[int]], Detokenizer],
    *,
    server: ServerSection | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app for a started backend; the caller owns the backend's lifetime. `server` is the config's
    server section (limits and timeouts); `api_key` the resolved key, if any."""
    server = server or ServerSection()
    metrics = CoordinatorMetrics(backend, per_layer=server.metrics_per_layer)
    balancer = LoadBalancer(backend.kv_usage, backend.block_size, server.max_waiting)
    backend.rebind = balancer.move  # a lost rank's requests may move to another (server.failover_after_s)
    runner = RequestRunner(
        backend, balancer, metrics, make_detokenizer, server.request_timeout_s, server.stall_timeout_s
    )
    served = _Served(runner, tokenizer, model, int(time.time()), itertools.count(1), api_key)
    app = FastAPI(title="amoe", version=__version__, description="OpenAI-compatible API of amoe")
    app.state.served = served
    install_error_handlers(app, on_invalid=lambda request: _count_invalid(runner, request))
    app.add_exception_handler(ClientDisconnected, _client_gone)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(  # outermost: before anything reads
        BodyLimitMiddleware,
        max_bytes=server.max_body_bytes,
        on_too_large=lambda path: _count_path(runner, path),
    )
    _add_info_routes(app, served)
    _add_generation_routes(app, served)
    return app


def abort_all(app: FastAPI) -> None:
    """Fail waiting requests and abort running ones: the end of a draining shutdown."""
    app.state.served.runner.abort_all()


def _add_info_routes(app: FastAPI, served: _Served) -> None:
    backend, balancer = served.runner.backend, served.runner.balancer

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        report = dict(backend.health())
        code = 200 if report.get("status") in ("ok", "degraded") else 503
        if served.api_key and not authorized(request.scope, served.api_key):
            # Open to load balancers' probes, but the details (pids, errors) are for the key holder.
            return JSONResponse({"status": report.get("status")}, status_code=code)
        report.update(running=balancer.num_running, waiting=balancer.num_waiting)
        return JSONResponse(report, status_code=code)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        card = ModelCard(
            id=served.model.name, created=served.created, max_model_len=served.model.max_model_len
        )
        return ModelList(data=[card])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.runner.metrics.render(), media_type=served.runner.metrics.content_type)


def _add_generation_routes(app: FastAPI, served: _Served) -> None:
    runner = served.runner

    async def generate(body, request: Request, endpoint: str, prepare, stream_events, complete) -> Response:
        # Completions and chat differ only in how a request is prepared and how its output is shaped.
        request_id = next(served.request_ids)
        with _count_rejections(runner, endpoint, request_id):
            # Tokenizing and templating off the event loop: a huge prompt must not freeze every other stream.
            req = await asyncio.to_thread(prepare, body, served.tokenizer, served.model, request_id)
        lifetime = runner.open(req, endpoint)  # from here on, whatever happens ends it (and counts it)
        await _unless_disconnected(request, runner.admit(lifetime), lifetime)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_events(runner, lifetime, served.model.name, include_usage)
            return _EventStream(events, lifetime)
        return await _unless_disconnected(request, complete(runner, lifetime, served.model.name), lifetime)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(body, request, "completions", prepare_completion, _completion_events, _complete)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(body, request, "chat", prepare_chat, _chat_events, _chat)


def _count_invalid(runner: RequestRunner, request: Request) -> None:
    """A request body that failed validation is a rejected request of its endpoint."""
    _count_path(runner, request.url.path)


def _count_path(runner: RequestRunner, path: str) -> None:
    endpoint = _ENDPOINTS.get(path)
    if endpoint is not None:
        runner.metrics.reject(endpoint, "rejected")


_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


@contextlib.contextmanager
def _count_rejections(runner: RequestRunner, endpoint: str, request_id: int):
    """Count a request refused while it is prepared (before it has a lifetime)."""
    try:
        yield
    except (ApiError, AmoeError):
        runner.metrics.reject(endpoint, "rejected")
        raise
    except Exception as exc:  # a bug preparing this request: it fails alone, with a 500
        runner.metrics.reject(endpoint, "error")
        logger.exception("request %d failed before it ran", request_id)
        raise internal_error(exc) from None


async def _generate(runner: RequestRunner, lifetime: RequestLifetime) -> list[RequestState]:
    """Every sequence's final state, by index."""
    states: dict[int, RequestState] = {}
    async for _, update in runner.run(lifetime):
        states[update.index] = update
    num_seqs = lifetime.req.sampling_params.num_sequences
    if len(states) != num_seqs or not all(s.is_finished for s in states.values()):
        raise ApiError(500, "the backend ended the request without finishing it", type="server_error")
    return [states[i] for i in range(num_seqs)]


def _chosen(states: list[RequestState], n: int) -> list[RequestState]:
    """The n returned: all of them, or with best_of > n the n of highest cumulative log-probability (vLLM's
    ranking), in that order."""
    if len(states) == n:
        return states
    return sorted(states, key=lambda s: s.cumulative_logprob, reverse=True)[:n]


async def _complete(runner: RequestRunner, lifetime: RequestLifetime, model: str) -> CompletionResponse:
    req, states = lifetime.req, await _generate(runner, lifetime)
    choices = [
        CompletionChoice(index=i, text=s.text, finish_reason=s.finish_reason)
        for i, s in enumerate(_chosen(states, req.sampling_params.n))
    ]
    return CompletionResponse(
        id=req.response_id, created=int(time.time()), model=model, choices=choices, usage=_usage(states)
    )


async def _chat(runner: RequestRunner, lifetime: RequestLifetime, model: str) -> ChatCompletionResponse:
    req, states = lifetime.req, await _generate(runner, lifetime)
    choices = [
        ChatChoice(index=i, message=AssistantMessage(content=s.text), finish_reason=s.finish_reason)
        for i, s in enumerate(_chosen(states, req.sampling_params.n))
    ]
    return ChatCompletionResponse(
        id=req.response_id, created=int(time.time()), model=model, choices=choices, usage=_usage(states)
    )


def _usage(states: list[RequestState]) -> Usage:
    """Every generated token counts, those of best_of's discarded sequences too."""
    return Usage.of(states[0].num_prompt_tokens, sum(s.num_output_tokens for s in states))


async def _completion_events(
    runner: RequestRunner, lifetime: RequestLifetime, model: str, include_usage: bool
) -> AsyncIterator[str]:
    req, created = lifetime.req, int(time.time())
    usage_field = {"usage": None} if include_usage else {}
    states: dict[int, RequestState] = {}
    async for text, state in runner.run(lifetime):
        states[state.index] = state
        choice = CompletionChoice(index=state.index, text=text, finish_reason=state.finish_reason)
        chunk = CompletionResponse(id=req.response_id, created=created, model=model, choices=[choice])
        yield _event(chunk.model_dump(exclude={"usage"}) | usage_field)
    if include_usage and states:
        final = CompletionResponse(
            id=req.response_id, created=created, model=model, choices=[], usage=_usage(list(states.values()))
        )
        yield _event(final.model_dump())


async def _chat_events(
    runner: RequestRunner, lifetime: RequestLifetime, model: str, include_usage: bool
) -> AsyncIterator[str]:
    req, created = lifetime.req, int(time.time())
    exclude = set() if include_usage else {"usage"}

    def chunk(delta: DeltaMessage, index: int, finish_reason: str | None = None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
        body = ChatCompletionChunk(id=req.response_id, created=created, model=model, choices=[choice])
        payload = body.model_dump(exclude=exclude)
        payload["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # as OpenAI: absent, not null
        return _event(payload)

    for index in range(req.sampling_params.n):  # OpenAI opens every choice of a chat stream with the role
        yield chunk(DeltaMessage(role="assistant", content=""), index)
    states: dict[int, RequestState] = {}
    async for text, state in runner.run(lifetime):
        states[state.index] = state
        if text:
            yield chunk(DeltaMessage(content=text), state.index)
        if state.is_finished:
            yield chunk(DeltaMessage(), state.index, state.finish_reason)
    if include_usage and states:
        final = ChatCompletionChunk(
            id=req.response_id, created=created, model=model, choices=[], usage=_usage(list(states.values()))
        )
        yield _event(final.model_dump())


class _EventStream(StreamingResponse):
    """A request's server-sent events. However the response ends (all sent, the client gone, a failure), the
    request ends with it, directly: the event generators may sit at a `yield` that no cancellation reaches."""

    def __init__(self, events: AsyncIterator[str], lifetime: RequestLifetime) -> None:
        super().__init__(_with_done(events), media_type="text/event-stream")
        self._lifetime = lifetime

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._lifetime.abort("its event stream ended early (the client left)")


async def _with_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The OpenAI stream framing: an error mid-stream becomes an error event; always end with [DONE]."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except Exception as exc:  # headers are sent already: the status can no longer change
        yield _event({"error": from_exception(exc).info.model_dump()})
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[Any], lifetime: RequestLifetime) -> Any:
    """Await `work`; if the client disconnects first, abort its request, then cancel `work`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watcher.done()
        watcher.cancel()
        if not task.done():  # the client left, or this handler is cancelled
            # Aborted here, not by the cancellation: that one only stops `work` from going on.
            lifetime.abort("the client disconnected" if gone else "its handler was cancelled")
            task.cancel()
            await asyncio.wait({task})
    if task not in done:
        if not task.cancelled():
            task.exception()  # marked as read: with the client gone, nobody needs how `work` ended
        raise ClientDisconnected()
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body is read already, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass

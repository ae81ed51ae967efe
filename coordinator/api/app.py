"""The OpenAI-compatible HTTP API: routes, streaming as server-sent events, disconnect handling (a client that
leaves ends its request's lifetime at once, coordinator/requests/lifetime.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
from coordinator.api.admin import add_admin_routes
from coordinator.api.auth import ApiKeyMiddleware, authorized
from coordinator.api.body_limit import BodyLimitMiddleware
from coordinator.api.logprobs import TokenTexts
from coordinator.api.openai_errors import (
    ApiError,
    ErrorResponse,
    bad_request,
    from_exception,
    install_error_handlers,
    internal_error,
)
from coordinator.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from coordinator.api.responses import Responder, event
from coordinator.api.tools import check_tools, conversation
from coordinator.api.validation import (
    ApiTokenizer,
    ModelInfo,
    check_text,
    prepare_chat,
    prepare_completions,
)
from coordinator.metrics import CoordinatorMetrics
from coordinator.requests.backend import Backend
from coordinator.requests.lifetime import RequestLifetime
from coordinator.requests.load_balancer import LoadBalancer
from coordinator.requests.prepared import PreparedRequest
from coordinator.requests.request_state import Detokenizer
from coordinator.requests.serving import RequestRunner, end_all

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 500, 503, 504)
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
    tokenizer: ApiTokenizer
    model: ModelInfo
    created: int
    request_ids: Iterator[int]  # the server's request ids: unique, one per prepared request
    api_key: str | None
    responder: Responder  # runs an API call's requests and shapes its response


def create_app(
    backend: Backend,
    tokenizer: ApiTokenizer,
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
    responder = Responder(runner, model.name, TokenTexts(tokenizer))
    served = _Served(runner, tokenizer, model, int(time.time()), itertools.count(1), api_key, responder)
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
    _add_tokenizer_routes(app, served)
    add_admin_routes(app, backend)
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
    runner, responder = served.runner, served.responder

    async def generate(body, request: Request, endpoint: str, prepare, stream_events, complete) -> Response:
        # Completions and chat differ only in how a request is prepared and how its output is shaped; a
        # completions body with a list of prompts runs one request per prompt, answered together.
        request_id = next(served.request_ids)  # the first prompt's; the others' follow
        ids = itertools.chain([request_id], served.request_ids)
        with _count_rejections(runner, endpoint, request_id):
            # Tokenizing and templating off the event loop: a huge prompt must not freeze every other stream.
            reqs = await asyncio.to_thread(prepare, body, served.tokenizer, served.model, ids.__next__)
        lifetimes = [runner.open(req, endpoint) for req in reqs]  # from here on, whatever happens ends them
        await _unless_disconnected(request, _admit_all(runner, lifetimes), lifetimes)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_events(lifetimes, include_usage)
            return _EventStream(events, lifetimes)
        return await _unless_disconnected(request, complete(lifetimes), lifetimes)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(
            body, request, "completions", prepare_completions, responder.completion_events, responder.complete
        )

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(body, request, "chat", _prepare_chat, responder.chat_events, responder.chat)


def _prepare_chat(body, tokenizer, model, next_id) -> list[PreparedRequest]:
    return [prepare_chat(body, tokenizer, model, next_id())]


def _add_tokenizer_routes(app: FastAPI, served: _Served) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info (which lm-evaluation-harness looks for to tokenize with
    the server's own tokenizer)."""
    tokenizer, model = served.tokenizer, served.model

    def check_model(name: str | None) -> None:
        if name is not None and name != model.name:
            raise ApiError(
                404, f"The model '{name}' does not exist (serving '{model.name}')", param="model",
                code="model_not_found",
            )  # fmt: skip

    def encode(body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        if isinstance(body, TokenizeCompletionRequest):
            check_text(body.prompt, "prompt")
            return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        messages = conversation(body.messages)
        for m in messages:
            check_text(m["content"], "messages")
        tools = {} if body.tools is None else {"tools": check_tools(body.tools)}
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, **tools
            )
        except Exception as exc:  # a checkpoint's template may reject e.g. a system message
            raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        check_model(body.model)
        tokens = await asyncio.to_thread(encode, body)
        strs = tokenizer.token_strs(tokens) if body.return_token_strs else None
        return TokenizeResponse(
            count=len(tokens), max_model_len=model.max_model_len, tokens=tokens, token_strs=strs
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        bad = next((t for t in body.tokens if t >= model.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"'tokens' holds token id {bad}, outside the vocabulary [0, {model.vocab_size})", "tokens"
            )
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))

    @app.get("/tokenizer_info", responses=_ERRORS)
    async def tokenizer_info() -> dict[str, Any]:
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **tokenizer.special_tokens,
            "chat_template": tokenizer.chat_template,
            "model_max_length": model.max_model_len,
        }


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


async def _admit_all(runner: RequestRunner, lifetimes: list[RequestLifetime]) -> None:
    """Admit a one-prompt request before answering (so a full server says 503 in the status line); several
    prompts are admitted each as it starts (RequestRunner.run_all)."""
    if len(lifetimes) == 1:
        await runner.admit(lifetimes[0])


class _EventStream(StreamingResponse):
    """A request's server-sent events. However the response ends (all sent, the client gone, a failure), the
    request ends with it, directly: the event generators may sit at a `yield` that no cancellation reaches."""

    def __init__(self, events: AsyncIterator[str], lifetimes: list[RequestLifetime]) -> None:
        super().__init__(_with_done(events), media_type="text/event-stream")
        self._lifetimes = lifetimes

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            end_all(self._lifetimes, "its event stream ended early (the client left)")


async def _with_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The OpenAI stream framing: an error mid-stream becomes an error event; always end with [DONE]."""
    try:
        async with contextlib.aclosing(events):
            async for each in events:
                yield each
    except Exception as exc:  # headers are sent already: the status can no longer change
        yield event({"error": from_exception(exc).info.model_dump()})
    yield "data: [DONE]\n\n"


async def _unless_disconnected(
    request: Request, work: Awaitable[Any], lifetimes: list[RequestLifetime]
) -> Any:
    """Await `work`; if the client disconnects first, abort its requests, then cancel `work`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watcher.done()
        watcher.cancel()
        if not task.done():  # the client left, or this handler is cancelled
            # Aborted here, not by the cancellation: that one only stops `work` from going on.
            end_all(lifetimes, "the client disconnected" if gone else "its handler was cancelled")
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

"""OpenAI-shaped errors: every failure the API returns is {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from amoe.errors import AmoeError, EngineDeadError, RequestError, RequestFailed
from coordinator.api.protocol import ErrorInfo, ErrorResponse
from coordinator.requests.errors import InternalError, Overloaded, TimedOut

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error response: HTTP status plus the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(
            ErrorResponse(error=self.info).model_dump(), status_code=self.status, headers=headers
        )


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_exception(exc: Exception) -> ApiError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, Overloaded):
        return ApiError(503, str(exc), type="server_error", code="overloaded")
    if isinstance(exc, TimedOut):
        return ApiError(504, str(exc), type="server_error", code="timeout")
    if isinstance(exc, InternalError):  # logged where it happened
        return internal_error(exc.cause)
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"the engine is not running: {exc}", type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailed):
        return ApiError(500, f"the request failed: {exc}", type="server_error", code="request_failed")
    logger.exception("unexpected error", exc_info=exc)
    return internal_error(exc)


def internal_error(exc: Exception) -> ApiError:
    """The 500 of a bug that hit one request (logged where it happened, with the request's id)."""
    return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}", type="server_error")


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, plus the offending parameter's name."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    # A union reports one error per member: the one that is not a mere type mismatch says what is wrong
    # (a list of 65 stop strings is "too long", not "not a string").
    first = min(errors, key=lambda e: str(e.get("type", "")).endswith("_type"))
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _union_tag(part)]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None
    if first.get("type") == "missing":
        return f"missing required parameter '{'.'.join(loc)}'", ".".join(loc) or None
    param = loc[0] if loc else None
    where = f"parameter '{'.'.join(loc)}'" if loc else "request body"
    return f"invalid {where}: {first.get('msg')}", param


def _union_tag(part: object) -> bool:
    """pydantic's name of a union member in an error location ("constrained-str", "list[int]"), not a field."""
    return isinstance(part, str) and ("[" in part or "-" in part)


def install_error_handlers(
    app: FastAPI, on_invalid: Callable[[Request], None] = lambda request: None
) -> None:
    """Turn FastAPI's 422s, HTTP errors and stray exceptions into OpenAI-shaped bodies; `on_invalid` hears of
    every body that fails validation (the API counts them as rejected requests)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    # Expected failures get their own handler: the catch-all below runs in Starlette's ServerErrorMiddleware,
    # which re-raises after responding and would log a traceback for every 503.
    @app.exception_handler(AmoeError)
    async def _amoe_error(request: Request, exc: AmoeError) -> JSONResponse:
        return from_exception(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_invalid(request)
        message, param = _describe_validation(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()

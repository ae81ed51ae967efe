"""OpenAI-shaped errors: every failure the API returns is {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from amoe.errors import AmoeError, EngineDeadError, RequestError
from coordinator.load_balancer import OverloadedError
from coordinator.protocol import ErrorInfo, ErrorResponse

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
        return bad_request(str(exc))
    if isinstance(exc, OverloadedError):
        return ApiError(503, str(exc), type="server_error", code="overloaded")
    if isinstance(exc, EngineDeadError):
        return ApiError(503, f"the engine is not running: {exc}", type="server_error", code="engine_dead")
    logger.exception("unexpected error", exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}", type="server_error")


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, plus the offending parameter's name."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg')}", None
    if first.get("type") == "missing":
        return f"missing required parameter '{'.'.join(loc)}'", ".".join(loc) or None
    param = ".".join(loc) or None
    where = f"parameter '{param}'" if param else "request body"
    return f"invalid {where}: {first.get('msg')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Turn FastAPI's 422s, HTTP errors and stray exceptions into OpenAI-shaped bodies."""

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
        message, param = _describe_validation(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()

"""Bearer API-key check for every endpoint but /health (which shows details only to the key holder), as a pure
ASGI middleware.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which wraps `receive` and would hide a client's disconnect
from streaming responses.
"""

from __future__ import annotations

import hmac

from coordinator.api.openai_errors import ApiError

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = ApiError(401, "invalid or missing API key", code="invalid_api_key")
        await error.response()(scope, receive, send)

    def _authorized(self, scope) -> bool:
        return hmac.compare_digest(_given(scope), self._expected)  # constant time: no key guessing by timing


def authorized(scope, api_key: str) -> bool:
    """Whether the request carries the key (for what open paths show only to the key holder)."""
    return hmac.compare_digest(_given(scope), f"Bearer {api_key}".encode())


def _given(scope) -> bytes:
    return dict(scope["headers"]).get(b"authorization", b"")

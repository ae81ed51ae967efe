"""A cap on request bodies, enforced before anything parses them: a body over `max_bytes` gets a 413 with an
OpenAI-shaped error, whether it declares its length up front or streams it in chunks.

Pure ASGI (like the API-key check), so a client's later disconnect still reaches streaming responses.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.api.openai_errors import ApiError


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, on_too_large: Callable[[str], None] | None = None) -> None:
        """`on_too_large(path)`: told of each refused body (the API counts it as a rejected request)."""
        self.app = app
        self.max_bytes = max_bytes
        self.on_too_large = on_too_large

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)  # refused before a byte of the body is read
            return
        # Read the body here, counting as it arrives (a chunked or lying client cannot get past the cap), then
        # replay it to the app; what comes after the body (the disconnect) goes to the app as usual.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message, receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        await self.app(scope, _replay(chunks, None, receive), send)

    async def _too_large(self, scope, receive, send) -> None:
        if self.on_too_large is not None:
            self.on_too_large(scope["path"])
        error = ApiError(
            413,
            f"the request body is over the server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)


def _replay(chunks: list[bytes], pending: dict | None, receive):
    """A receive() that first returns the buffered body in one message (or the message that ended the read)."""
    first = (
        pending
        if pending is not None
        else {"type": "http.request", "body": b"".join(chunks), "more_body": False}
    )
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay

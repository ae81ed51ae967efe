"""A minimal HTTP/1.1 client for whole (non-streamed) JSON POSTs over pooled keep-alive connections.

Why not httpx here: its connection pool scans every connection it holds on each request, so with the thousands of
concurrent requests `amoe bench compare` keeps open the load generator itself spent more CPU than the server
(py-spy: `AsyncConnectionPool._assign_requests_to_connections` and `is_idle` on top). This pool is a free list:
taking and returning a connection is O(1). It speaks only what the benchmark needs — POST with a JSON body, a
response with Content-Length, chunked encoding or close-delimited — and raises on anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any
from urllib.parse import urlsplit

_MAX_HEADER_LINES = 100


class HttpError(Exception):
    """The server's answer could not be read as HTTP/1.1."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class JsonPoster:
    """`await poster.post(path, body)` → (status, response bytes); `await poster.aclose()` when done."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = url.scheme == "https"
        authority = url.netloc.rsplit("@", 1)[-1]
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = (
            f"Host: {authority}\r\nContent-Type: application/json\r\nAccept: application/json\r\n{extra}"
        )
        self._free: list[_Connection] = []

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        payload = json.dumps(body, separators=(",", ":")).encode()
        request = (
            f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload
        )
        while self._free:
            conn = self._free.pop()
            try:
                return await self._exchange(conn, request)
            except _Stale:
                # The server closed this idle keep-alive connection (uvicorn does after 5 s): the request never
                # reached it, so it is safe to send again on another connection.
                continue
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl or None)
        try:
            return await self._exchange(_Connection(reader, writer), request)
        except _Stale:
            raise HttpError("the server closed the connection without answering") from None

    async def _exchange(self, conn: _Connection, request: bytes) -> tuple[int, bytes]:
        try:
            try:
                conn.writer.write(request)
                await conn.writer.drain()
                status_line = await conn.reader.readline()
            except (ConnectionError, OSError) as e:
                raise _Stale() from e
            if not status_line:
                raise _Stale()
            status, keep, body = await self._read_response(conn.reader, status_line)
        except BaseException:  # failed, timed out or cancelled part-way: the connection's state is unknown
            conn.close()
            raise
        if keep:
            self._free.append(conn)
        else:
            conn.close()
        return status, body

    async def _read_response(
        self, reader: asyncio.StreamReader, status_line: bytes
    ) -> tuple[int, bool, bytes]:
        parts = status_line.decode("latin-1").split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HttpError(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADER_LINES):
            line = await reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise HttpError("the connection closed inside the response headers")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        else:
            raise HttpError("too many response headers")
        keep = headers.get("connection", "").lower() != "close" and parts[0] != "HTTP/1.0"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return status, keep, await _read_chunked(reader)
        if "content-length" in headers:
            try:
                return status, keep, await reader.readexactly(int(headers["content-length"]))
            except asyncio.IncompleteReadError:
                raise HttpError("the connection closed inside the response body") from None
        return status, False, await reader.read()  # delimited by the server closing the connection

    async def aclose(self) -> None:
        while self._free:
            conn = self._free.pop()
            conn.close()
            with contextlib.suppress(ConnectionError, OSError):
                await conn.writer.wait_closed()


class _Stale(Exception):
    """A reused connection failed before any byte of the response arrived."""


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    try:
        while True:
            size_line = await reader.readline()
            size = int(size_line.split(b";", 1)[0].strip() or b"x", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return bytes(body)
            body += await reader.readexactly(size)
            await reader.readexactly(2)  # the CRLF after each chunk
    except (ValueError, asyncio.IncompleteReadError):
        raise HttpError("a malformed chunked response body") from None

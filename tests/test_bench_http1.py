"""The benchmark's whole-response client (`BenchClient(stream=False)` over amoe.bench.http1): keep-alive reuse,
Content-Length / chunked / close-delimited bodies, a server that drops idle connections, and bad answers."""

import asyncio
import json

import pytest

from amoe.bench.client import BenchClient
from amoe.bench.http1 import HttpError, JsonPoster
from amoe.bench.workloads import RequestSpec

USAGE = {"usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def _length(status: int, body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def _chunked(body: bytes) -> bytes:
    half = len(body) // 2
    chunks = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:half], body[half:]))
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


class FakeServer:
    """Answers each request with the next canned response; counts connections and records request bodies."""

    def __init__(self, responses: list[bytes], close_after_each: bool = False) -> None:
        self.responses, self.close_after_each = list(responses), close_after_each
        self.connections, self.bodies = 0, []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.responses:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(
                        b":"
                    )[1]
                )
                self.bodies.append(json.loads(await reader.readexactly(length)))
                response = self.responses.pop(0)
                if response:
                    writer.write(response)
                    await writer.drain()
                if self.close_after_each or not response or b"Connection: close" in response:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


ONE = (RequestSpec([11, 12], 2, 3),)


async def _run(responses, specs=ONE, timeout=10.0, **server_kw):
    fake = FakeServer(responses, **server_kw)
    async with fake as url, BenchClient(url, "m", timeout=timeout, stream=False) as client:
        results = [await client.complete(spec) for spec in specs]
    return fake, results


def test_whole_responses_reuse_one_connection_and_read_usage():
    ok = _length(200, json.dumps({"choices": [{"text": "abc"}], **USAGE}).encode())
    fake, results = asyncio.run(_run([ok, ok, ok], specs=[RequestSpec([11, 12], 2, 3)] * 3))
    assert all(r.success for r in results), [r.error for r in results]
    assert [(r.prompt_tokens, r.output_tokens) for r in results] == [(2, 3)] * 3
    assert all(r.latency > 0 for r in results)
    assert fake.connections == 1  # keep-alive
    body = fake.bodies[0]
    assert body["stream"] is False and "stream_options" not in body and body["max_tokens"] == 3
    assert body["prompt"] == [11, 12] and body["ignore_eos"] is True


def test_chunked_and_close_delimited_bodies():
    payload = json.dumps(USAGE).encode()
    close_delimited = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + payload
    fake, results = asyncio.run(
        _run([_chunked(payload), close_delimited, _chunked(payload)], specs=[RequestSpec([1], 1, 3)] * 3)
    )
    assert [r.output_tokens for r in results] == [3, 3, 3], [r.error for r in results]
    assert fake.connections == 2  # a close-delimited body cannot leave its connection reusable


def test_a_connection_the_server_closed_while_idle_is_replaced():
    ok = _length(200, json.dumps(USAGE).encode())
    fake, results = asyncio.run(_run([ok, ok], specs=[RequestSpec([1], 1, 3)] * 2, close_after_each=True))
    assert all(r.success for r in results), [r.error for r in results]
    assert fake.connections == 2 and len(fake.bodies) == 2  # the second request was sent once, on a new one


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (_length(400, b'{"error": {"message": "bad prompt"}}'), "HTTP 400: bad prompt"),
        (_length(503, b"overloaded"), "HTTP 503: overloaded"),
        (_length(200, b"{not json"), "JSONDecodeError"),
        (_length(200, b"{}"), "no completion tokens"),
        (b"SMTP ready\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{}", "inside the response body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunked"),
        (b"", "closed the connection without answering"),
    ],
)
def test_bad_answers_are_failed_requests(response, error):
    _, (result,) = asyncio.run(_run([response]))
    assert not result.success and error in result.error


def test_a_server_that_never_answers_times_out():
    async def run():
        async def silent(reader, writer):
            await reader.read()  # never answers

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with BenchClient(url, "m", timeout=0.3, stream=False) as client:
            result = await client.complete(RequestSpec([1], 1, 1))
        server.close()
        return result

    result = asyncio.run(run())
    assert not result.success and "timed out" in result.error


def test_a_refused_connection_is_a_failed_request():
    async def run():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        server.close()
        await server.wait_closed()
        async with BenchClient(url, "m", timeout=5, stream=False) as client:
            return await client.complete(RequestSpec([1], 1, 1))

    result = asyncio.run(run())
    assert not result.success and "Connect" in result.error


def test_only_http_urls_are_accepted():
    with pytest.raises(ValueError, match="not an http"):
        JsonPoster("ftp://host/")
    assert issubclass(HttpError, Exception)

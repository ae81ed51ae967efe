"""An async streaming client for OpenAI-compatible /v1/completions that times every token it receives.

Every streamed chunk that carries a choice counts as a token arrival, as `vllm bench serve` counts them: TTFT is the
first such chunk, ITL the gaps between the following ones. The token counts come from the final usage chunk
(stream_options.include_usage) when the server sends one, else from the number of chunks. A request that fails in
any way — refused connection, HTTP error, error event mid-stream, cut-off stream, timeout — comes back as a failed
RequestResult; the client never raises for one request and never waits longer than its timeout.

ITL is per chunk while TPOT is per token: a chunk may carry several tokens, and a server may send no chunk for a
token whose text it holds back (amoe does, for an incomplete UTF-8 character), which makes ITL gaps longer.

With `stream=False` a request is one JSON response: only its latency and token counts are measured (no TTFT or
ITL). `amoe bench compare` uses it with the server's own TTFT / ITL histograms, because at the rates it offers,
parsing one SSE event per token in this client and framing it in the server cost more CPU than the emulated
runtimes on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from amoe.bench.http1 import JsonPoster
from amoe.bench.workloads import RequestSpec
from amoe.errors import ConfigError

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 300  # keep one bad response from flooding the report


@dataclass
class RequestResult:
    """What one request measured; times in seconds from when it was sent."""

    success: bool = False
    prompt_tokens: int = 0  # the server's count when it reports usage, else the intended prompt length
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


class BenchClient:
    """Sends benchmark requests to one server; use as an async context manager."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float = 300.0,
        max_connections: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,  # tests pass a fake server here
        stream: bool = True,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.timeout = timeout
        self.stream = stream
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Unlimited by default: a pool that queues requests would add its wait to the measured TTFT.
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout, limits=limits, transport=transport
        )
        self._poster = None if stream else JsonPoster(self.base_url, headers)

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()
        if self._poster is not None:
            await self._poster.aclose()

    async def list_models(self) -> list[dict[str, Any]]:
        """The server's /v1/models entries; a ConfigError if the server cannot be asked."""
        try:
            response = await self._http.get("/v1/models", timeout=min(self.timeout, 30.0))
            response.raise_for_status()
            data = response.json()["data"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"cannot list the models of {self.base_url}: {_describe(e)}") from None
        if not isinstance(data, list):
            raise ConfigError(f"{self.base_url}/v1/models did not return a list of models")
        return [entry for entry in data if isinstance(entry, dict)]

    async def complete(self, spec: RequestSpec) -> RequestResult:
        """Stream one completion and time it; failures are returned, not raised."""
        result = RequestResult(prompt_tokens=spec.prompt_len)
        try:
            send = self._stream if self.stream else self._whole
            await asyncio.wait_for(send(spec, result), self.timeout)
        except asyncio.TimeoutError:
            result.error = f"timed out after {self.timeout:g} s"
        # Anything one request runs into must be counted as its failure, not end the run.
        except Exception as e:
            result.error = _describe(e)
        result.success = not result.error
        if result.error:
            logger.debug("request failed: %s", result.error)
        return result

    def _body(self, spec: RequestSpec) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.output_len,
            "ignore_eos": True,  # an extra field vLLM, SGLang and amoe accept: the output length is ours to set
            "temperature": 0.0,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _whole(self, spec: RequestSpec, result: RequestResult) -> None:
        start = time.perf_counter()
        status, content = await self._poster.post("/v1/completions", self._body(spec))
        result.latency = time.perf_counter() - start
        if status != 200:
            result.error = f"HTTP {status}: {_error_text(content)}"
            return
        usage = json.loads(content).get("usage") or {}
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.output_tokens = usage.get("completion_tokens", 0)
        if not result.output_tokens:
            result.error = "the response reports no completion tokens"

    async def _stream(self, spec: RequestSpec, result: RequestResult) -> None:
        start = time.perf_counter()
        async with self._http.stream("POST", "/v1/completions", json=self._body(spec)) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {_error_message(response)}"
                return
            num_chunks, last, reported_tokens = 0, start, None
            async for line in response.aiter_lines():
                data = _sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    result.latency = time.perf_counter() - start
                    result.output_tokens = num_chunks if reported_tokens is None else reported_tokens
                    return
                event = json.loads(data)
                now = time.perf_counter()
                if "error" in event:
                    result.error = f"error event: {_truncate(json.dumps(event['error']))}"
                    return
                if event.get("choices"):
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    num_chunks, last = num_chunks + 1, now
                if usage := event.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                    reported_tokens = usage.get("completion_tokens")
        result.error = "the stream ended without [DONE]"


def normalize_base_url(url: str) -> str:
    """http://host:port from what users type: with or without a trailing slash or /v1."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url must start with http:// or https://; got {url!r}")
    return url.removesuffix("/v1")


def _sse_data(line: str) -> str | None:
    # Server-sent events: only `data:` fields matter here; comments and blank separators are skipped.
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def _error_text(content: bytes) -> str:
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content.decode("utf-8", "replace")
    return _truncate(str(message))


def _error_message(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return _truncate(str(message))


def _describe(e: BaseException) -> str:
    return _truncate(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


def _truncate(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."

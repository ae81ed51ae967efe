"""A request's lifetime has one owner: whatever ends it — the client leaving at any await point, a stop string, a
timeout, the server draining, a failure — the backend's abort is sent when the backend still runs it, the load
balancer's reservation is returned, the KV is free and the request is counted once.

Driven through the real app over ASGI by hand: a backend double whose tokens come only when the test emits them,
and a scripted client whose `http.disconnect` comes when the test says. Nothing waits on wall time except the two
timeout tests; `until` yields loop turns."""

import asyncio
import json
from collections.abc import Callable

import pytest
from factories import CharDetokenizer, CharTokenizer

from amoe.config import ServerSection
from amoe.errors import EngineDeadError, RequestFailed
from coordinator.api.app import abort_all, create_app
from coordinator.api.openai_errors import from_exception
from coordinator.api.protocol import CompletionRequest
from coordinator.api.validation import ModelInfo, prepare_completion
from coordinator.requests.backend import Backend, RankKV, TokenDelta
from coordinator.requests.errors import InternalError, Overloaded, TimedOut

MODEL = "fake"
BLOCK = 16
TOTAL_BLOCKS = 8
BLOCKER = -1  # a reservation made straight on the load balancer, to keep a request waiting for KV


class GatedBackend(Backend):
    """Token i of a request is script[i]; it comes only when the test calls `emit` (or, once `free_running`, one
    per loop turn). Keeps each running request's KV blocks and records every abort, so a test tells an abort that
    stopped a running request from a redundant one (which the Backend contract allows)."""

    def __init__(self, script: str = "abcdefgh") -> None:
        self.script = script
        self.used: dict[int, int] = {}  # request id -> KV blocks, while it runs here
        self.started: list[int] = []  # requests that reached the backend
        self.finished: list[int] = []  # requests that ran to their end here
        self.abort_calls: list[int] = []
        self.aborted: list[int] = []  # the aborts that stopped a running request
        self.reading: set[int] = set()  # requests whose stream waits for its next token
        self.delivered: dict[int, int] = {}  # request id -> items its stream has taken
        self.free_running = False
        self.fail_at: int | None = None  # the token index at which a request fails here
        self.loses_a_cancellation = False  # a stream drops the next cancellation, as asyncio.wait_for could
        self._queues: dict[int, asyncio.Queue] = {}
        self._emitted: dict[int, int] = {}
        self._max_tokens: dict[int, int] = {}

    @property
    def block_size(self):
        return BLOCK

    async def start(self):
        pass

    async def shutdown(self):
        pass

    def health(self):
        return {"status": "ok"}

    def kv_usage(self):
        return [RankKV(free_blocks=TOTAL_BLOCKS - sum(self.used.values()), total_blocks=TOTAL_BLOCKS)]

    async def generate(self, request_id, prompt_token_ids, sampling_params, rank=0):
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._emitted[request_id] = 0
        self.delivered[request_id] = 0
        self._max_tokens[request_id] = sampling_params.max_tokens
        self.used[request_id] = -(-(len(prompt_token_ids) + sampling_params.max_tokens) // BLOCK)
        self.started.append(request_id)
        finished = False
        try:
            while not finished:
                if self.free_running and queue.empty():
                    asyncio.get_running_loop().call_soon(self.emit, request_id)
                self.reading.add(request_id)
                try:
                    item = await queue.get()
                except asyncio.CancelledError:
                    if not self.loses_a_cancellation:
                        raise
                    self.loses_a_cancellation = False
                    continue
                finally:
                    self.reading.discard(request_id)
                self.delivered[request_id] += 1
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.is_finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # as the real backends do: a stream closed early aborts its request
                self.abort(request_id)

    def emit(self, request_id: int | None = None) -> None:
        """The request's next token (the last one finishes it with "length"); nothing once it has ended here."""
        request_id = self.started[-1] if request_id is None else request_id
        if request_id not in self.used:
            return
        i = self._emitted[request_id]
        if i == self.fail_at:
            del self.used[request_id]
            self._queues[request_id].put_nowait(RequestFailed("injected failure"))
            return
        self._emitted[request_id] = i + 1
        last = i + 1 == self._max_tokens[request_id]
        if last:
            del self.used[request_id]
            self.finished.append(request_id)
        delta = TokenDelta([ord(self.script[i % len(self.script)])], "length" if last else None)
        self._queues[request_id].put_nowait(delta)

    def abort(self, request_id):
        self.abort_calls.append(request_id)
        if request_id not in self.used:
            return  # unknown or finished: ignored, as the contract says
        del self.used[request_id]
        self.aborted.append(request_id)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(TokenDelta(finish_reason="abort"))


class ScriptedClient:
    """One HTTP exchange with the app over ASGI, played by hand. `receive` gives the body, then waits until the
    client `leave`s and from then on says `http.disconnect`; after leaving, sends are dropped (as uvicorn does).

    A response message matching `hold` waits, as on a full socket buffer, until the client leaves (uvicorn then
    lets the send return) or `resume`s reading. With `stuck`, leaving does not release it: the server has to
    cancel the send, and the response's generators stay suspended at their `yield`."""

    def __init__(self, app, path: str, body: dict, hold=None, stuck: bool = False) -> None:
        self.app = app
        self.body = json.dumps(body).encode()
        self.hold: Callable[[dict], bool] | None = hold
        self.stuck = stuck
        self.messages: list[dict] = []
        self.held = False
        self.left = asyncio.Event()
        self._released = asyncio.Event()
        self._body_sent = False
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},  # as uvicorn says
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 1234),
            "server": ("test", 80),
        }
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.app(self.scope, self.receive, self.send))

    def leave(self) -> None:
        self.left.set()
        if not self.stuck:
            self._released.set()

    def resume(self) -> None:
        """The held message goes out after all (the client reads again)."""
        self.hold = None
        self._released.set()

    async def receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if not self.left.is_set() and self.hold is not None and self.hold(message):
            self.held = True
            await self._released.wait()
        if not self.left.is_set():
            self.messages.append(message)

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def text(self) -> str:
        return b"".join(m.get("body", b"") for m in self.messages[1:]).decode()

    def json(self) -> dict:
        return json.loads(self.text)


class Harness:
    def __init__(self, backend: GatedBackend | None = None, detokenizer=None, **server) -> None:
        self.backend = backend or GatedBackend()
        self.model = ModelInfo(MODEL, 64, 100_000)
        self.app = create_app(
            self.backend,
            CharTokenizer(roles=False),
            self.model,
            lambda ids: detokenizer or CharDetokenizer(),
            server=ServerSection(**server),
        )
        self.runner = self.app.state.served.runner

    def client(
        self, endpoint: str, stream: bool, hold=None, stuck=False, max_tokens=3, **extra
    ) -> ScriptedClient:
        body = {"model": MODEL, "max_tokens": max_tokens, "stream": stream, **extra}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": "hi"}]
            return ScriptedClient(self.app, "/v1/chat/completions", body, hold, stuck)
        body["prompt"] = "hi"
        return ScriptedClient(self.app, "/v1/completions", body, hold, stuck)

    def counted(self, metric: str, label: str) -> dict[str, float]:
        """The request metric's non-zero series, by `label`."""
        registry = self.runner.metrics.registry
        return {
            s.labels[label]: s.value
            for family in registry.collect()
            if family.name == metric
            for s in family.samples
            if s.value and label in s.labels
        }

    def gauge(self, name: str) -> float:
        return self.runner.metrics.registry.get_sample_value(name)

    def assert_ended_once(self, outcome: str, reason: str, *, stopped: bool, reached: bool | None) -> None:
        """The one request ended exactly once, counted under `outcome` and `reason`, and holds nothing anywhere.

        stopped: the backend had to stop it (it was running there). reached: whether it got to the backend (None:
        either is right)."""
        backend, balancer = self.backend, self.runner.balancer
        if reached is not None:
            assert bool(backend.started) == reached, backend.started
        if stopped:
            assert backend.started and backend.aborted == backend.started, "the backend must stop it, once"
        else:
            assert backend.aborted == []
        if not backend.started:
            assert backend.abort_calls == [], "nothing to abort in a backend that never had it"
        assert backend.used == {}, "its KV must be free"
        assert (balancer.num_running, balancer.num_waiting) == (0, 0)
        assert balancer.free_blocks() == [TOTAL_BLOCKS], "its reservation must be returned"
        assert self.counted("amoe_coordinator_requests", "outcome") == {outcome: 1}
        assert self.counted("amoe_requests_finished", "reason") == {reason: 1}
        assert self.gauge("amoe_requests_running") == self.gauge("amoe_requests_waiting") == 0
        assert self.runner._live == {}


async def until(predicate: Callable[[], bool]) -> None:
    """Yield loop turns until `predicate` holds (the test's timeout bounds it)."""
    while not predicate():
        await asyncio.sleep(0)


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def holds(fragment: bytes) -> Callable[[dict], bool]:
    """Hold the first response message whose body contains `fragment` (or the response start, for b"")."""
    if not fragment:
        return lambda m: m["type"] == "http.response.start"
    return lambda m: fragment in m.get("body", b"")


# ---- the points a client can leave at. Each brings the request there; leaving follows.


async def tokenizing(h: Harness, client: ScriptedClient) -> None:
    client.leave()  # gone before the prompt is even tokenized: noticed once the request waits for anything


async def waiting_for_kv(h: Harness, client: ScriptedClient) -> None:
    await until(lambda: h.runner.balancer.num_waiting == 1)


async def before_the_first_token(h: Harness, client: ScriptedClient) -> None:
    await until(lambda: h.backend.reading)


async def between_tokens(h: Harness, client: ScriptedClient) -> None:
    await until(lambda: h.backend.reading)
    h.backend.emit()
    # Taken, handed on (sent, when streaming), and the stream waits for the next one.
    await until(lambda: h.backend.reading and h.backend.delivered[h.backend.started[0]] == 1)


async def held(h: Harness, client: ScriptedClient) -> None:
    await until(lambda: client.held)


async def first_token_held(h: Harness, client: ScriptedClient) -> None:
    await until(lambda: h.backend.reading)
    h.backend.emit()
    await until(lambda: client.held)


async def last_token_held(h: Harness, client: ScriptedClient) -> None:
    for _ in range(3):
        await until(lambda: h.backend.reading)
        h.backend.emit()
    await until(lambda: client.held)


def blocked(h: Harness) -> None:
    """Every KV block reserved by someone else: the next request waits."""
    assert h.runner.balancer.try_admit(BLOCKER, TOTAL_BLOCKS * BLOCK) == 0


# (name, endpoint, stream, point, hold, stuck, finished first, reached the backend: None if either is right)
NON_STREAMING = [
    ("tokenizing", "completions", False, tokenizing, None, False, False, None),
    ("waiting for KV", "completions", False, waiting_for_kv, None, False, False, False),
    ("before the first token", "completions", False, before_the_first_token, None, False, False, True),
    ("between tokens", "completions", False, between_tokens, None, False, False, True),
    ("chat: between tokens", "chat", False, between_tokens, None, False, False, True),
    ("response not yet sent", "completions", False, last_token_held, holds(b""), False, True, True),
    # No "admitted, not yet running": the task that runs it starts the backend's stream before anything else can
    # notice the client leaving.
]
STREAMING = [
    ("tokenizing", "completions", True, tokenizing, None, False, False, None),
    ("waiting for KV", "completions", True, waiting_for_kv, None, False, False, False),
    # Once a held message goes out (the client is gone), anyio lets the stream take a step before it cancels it:
    # the request may reach the backend first.
    ("response start not yet sent", "completions", True, held, holds(b""), False, False, None),
    ("chat: role chunk not yet sent", "chat", True, held, holds(b'"role"'), False, False, None),
    # A send that stays blocked is cancelled: the event generators never run again, no cancellation reaches them.
    ("chat: role chunk stuck", "chat", True, held, holds(b'"role"'), True, False, False),
    ("before the first token", "completions", True, before_the_first_token, None, False, False, True),
    ("first token not yet sent", "completions", True, first_token_held, holds(b'"a"'), False, False, True),
    ("first token stuck", "completions", True, first_token_held, holds(b'"a"'), True, False, True),
    ("between tokens", "completions", True, between_tokens, None, False, False, True),
    ("chat: between tokens", "chat", True, between_tokens, None, False, False, True),
    ("last token not yet sent", "completions", True, last_token_held, holds(b'"length"'), False, True, True),
    ("[DONE] not yet sent", "completions", True, last_token_held, holds(b"[DONE]"), False, True, True),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("endpoint", "stream", "point", "hold", "stuck", "finished_first", "reached"),
    [case[1:] for case in NON_STREAMING + STREAMING],
    ids=[f"{'stream' if c[2] else 'whole'}: {c[0]}" for c in NON_STREAMING + STREAMING],
)
def test_a_client_leaving_at_any_await_point_ends_its_request_once(
    endpoint, stream, point, hold, stuck, finished_first, reached
):
    async def scenario():
        h = Harness()
        if point is waiting_for_kv:
            blocked(h)
        client = h.client(endpoint, stream, hold, stuck)
        client.start()
        await point(h, client)
        client.leave()
        await client.task
        if point is waiting_for_kv:  # the blocks it waited for come free: nobody may take them now
            h.runner.balancer.release(BLOCKER)
        # Checked at once: not after a garbage-collected generator's finalizer may have closed its stream.
        outcome, reason = ("success", "length") if finished_first else ("aborted", "abort")
        stopped = bool(h.backend.started) and not finished_first
        h.assert_ended_once(outcome, reason, stopped=stopped, reached=reached)

    run(scenario())


# ---- CPython gh-86296: `asyncio.wait_for` (Python <= 3.11) returns the result and drops a cancellation that
# arrives in the same loop turn as the awaited result. On the token path that let a request whose client had
# left run on to max_tokens (what made test_api_server's disconnect test flaky). Here the client leaves a few loop
# turns after a token arrives (before it, if negative); the old code lost the cancellation at -2, -1, 2 and 3.


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("offset", range(-3, 7))
def test_a_client_leaving_in_the_loop_turns_around_a_token_still_aborts(offset, stream):
    async def scenario():
        h = Harness()
        client = h.client("completions", stream, max_tokens=50)
        client.start()
        await between_tokens(h, client)
        first, second = (h.backend.emit, client.leave) if offset >= 0 else (client.leave, h.backend.emit)
        first()
        await turns(abs(offset))
        second()
        h.backend.free_running = True  # a request nobody stops now runs to max_tokens
        await client.task
        assert h.backend.finished == [], "the request ran to max_tokens after its client left"
        h.assert_ended_once("aborted", "abort", stopped=True, reached=True)

    run(scenario())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("offset", range(-3, 7))
def test_a_client_leaving_in_the_loop_turns_around_its_admission_leaves_no_reservation(offset, stream):
    """The KV a request waited for comes free `offset` loop turns before its client leaves (after, if negative)."""

    async def scenario():
        h = Harness()
        blocked(h)
        client = h.client("completions", stream, max_tokens=50)
        client.start()
        await waiting_for_kv(h, client)
        grant = lambda: h.runner.balancer.release(BLOCKER)  # noqa: E731
        first, second = (grant, client.leave) if offset >= 0 else (client.leave, grant)
        first()
        await turns(abs(offset))
        second()
        h.backend.free_running = True
        await client.task
        assert h.backend.finished == [], "the request ran to max_tokens after its client left"
        h.assert_ended_once("aborted", "abort", stopped=bool(h.backend.started), reached=None)

    run(scenario())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("offset", range(4))
def test_the_token_wait_does_not_lose_a_cancellation_that_comes_with_a_token(offset):
    """The runner alone, below the API's abort: a task reading a request's output and cancelled `offset` loop
    turns after a token arrives ends cancelled, instead of reading on."""

    async def scenario():
        h = Harness()
        body = CompletionRequest(model=MODEL, prompt="hi", max_tokens=50)
        lifetime = h.runner.open(
            prepare_completion(body, CharTokenizer(roles=False), h.model, 1), "completions"
        )
        await h.runner.admit(lifetime)

        async def read():
            async for _ in h.runner.run(lifetime):
                pass

        reader = asyncio.create_task(read())
        await until(lambda: h.backend.reading)
        h.backend.emit()
        await turns(offset)
        reader.cancel()
        h.backend.free_running = True
        await asyncio.wait({reader})
        assert reader.cancelled(), "the cancellation was lost: the request ran on"
        h.assert_ended_once("aborted", "abort", stopped=True, reached=True)

    run(scenario())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stream_that_loses_the_cancellation_is_still_aborted(stream):
    """The abort is a direct call, not left to a cancellation reaching the backend's stream."""

    async def scenario():
        h = Harness()
        h.backend.loses_a_cancellation = True
        client = h.client("completions", stream, max_tokens=50)
        client.start()
        await between_tokens(h, client)
        client.leave()
        h.backend.free_running = True
        await client.task
        assert h.backend.finished == [], "the request ran to max_tokens after its client left"
        h.assert_ended_once("aborted", "abort", stopped=True, reached=True)

    run(scenario())


# ---- the other ways a request ends go through the same owner


async def served(h: Harness, client: ScriptedClient, before_the_end=None) -> None:
    """Serve `client`'s request with tokens coming freely, after `before_the_end(h, client)` if given."""
    client.start()
    if before_the_end is not None:
        await before_the_end(h, client)
    h.backend.free_running = True
    if h.backend.reading:  # waiting since before free running: give it its next token
        h.backend.emit()
    await client.task


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_found_here_aborts_the_request_in_the_backend(stream):
    async def scenario():
        h = Harness()
        client = h.client("completions", stream, max_tokens=6, stop="c")
        await served(h, client)
        assert client.status == 200 and '"stop"' in client.text and '"c"' not in client.text
        h.assert_ended_once("success", "stop", stopped=True, reached=True)

    run(scenario())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_the_server_drains_is_aborted_in_the_backend(stream):
    async def scenario():
        h = Harness()
        client = h.client("completions", stream)
        client.start()
        await between_tokens(h, client)
        abort_all(h.app)
        await client.task
        assert client.status == 200 and '"finish_reason":"abort"' in client.text
        h.assert_ended_once("aborted", "abort", stopped=True, reached=True)

    run(scenario())


@pytest.mark.timeout(20)
def test_a_request_the_server_drains_before_it_ran_never_reaches_the_backend():
    async def scenario():
        h = Harness()
        client = h.client("chat", True, hold=holds(b'"role"'))
        client.start()
        await held(h, client)  # admitted; its stream has not asked the backend for anything yet
        abort_all(h.app)
        client.resume()
        await client.task
        assert client.status == 200 and '"finish_reason":"abort"' in client.text
        h.assert_ended_once("aborted", "abort", stopped=False, reached=False)

    run(scenario())


@pytest.mark.timeout(20)
def test_a_request_waiting_for_kv_when_the_server_drains_gets_503():
    async def scenario():
        h = Harness()
        blocked(h)
        client = h.client("completions", False)
        client.start()
        await waiting_for_kv(h, client)
        abort_all(h.app)
        await client.task
        h.runner.balancer.release(BLOCKER)
        assert client.status == 503 and "shutting down" in client.text
        h.assert_ended_once("aborted", "abort", stopped=False, reached=False)

    run(scenario())


@pytest.mark.timeout(20)
def test_a_stalled_request_ends_with_504_and_is_aborted_in_the_backend():
    async def scenario():
        h = Harness(stall_timeout_s=0.05)  # and no token ever comes
        client = h.client("completions", False)
        client.start()
        await client.task
        assert client.status == 504 and "no token" in client.json()["error"]["message"]
        h.assert_ended_once("error", "error", stopped=True, reached=True)

    run(scenario())


@pytest.mark.timeout(20)
def test_a_request_past_its_deadline_while_waiting_for_kv_ends_with_504_and_leaves_the_queue():
    async def scenario():
        h = Harness(request_timeout_s=0.05)
        blocked(h)
        client = h.client("completions", False)
        client.start()
        await client.task
        h.runner.balancer.release(BLOCKER)
        assert client.status == 504 and "KV space" in client.json()["error"]["message"]
        h.assert_ended_once("error", "error", stopped=False, reached=False)

    run(scenario())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_the_backend_fails_is_not_aborted_there_again(stream):
    async def scenario():
        h = Harness()
        h.backend.fail_at = 1
        client = h.client("completions", stream)
        await served(h, client)
        if stream:  # the headers went out before it failed
            assert client.status == 200 and '"request_failed"' in client.text
        else:
            assert client.status == 500 and client.json()["error"]["code"] == "request_failed"
        h.assert_ended_once("error", "error", stopped=False, reached=True)

    run(scenario())


class RefusingBackend(GatedBackend):
    """A backend whose generate() raises at once, before there is a stream (it need not be a generator)."""

    def generate(self, request_id, prompt_token_ids, sampling_params, rank=0):
        raise EngineDeadError("the engine is gone")


@pytest.mark.timeout(20)
def test_a_request_the_backend_refuses_outright_ends_once():
    async def scenario():
        h = Harness(RefusingBackend())
        client = h.client("completions", False)
        await served(h, client)
        assert client.status == 503 and client.json()["error"]["code"] == "engine_dead"
        h.assert_ended_once("error", "error", stopped=False, reached=False)

    run(scenario())


@pytest.mark.timeout(20)
def test_a_request_failing_here_is_aborted_in_the_backend():
    async def scenario():
        h = Harness(detokenizer=CharDetokenizer(fail_on="b"))
        client = h.client("completions", False)
        await served(h, client)
        assert client.status == 500 and "detokenizer bug" in client.text
        h.assert_ended_once("error", "error", stopped=True, reached=True)

    run(scenario())


@pytest.mark.timeout(20)
def test_ending_a_request_twice_aborts_and_counts_it_once():
    async def scenario():
        h = Harness()
        client = h.client("completions", False)
        client.start()
        await before_the_first_token(h, client)
        (lifetime,) = h.runner._live.values()
        assert lifetime.abort("first") and not lifetime.abort("second") and not lifetime.end("error")
        assert h.backend.abort_calls == h.backend.started  # told once, by the first
        await client.task
        assert client.status == 200 and '"finish_reason":"abort"' in client.text
        h.assert_ended_once("aborted", "abort", stopped=True, reached=True)

    run(scenario())


@pytest.mark.parametrize(
    ("error", "status", "kind", "code", "message"),
    [
        (Overloaded("queue full"), 503, "server_error", "overloaded", "queue full"),
        (TimedOut("no token for 1 s"), 504, "server_error", "timeout", "no token for 1 s"),
        (InternalError(KeyError("x")), 500, "server_error", None, "internal server error: KeyError: 'x'"),
    ],
)
def test_the_api_gives_each_request_error_its_status(error, status, kind, code, message):
    """The request room raises its own errors; the API alone turns each into an OpenAI-shaped response."""
    api = from_exception(error)
    assert (api.status, api.info.type, api.info.code, api.info.message) == (status, kind, code, message)

"""LocalBackend: the single-process reference engine on one background thread, behind the coordinator's API.

Threads: the asyncio event loop (API) hands commands to the engine thread through a deque under a condition
variable; the engine thread steps while work exists and sleeps on the condition when idle (no busy spin); its
outputs go back to the loop with `loop.call_soon_threadsafe`, one call per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from amoe.engine.request import EngineOutput
from amoe.errors import AmoeError, EngineDeadError, RequestFailed
from amoe.sampling_params import SamplingParams
from coordinator.requests.backend import Backend, RankKV, TokenDelta

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = (
    30.0  # one engine step on a tiny model takes milliseconds; a stuck step is a bug worth a log
)


class _RequestFailed:
    """Delivered instead of a delta when the engine rejected one request or died."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class LocalBackend(Backend):
    """One attention rank (rank 0): the whole model in this process."""

    def __init__(self, make_engine: Callable[[], Any], block_size: int) -> None:
        self._make_engine = make_engine
        self._block_size = block_size
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Guards _commands and _stopping; the engine thread waits on it when it has nothing to do.
        self._cond = threading.Condition()
        self._commands: deque[tuple] = deque()
        self._stopping = False
        self._error: BaseException | None = None
        self._status = "created"
        self._kv = RankKV(free_blocks=0, total_blocks=0)  # snapshot written by the engine thread only
        self._streams: dict[int, asyncio.Queue] = {}  # request id -> its deltas; event-loop thread only

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def engine(self) -> Any:
        """The engine, for start-up facts (max_model_len, vocab); its state belongs to the engine thread."""
        return self._engine

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._status = "starting"
        logger.info("loading the model")
        self._engine = await asyncio.to_thread(self._make_engine)
        self._snapshot_kv()
        self._thread = threading.Thread(target=self._run, name="amoe-engine", daemon=True)
        self._thread.start()
        self._status = "ok"
        logger.info("engine up: %d KV blocks of %d tokens", self._kv.total_blocks, self._block_size)

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, _JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", _JOIN_TIMEOUT_S)
        if hasattr(self._engine, "close"):
            self._engine.close()  # the expert store's I/O thread, the routing record
        for queue in self._streams.values():
            queue.put_nowait(TokenDelta(finish_reason="abort"))
        if self._status != "dead":
            self._status = "stopped"

    def health(self) -> dict[str, Any]:
        report: dict[str, Any] = {"status": self._status}
        if self._error is not None:
            report["error"] = f"{type(self._error).__name__}: {self._error}"
        report["kv"] = [
            {"rank": 0, "free_blocks": self._kv.free_blocks, "total_blocks": self._kv.total_blocks}
        ]
        return report

    def offload_stats(self) -> dict | None:
        """The engine's expert store counters (a locked snapshot: safe from the event loop), or None."""
        engine = self._engine
        return engine.offload_stats() if engine is not None and hasattr(engine, "offload_stats") else None

    def kv_usage(self) -> list[RankKV]:
        return [self._kv]

    async def generate(
        self, request_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams, rank: int = 0
    ) -> AsyncIterator[TokenDelta]:
        self._check_alive()
        if rank != 0:
            raise ValueError(f"the local backend has only rank 0, not {rank}")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._submit(("add", request_id, prompt_token_ids, sampling_params))
        running = set(range(sampling_params.num_sequences))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, _RequestFailed):
                    finished = True  # the engine no longer holds the request
                    raise item.error
                if item.is_finished:
                    # An abort of the whole request (index None on the engine side) ends every sequence.
                    running.discard(item.index)
                finished = not running
                yield item
        finally:
            # Reached early on cancellation or when the consumer stops reading: free the KV blocks now.
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: int) -> None:
        self._submit(("abort", request_id, None))

    def abort_sequence(self, request_id: int, index: int) -> None:
        self._submit(("abort", request_id, index))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine thread died: {type(self._error).__name__}: {self._error}")
        if self._status != "ok" or self._stopping:
            raise EngineDeadError(f"the engine is not serving (status: {self._status})")

    def _submit(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ---- the engine thread

    def _run(self) -> None:
        try:
            while (commands := self._wait_for_work()) is not None:
                self._apply(commands)
                outputs = self._step()
                self._snapshot_kv()  # before publishing: whoever these outputs wake sees the KV they left
                self._publish(outputs)
        except BaseException as exc:  # noqa: BLE001 - any engine failure must fail requests, not hang them
            self._die(exc)

    def _step(self) -> list[Any]:
        """One engine step; if it raises, the requests it was running fail (their KV freed) and the engine
        serves on: one bad step must not take every later request down."""
        if not self._engine.has_unfinished():
            return []
        try:
            return self._engine.step()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            failed = self._engine.abort_all()
            logger.exception("an engine step failed; failing requests %s", failed)
            error = RequestFailed(f"{type(exc).__name__}: {exc}")
            self._post(self._deliver, [(rid, _RequestFailed(error)) for rid in failed])
            return []

    def _wait_for_work(self) -> list[tuple] | None:
        """The pending commands, after sleeping while idle; None once stopping."""
        with self._cond:
            while not (self._commands or self._stopping or self._engine.has_unfinished()):
                self._cond.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, commands: list[tuple]) -> None:
        for command in commands:
            if command[0] == "abort":
                _, request_id, index = command
                family = [index] if index is not None else self._engine.sequences(request_id)
                if self._engine.abort(request_id, index) is not None:
                    # A stream still being read ends with finish_reason "abort", on each sequence it stopped.
                    self._publish([EngineOutput(request_id, [], True, "abort", index=i) for i in family])
                continue
            _, request_id, prompt_token_ids, params = command
            try:
                self._engine.add_request(request_id, prompt_token_ids, params)
            except AmoeError as exc:  # a bad request fails alone; the engine serves on
                self._post(self._deliver, [(request_id, _RequestFailed(exc))])
            except Exception as exc:  # noqa: BLE001 - so does one whose admission hits a bug
                logger.exception("request %d failed on admission", request_id)
                error = RequestFailed(f"{type(exc).__name__}: {exc}")
                self._post(self._deliver, [(request_id, _RequestFailed(error))])

    def _publish(self, outputs: list[Any]) -> None:
        deltas = [
            (
                out.request_id,
                TokenDelta(
                    list(out.new_token_ids),
                    out.finish_reason if out.finished else None,
                    out.index,
                    out.logprobs,
                    out.prompt_logprobs,
                ),
            )
            for out in outputs
        ]
        if deltas:
            self._post(self._deliver, deltas)

    def _snapshot_kv(self) -> None:
        blocks = _block_manager(self._engine)
        self._kv = RankKV(free_blocks=blocks.num_free_blocks, total_blocks=blocks.num_total_blocks)

    def _die(self, exc: BaseException) -> None:
        logger.error("the engine thread died; failing every request", exc_info=exc)
        self._error = exc
        self._status = "dead"
        self._post(self._fail_all, exc)

    def _post(self, callback: Callable, arg: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(callback, arg)

    # ---- back on the event loop

    def _deliver(self, deltas: list[tuple[int, Any]]) -> None:
        for request_id, delta in deltas:
            queue = self._streams.get(request_id)
            if queue is not None:  # else aborted meanwhile
                queue.put_nowait(delta)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(
                _RequestFailed(EngineDeadError(f"the engine thread died: {type(exc).__name__}: {exc}"))
            )


def _block_manager(engine: Any) -> Any:
    return engine.blocks

"""A served cluster driven from plain Python: the real launcher (the coordinator's cluster manager and backend, one
`amoe.runtime.worker` process per runtime) on a private event loop thread, with blocking calls for tests and
experiments that want token ids rather than HTTP."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from amoe.config import AmoeConfig
from amoe.errors import EngineDeadError
from amoe.sampling_params import SamplingParams
from coordinator.requests.backend import TokenDelta
from coordinator.requests.cluster_backend import ClusterBackend


class ServedCluster:
    """The runtimes `config` asks for, serving `model_dir`; prompt i goes to attention rank i mod A."""

    def __init__(self, model_dir: str | Path, config: AmoeConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="amoe-served-cluster", daemon=True
        )
        self.backend = ClusterBackend(config, model_dir)
        self._ids = itertools.count(1)

    def _call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the cluster's event loop (where the backend lives) and return its result."""
        return self._call(coro, timeout)

    def start(self) -> ServedCluster:
        self._thread.start()
        try:
            self._call(self.backend.start())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Shut every runtime down and end the loop thread; idempotent."""
        if self._thread.is_alive():
            self._call(self.backend.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None, timeout: float = 120.0
    ) -> list[list[int]]:
        """Token ids generated for each prompt, all in flight at once."""
        params = params or SamplingParams(temperature=0)
        num_ranks = len(self.backend.cluster.attn_runtimes)
        return self._call(self._generate_all(prompts, params, num_ranks), timeout)

    def deltas(
        self, prompts: list[list[int]], params: SamplingParams, timeout: float = 120.0
    ) -> list[list[TokenDelta]]:
        """Each prompt's deltas as the coordinator gets them (tokens, log-probabilities), all in flight at once."""
        num_ranks = len(self.backend.cluster.attn_runtimes)
        return self._call(self._deltas_all(prompts, params, num_ranks), timeout)

    async def _generate_all(self, prompts, params, num_ranks) -> list[list[int]]:
        deltas = await self._deltas_all(prompts, params, num_ranks)
        return [[t for delta in each for t in delta.token_ids] for each in deltas]

    async def _deltas_all(self, prompts, params, num_ranks) -> list[list[TokenDelta]]:
        async def one(i: int, prompt: list[int]) -> list[TokenDelta]:
            generate = self.backend.generate(next(self._ids), prompt, params, rank=i % num_ranks)
            return [delta async for delta in generate]

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    def runtime_stats(self, settled: bool = True, timeout: float = 10.0) -> list[dict]:
        """Each runtime's latest report (docs/CONTRACTS.md "Runtime stats"); with `settled`, waits for a report
        from every runtime sent after this call (heartbeats come every 0.5 s) that shows nothing in flight,
        EngineDeadError after `timeout`. A report from before the call can predate the work the caller just did:
        an idle report from before any traffic reads as settled with nothing counted."""
        deadline = time.monotonic() + timeout
        before = {r["runtime"]: r.get("uptime_s", -1.0) for r in self._call(_stats(self.backend))}
        while True:
            reports = self._call(_stats(self.backend))
            fresh = all(r.get("uptime_s", 0.0) > before.get(r["runtime"], -1.0) for r in reports)
            if not settled or (len(reports) == len(self.backend.cluster.active) and fresh and _idle(reports)):
                return reports
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the runtimes did not settle within {timeout} s: {reports}")
            time.sleep(0.1)


async def _stats(backend: ClusterBackend) -> list[dict]:
    return backend.runtime_stats()


def _idle(reports: list[dict]) -> bool:
    return all(
        r.get("pool_entries", 0) == 0
        and r.get("dispatch_pending", 0) == 0
        and r.get("comm", {}).get("in_flight_recv", 0) == 0
        and sum(r.get("depth", {}).values()) == 0
        for r in reports
    )

"""The runtime table of the cluster manager: one RuntimeProc per runtime (its current process and what the
control plane last heard from it), the budget of replacements self-healing may spend, and what the cluster tells
its backend (ClusterEvents)."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from amoe import wire
from coordinator.cluster.launcher import RuntimeHandle, exit_text


@dataclass
class RuntimeProc:
    """One runtime (its current process) as the coordinator sees it."""

    id: int
    role: str  # "attention" | "expert"
    proc: RuntimeHandle  # its current process
    endpoint: str | None = None  # set by Hello, with the four below
    secure_endpoint: str | None = None  # multi-node: its CURVE endpoint, for runtimes on other nodes
    num_kv_blocks: int = 0
    max_model_len: int = 0
    vocab_size: int = 0
    kv_free: int = 0  # the latest of its heartbeat and token reports
    spawned: int = 0  # generation of its latest process: 0 first, +1 per replacement
    generation: int = 0  # generation of the process behind `endpoint` (set by Hello)
    ready: bool = False
    last_seen: float = field(default_factory=time.monotonic)  # any message (the control thread is alive)
    polls: int = 0  # the loop thread's progress counter, from heartbeats
    progressed: float = field(default_factory=time.monotonic)  # when it last moved (the loop is alive)
    stats: dict[str, Any] | None = None
    lost: str | None = None  # why it is being replaced (None: it is not)
    lost_at: float = 0.0
    restarts: int = 0
    # Elastic runtimes (coordinator/cluster/scaling.py): started by `amoe scale` and not Ready yet (a loss then
    # fails the join instead of being healed: it never served), and why it failed; retired: stopped and
    # forgotten, its id a free slot the next join takes.
    joining: bool = False
    join_error: str | None = None
    retired: bool = False

    @property
    def name(self) -> str:
        return f"{self.role} runtime {self.id}"

    @property
    def identity(self) -> bytes:
        """Its control socket's ZeroMQ identity (its loop thread's sends come from "<identity>.out")."""
        return f"rt{self.id}".encode()

    def describe(self) -> dict[str, Any]:
        code = self.proc.poll()
        return {
            "runtime": self.id,
            "role": self.role,
            "pid": self.proc.pid,
            "alive": code is None,
            "exit": None if code is None else exit_text(code),
            "ready": self.ready,
            "restarts": self.restarts,
            "replacing": self.lost,
            "heartbeat_age_s": round(time.monotonic() - self.last_seen, 3),
            "loop_progress_age_s": round(time.monotonic() - self.progressed, 3),
        }


class ClusterEvents(Protocol):
    """What the cluster tells its backend (all on the event loop)."""

    def on_tokens(self, msg: wire.TokenOut) -> None: ...

    def on_lost(self, runtime: RuntimeProc, reason: str) -> None:
        """A runtime is gone and being replaced."""

    def on_rejoined(self, runtime: RuntimeProc) -> None:
        """Its replacement is connected and serving."""

    def on_death(self, reason: str) -> None:
        """The cluster cannot serve any more."""


class RestartBudget:
    """At most `limit` restarts in any `window_s` seconds."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit, self.window_s = limit, window_s
        self._times: collections.deque[float] = collections.deque()

    def take(self) -> bool:
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True

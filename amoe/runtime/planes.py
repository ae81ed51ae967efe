"""A runtime's tensor-plane groups (gloo / nccl): one per peer, so that a replaced runtime gets new groups with its
peers while the survivors keep theirs (docs/communicator.md, "Groups per peer").

The pair (i, j) meets through a PrefixStore keyed by the pair and both processes' generations (0 for the first
process of a rank, +1 per replacement) over the FileStore in the coordinator's private run directory: gloo gets one
two-member group per pair, NCCL two, one per direction (a large message each way must not wait for the other's
receive on one NCCL stream). Every build runs on a thread of its own, so nobody's control thread ever waits on a
peer (a survivor keeps sending heartbeats while its replaced peer loads), and a build whose peer was replaced again
meanwhile only holds its own thread until its timeout. Builds of different pairs never wait on each other: each
blocks on its own pair only. Meanwhile the communicator parks what it would send over a link not built yet and
posts the receives announced on it once it comes.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import torch

logger = logging.getLogger(__name__)


def pair_prefix(rank: int, peer: int, generations: dict[int, int]) -> str:
    """The store prefix both members of a pair compute alike: the pair, lower runtime first, and both
    processes' generations."""
    lo, hi = sorted((rank, peer))
    return f"amoe/pair/{lo}-{hi}/{generations[lo]}-{generations[hi]}"


class PeerGroups:
    """Builds the group(s) of runtime `rank` (process `generation`) with each peer and hands them to `comm`."""

    def __init__(
        self, comm: Any, rank: int, generation: int, store_path: str, plane: str, timeout_s: float
    ) -> None:
        import torch.distributed as dist

        self._dist = dist
        # world_size -1: no FileStore ever deletes the file. With a count, the last of that many stores to close
        # removes it, and a replacement must still meet its peers there; the coordinator removes the run dir.
        self._store = dist.FileStore(store_path, -1)
        self.comm, self.rank, self.generation, self.plane = comm, rank, generation, plane
        # NCCL: the runtime's device, current since before the communicator was made (amoe.runtime.build.device)
        self.device = torch.device("cuda", torch.cuda.current_device()) if plane == "nccl" else None
        self.timeout = timedelta(seconds=timeout_s)
        # gloo: one transport device (its socket loop thread) for every pair, as one world group would have
        self._gloo_device = dist.ProcessGroupGloo.create_default_device() if plane == "gloo" else None
        self._lock = threading.Lock()  # the control thread asks for builds, build threads report
        self._wanted: dict[int, int] = {}  # peer -> the generation of its process the link must reach
        self._failed: str | None = None  # why a start-up build failed

    def connect(self, generations: list[int] | dict[int, int]) -> None:
        """Start building a link to every peer there is (start-up); `generations[r]` is runtime r's process
        generation. A slot no runtime holds (absent from a dict) gets its link when one joins (`rebuild`)."""
        pairs = generations.items() if isinstance(generations, dict) else enumerate(generations)
        for peer, generation in pairs:
            if peer != self.rank:
                self._start(peer, generation, first=True)

    def rebuild(self, peer: int, generation: int) -> None:
        """`peer` was replaced by its process of `generation` (comm.reconnect named it): build the new link."""
        self._start(peer, generation, first=False)

    def linked(self) -> bool:
        """Every peer has its link."""
        return not self.comm.unlinked_peers()

    def check(self) -> None:
        """Raise if a start-up build failed (a rebuild's failure only shows as its peer's transfers time out)."""
        if self._failed is not None:
            raise RuntimeError(self._failed)

    def _start(self, peer: int, generation: int, first: bool) -> None:
        with self._lock:  # see _lock
            self._wanted[peer] = generation
        threading.Thread(
            target=self._build, args=(peer, generation, first), name=f"amoe-pair-{peer}", daemon=True
        ).start()

    def _build(self, peer: int, generation: int, first: bool) -> None:
        generations = {self.rank: self.generation, peer: generation}
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)  # per thread: the groups and the warm-up live there
            groups = self._make(peer, pair_prefix(self.rank, peer, generations))
            self._warm_up(groups, peer)
        except Exception as exc:  # noqa: BLE001 - reported below: a start-up failure fails the runtime
            with self._lock:  # see _lock
                wanted = self._wanted.get(peer) == generation
                if wanted and first:
                    self._failed = f"no {self.plane} group with runtime {peer}: {type(exc).__name__}: {exc}"
            level = logging.WARNING if wanted else logging.DEBUG  # else: that process was replaced again
            logger.log(level, "runtime %d: no %s group with runtime %d (generation %d): %s", self.rank,
                       self.plane, peer, generation, exc)  # fmt: skip
            return
        if self.comm.set_peer_group(peer, groups, generation):
            logger.debug("runtime %d: %s link to runtime %d (generation %d) up", self.rank, self.plane, peer,
                         generation)  # fmt: skip
        else:
            logger.debug("runtime %d: a %s link to a replaced process of runtime %d dropped", self.rank,
                         self.plane, peer)  # fmt: skip

    def _make(self, peer: int, prefix: str) -> Any:
        """The pair's group (gloo: one for both directions) or groups (NCCL: (up, down)); blocks until the peer
        meets it. In them the lower runtime is rank 0."""
        dist, rank = self._dist, 0 if self.rank < peer else 1
        if self.plane == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._devices, options._timeout = [self._gloo_device], self.timeout
            options._threads = 1  # its threads run collectives; P2P transfers need none
            return dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._store), rank, 2, options)
        groups = []
        for direction in ("up", "down"):  # up: from the lower runtime to the higher
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            options.group_name = f"{prefix}/{direction}"
            store = dist.PrefixStore(f"{prefix}/{direction}", self._store)
            groups.append(dist.ProcessGroupNCCL(store, rank, 2, options))
        return tuple(groups)

    def _warm_up(self, groups: Any, peer: int) -> None:
        """One small transfer each way before the link is handed over: NCCL sets its communicators up here rather
        than on the first real send (which would block the dispatcher), and a link is known to carry data. Both
        members post in the same group order (up, then down), so neither waits on the other's second group."""
        up, down = groups if isinstance(groups, tuple) else (groups, groups)
        other = 1 if self.rank < peer else 0
        mine = torch.full((1,), float(self.rank), device=self.device)
        theirs = torch.full((1,), -1.0, device=self.device)
        if self.rank < peer:
            works = [up.send([mine], other, 0), down.recv([theirs], other, 0)]
        else:
            works = [up.recv([theirs], other, 0), down.send([mine], other, 0)]
        for work in works:
            work.wait()
        if self.device is not None:
            torch.cuda.current_stream(self.device).synchronize()
        if int(theirs.item()) != peer:
            raise RuntimeError(f"the warm-up transfer from runtime {peer} carried {theirs.item()}")

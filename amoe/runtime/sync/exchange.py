"""Tagged messages and the barrier exchange of the synchronous modes (`ep`, `pingpong`).

Every message of a synchronous mode starts with one *tag row* naming the exchange it belongs to, so a message
with zero payload rows still says which (iteration, block, phase, micro-batch) it completes, and a fast peer's
message for a later exchange is buffered instead of being mistaken for the current one. Tag row fields (RowMeta):

    request_id = iteration      block = block           index = micro-batch    slot = phase (BEGIN/DISPATCH/COMBINE)
    kind = EXPERT for DISPATCH, else ATTN               chunk_len = 0 (payload rows always have chunk_len >= 1)
    attn_rank = sender rank     position = info (BEGIN: the sender's rows this iteration)
    chunk_start = flags (BEGIN: 1 = the sender stops after this exchange)

The tag row's data is a zero row; payload rows follow it in the message's tensor.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from amoe import core
from amoe.errors import EngineDeadError

logger = logging.getLogger(__name__)

BEGIN, DISPATCH, COMBINE = 0, 1, 2
_PHASE_NAMES = ("begin", "dispatch", "combine")
_RECV_SLICE_S = 0.5  # a waiting gather re-checks its deadline at least this often


@dataclass(frozen=True)
class Tag:
    """Which exchange a message belongs to."""

    iteration: int
    block: int
    phase: int
    micro: int = 0

    def __str__(self) -> str:
        return f"(it {self.iteration}, block {self.block}, {_PHASE_NAMES[self.phase]}, mb {self.micro})"


@dataclass
class Parcel:
    """A received message without its tag row: payload metadata (dict of [n] tensors) and data [n, ...]."""

    src: int
    tag: Tag
    info: int
    flags: int
    meta: dict[str, torch.Tensor]
    data: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]


class Exchanger:
    """Sends tagged messages and gathers, per tag, one message from each of a set of peers.

    A gather that is not complete within `timeout_s` raises EngineDeadError naming the missing peers, so a dead
    peer stops the loop instead of hanging it. Messages to this rank itself skip the communicator.
    """

    def __init__(self, comm: core.Communicator, rank: int, timeout_s: float = 10.0) -> None:
        self.comm = comm
        self.rank = rank
        self.timeout_s = timeout_s
        self._pending: dict[Tag, dict[int, Parcel]] = defaultdict(dict)
        self.num_dropped = 0

    def send(
        self,
        dest: int,
        tag: Tag,
        data: torch.Tensor | None = None,
        rows: dict[str, torch.Tensor] | None = None,
        *,
        info: int = 0,
        flags: int = 0,
    ) -> None:
        """Send payload `data [n, H]` with per-row metadata `rows` (make_message fields) to `dest`."""
        if data is None:
            data = torch.zeros(0, 1)
        if dest == self.rank:
            meta = rows if rows is not None else {}
            self._file(Parcel(self.rank, tag, info, flags, meta, data))
            return
        self.comm.send(dest, _message(self.rank, tag, data, rows, info, flags))

    def gather(self, tag: Tag, sources: Iterable[int]) -> dict[int, Parcel]:
        """One parcel of `tag` from every source, keyed by source rank; waits at most timeout_s."""
        sources = set(sources)
        deadline = time.monotonic() + self.timeout_s
        while missing := sources - self._pending[tag].keys():
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError(
                    f"runtime {self.rank}: no message {tag} from peer(s) {sorted(missing)} "
                    f"within {self.timeout_s:g} s; a peer died or stopped"
                )
            for msg in self.comm.recv(min(left, _RECV_SLICE_S)):
                self._receive(msg)
        return self._pending.pop(tag)

    def _receive(self, msg: core.Message) -> None:
        meta = msg.meta()
        if msg.num_rows < 1 or int(meta["chunk_len"][0]) != 0:
            self.num_dropped += 1
            logger.warning("[sync] runtime %d dropped a message without a tag row", self.rank)
            return
        tag = Tag(
            int(meta["request_id"][0]), int(meta["block"][0]), int(meta["slot"][0]), int(meta["index"][0])
        )
        payload = {k: v[1:] for k, v in meta.items()}
        src = int(meta["attn_rank"][0])
        self._file(
            Parcel(src, tag, int(meta["position"][0]), int(meta["chunk_start"][0]), payload, msg.data[1:])
        )

    def _file(self, parcel: Parcel) -> None:
        got = self._pending[parcel.tag]
        if parcel.src in got:
            self.num_dropped += 1
            logger.warning(
                "[sync] runtime %d dropped a duplicate %s from %d", self.rank, parcel.tag, parcel.src
            )
            return
        got[parcel.src] = parcel


def _message(
    rank: int, tag: Tag, data: torch.Tensor, rows: dict[str, torch.Tensor] | None, info: int, flags: int
) -> core.Message:
    """The wire message: the tag row, then the payload rows."""
    n = data.shape[0]
    rows = rows or {}
    head = {
        "request_id": tag.iteration,
        "kind": core.EXPERT if tag.phase == DISPATCH else core.ATTN,
        "block": tag.block,
        "index": tag.micro,
        "position": info,
        "chunk_start": flags,
        "chunk_len": 0,
        "slot": tag.phase,
        "attn_rank": rank,
    }
    cols = {}
    for name, value in head.items():
        payload = rows.get(name)
        tail = torch.zeros(n, dtype=torch.int64) if payload is None else torch.as_tensor(payload).reshape(n)
        cols[name] = torch.cat([torch.tensor([value]), tail.to(torch.int64)])
    cols["chunk_len"][1:] = cols["chunk_len"][1:].clamp(min=1)  # payload rows never look like a tag row
    for name, default, dtype in (("expert_id", -1, torch.int64), ("weight", 0.0, torch.float32)):
        payload = rows.get(name)
        tail = (
            torch.full((n,), default, dtype=dtype)
            if payload is None
            else torch.as_tensor(payload, dtype=dtype)
        )
        cols[name] = torch.cat([torch.tensor([default], dtype=dtype), tail.reshape(n)])
    framed = torch.cat([data.new_zeros(1, *data.shape[1:]), data])  # [1 + n, H]
    return core.make_message(framed, **cols)

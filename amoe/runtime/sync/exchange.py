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
from typing import Any

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

    def __init__(
        self, comm: core.Communicator, rank: int, timeout_s: float = 10.0, stats: Any = None
    ) -> None:
        """`stats`: the device's SyncStats, which also count the dropped messages (for the runtime report)."""
        self.comm = comm
        self.rank = rank
        self.timeout_s = timeout_s
        self.stats = stats
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
        framed: torch.Tensor | None = None,
    ) -> None:
        """Send payload `data [n, H]` with per-row metadata `rows` (make_message fields) to `dest`.

        `framed` [1 + n, H] (from frame()) instead of data: a body whose row 0 is left for the tag row, filled in
        place by the caller, so the payload is not copied again to put the tag row in front of it."""
        if dest == self.rank:
            payload = framed[1:] if framed is not None else data if data is not None else torch.zeros(0, 1)
            self._file(Parcel(self.rank, tag, info, flags, rows if rows is not None else {}, payload))
            return
        if framed is None:
            framed = frame(0 if data is None else data.shape[0], data)
            if data is not None:
                framed[1:] = data
        self.comm.send(dest, _message(self.rank, tag, framed, rows, info, flags))

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
            self._drop()
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
            self._drop()
            logger.warning(
                "[sync] runtime %d dropped a duplicate %s from %d", self.rank, parcel.tag, parcel.src
            )
            return
        got[parcel.src] = parcel

    def _drop(self) -> None:
        self.num_dropped += 1
        if self.stats is not None:
            self.stats.count_dropped()


def frame(n: int, like: torch.Tensor | None) -> torch.Tensor:
    """A message body [1 + n, *like.shape[1:]] of like's dtype: row 0 is the tag row (zeros), rows 1.. are for the
    payload. Writing the payload into [1:] (index_select(out=), a scatter) spares one copy of it per message."""
    if like is None:
        return torch.zeros(1 + n, 1)
    body = like.new_empty(1 + n, *like.shape[1:])
    body[0] = 0
    return body


# The int64 RowMeta fields a tag row sets; the payload rows' values come from the sender's `rows`.
_INT_FIELDS = (
    "request_id",
    "kind",
    "block",
    "index",
    "position",
    "chunk_start",
    "chunk_len",
    "slot",
    "attn_rank",
)
_CHUNK_LEN = _INT_FIELDS.index("chunk_len")


def _message(
    rank: int, tag: Tag, framed: torch.Tensor, rows: dict[str, torch.Tensor] | None, info: int, flags: int
) -> core.Message:
    """The wire message: the tag row, then the payload rows (framed [1 + n, ...], row 0 the tag row's data).

    Built as one [fields, 1 + n] matrix instead of a tensor per field: an EP device sends 2 × devices of these
    per block, and per-field tensor ops were most of its host time."""
    n = framed.shape[0] - 1
    rows = rows or {}
    head = (
        tag.iteration, core.EXPERT if tag.phase == DISPATCH else core.ATTN, tag.block, tag.micro,
        info, flags, 0, tag.phase, rank,
    )  # fmt: skip
    ints = torch.zeros(len(_INT_FIELDS), 1 + n, dtype=torch.int64)
    ints[:, 0] = torch.tensor(head)
    for i, name in enumerate(_INT_FIELDS):
        if (payload := rows.get(name)) is not None:
            ints[i, 1:] = torch.as_tensor(payload).reshape(n)
    ints[_CHUNK_LEN, 1:].clamp_(min=1)  # payload rows never look like a tag row
    expert_id = torch.full((1 + n,), -1, dtype=torch.int64)
    weight = torch.zeros(1 + n, dtype=torch.float32)
    if (payload := rows.get("expert_id")) is not None:
        expert_id[1:] = torch.as_tensor(payload).reshape(n)
    if (payload := rows.get("weight")) is not None:
        weight[1:] = torch.as_tensor(payload).reshape(n)
    cols = dict(zip(_INT_FIELDS, ints))
    return core.make_message(framed, expert_id=expert_id, weight=weight, **cols)

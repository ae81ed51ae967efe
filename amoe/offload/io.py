"""Where each expert's bytes lie in the safetensors files, and reads of them that bypass the page cache.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range (relative to the end of the header), then the data. Reading the header is all it takes to find an
expert: no mmap of the file (mapped pages would count as resident memory), no safetensors handle kept open.

Reads go straight into a tensor's buffer with `os.preadv`, which releases the GIL for the system call, so an I/O
thread reads while the compute thread runs its matmuls. With O_DIRECT (where the file system takes it) the kernel
copies from the disk into an aligned staging buffer and never into the page cache; elsewhere the read is buffered
and `posix_fadvise(DONTNEED)` drops the pages it brought in right after.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from amoe.errors import ModelLoadError
from amoe.model import weights as W
from amoe.model.checkpoint import INDEX_FILE, SINGLE_FILE
from amoe.model.spec import ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
ALIGN = 4096  # O_DIRECT's offset, length and buffer alignment (the logical block size is at most this)
CHUNK = 1 << 20  # bytes per O_DIRECT read: the staging buffer's size, whatever an expert's
GAP = 64 << 10  # extents of one file closer than this are read as one span (the gap read and dropped)
Key = tuple[int, int]
T = TypeVar("T", torch.Tensor, int)


@dataclass(frozen=True)
class Extent:
    """`nbytes` bytes at `offset` of `path`: a tensor (or one expert's row of a packed tensor) of `dtype`."""

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertExtents:
    """One expert's projections on disk: gate and up (or the packed gate_up row) fill gate_up [2I, H] in order."""

    gate_up: tuple[Extent, ...]  # one extent (packed) or two (gate, then up)
    down: Extent

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.gate_up) + self.down.nbytes


def read_header(path: Path) -> tuple[int, dict]:
    """(where the data starts, the JSON header) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 1024 * 1024:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from None
    return 8 + length, header


class CheckpointIndex:
    """Every tensor's extent in a checkpoint directory (one file, or shards named by the index)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        files = self._files()
        self._extents: dict[str, Extent] = {}
        for path in sorted(set(files)):
            start, header = read_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = _DTYPES.get(info.get("dtype"))
                if dtype is None:
                    continue  # not an expert dtype we read (the loader names it if a layer needs it)
                lo, hi = info["data_offsets"]
                self._extents[name] = Extent(path, start + lo, hi - lo, dtype, tuple(info["shape"]))

    def _files(self) -> list[Path]:
        index = self.model_dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from None
            return [self.model_dir / f for f in set(weight_map.values())]
        single = self.model_dir / SINGLE_FILE
        if not single.exists():
            raise ModelLoadError(f"{self.model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        return [single]

    def has(self, name: str) -> bool:
        return name in self._extents

    def extent(self, name: str, shape: tuple[int, ...], row: int | None = None) -> Extent:
        """Tensor `name` (or its row `row` along dim 0), checked against `shape`."""
        ext = self._extents.get(name)
        if ext is None:
            raise ModelLoadError(f"{self.model_dir}: tensor {name} is missing from the checkpoint")
        got = ext.shape if row is None else ext.shape[1:]
        if got != tuple(shape) or (row is not None and not 0 <= row < ext.shape[0]):
            raise ModelLoadError(
                f"{ext.path}: tensor {name} has shape {list(ext.shape)}, expected {list(shape)}"
            )
        if row is None:
            return ext
        nbytes = ext.nbytes // ext.shape[0]
        return Extent(ext.path, ext.offset + row * nbytes, nbytes, ext.dtype, got)

    def expert(self, cfg: ModelConfig, block: int, expert: int) -> ExpertExtents:
        """Where routed expert `expert` of `block` lies: one tensor per projection, or a row of the packed ones."""
        shapes = W.expert_shapes(cfg, block, expert)
        (gate, gate_shape), (up, up_shape), (down, down_shape) = shapes.items()
        present = [self._present(n) for n in (gate, up, down)]
        if not self.has(present[0]):
            packed_gate_up, packed_down = W.packed_expert_names(cfg, block)
            if self.has(packed_gate_up):  # transformers' in-memory layout: gate rows first, then up
                both = (2 * gate_shape[0], gate_shape[1])
                return ExpertExtents(
                    (self.extent(packed_gate_up, both, expert),), self.extent(packed_down, down_shape, expert)
                )
        return ExpertExtents(
            (self.extent(present[0], gate_shape), self.extent(present[1], up_shape)),
            self.extent(present[2], down_shape),
        )

    def _present(self, name: str) -> str:
        alias = name.replace(".block_sparse_moe.", ".mlp.")  # transformers 5's spelling of Mixtral's
        return alias if not self.has(name) and self.has(alias) else name


class DiskReader:
    """Reads extents into tensors without leaving them in the page cache. One per I/O thread (its staging buffer
    is its own); files stay open for the reader's life."""

    def __init__(self, direct: bool = True) -> None:
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._fds: dict[tuple[Path, bool], int] = {}
        # Both grown, never shrunk, to what one expert's read needs: buffer_bytes() says how much beforehand.
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._cast = torch.empty(0, dtype=torch.uint8)
        self.bytes_read = 0  # bytes the system calls transferred (O_DIRECT rounds reads out to ALIGN)

    @staticmethod
    def buffer_bytes(experts: Iterable[ExpertExtents], dtype: torch.dtype) -> int:
        """The most memory a reader's own buffers reach reading `experts` into tensors of `dtype`: the O_DIRECT
        staging buffer (one span's aligned blocks, at most CHUNK) and, where the file holds another dtype, the
        largest tensor's bytes as stored (the cast goes through it)."""
        span = cast = 0
        for expert in experts:
            parts = [(ext.path, ext.offset, ext.nbytes) for ext in (*expert.gate_up, expert.down)]
            if any(ext.dtype != dtype for ext in (*expert.gate_up, expert.down)):  # read_all: part by part
                cast = max(cast, *(nbytes for _, _, nbytes in parts))
                runs = [[part] for part in parts]
            else:
                runs = _spans(parts)
            span = max(span, *(_aligned_span(run) for run in runs))
        return (min(CHUNK, span) + ALIGN if span else 0) + cast

    def allocated_bytes(self) -> int:
        """What the reader's buffers hold now (at most buffer_bytes() of what it read)."""
        return self._staging.numel() + self._cast.numel()

    def read(self, ext: Extent, out: torch.Tensor) -> None:
        """The extent's tensor into `out` (contiguous, ext.shape elements), cast to out's dtype if it differs."""
        self.read_all([(ext, out)])

    def read_all(self, parts: list[tuple[Extent, torch.Tensor]]) -> None:
        """Several extents into their tensors. Extents that lie together in one file (an expert's three
        projections usually do) are read as one span, so a copy costs one disk round trip, not three."""
        if any(ext.dtype != out.dtype for ext, out in parts):  # a cast: through the cast buffer, part by part
            for ext, out in parts:
                if self._cast.numel() < ext.nbytes:
                    self._cast = torch.empty(ext.nbytes, dtype=torch.uint8)
                raw = self._cast[: ext.nbytes]  # not the staging buffer: O_DIRECT reads go through that
                self._read_bytes([(ext.path, ext.offset, raw)])
                out.copy_(raw.view(ext.dtype).view(ext.shape))
            return
        self._read_bytes([(ext.path, ext.offset, out.view(-1).view(torch.uint8)) for ext, out in parts])

    def _read_bytes(self, targets: list[tuple[Path, int, torch.Tensor]]) -> None:
        """Bytes at (path, offset) into each uint8 tensor."""
        if self.direct:
            try:
                for span in _spans(targets):
                    self._read_direct(span)
                return
            except OSError as exc:  # EINVAL: this file system (tmpfs, some overlays) refuses O_DIRECT
                logger.info("[offload] O_DIRECT refused (%s): buffered reads + fadvise from now on", exc)
                self.direct = False
        for path, offset, out in targets:
            fd = self._fd(path, direct=False)
            self.bytes_read += _preadv_all(fd, out, offset, need=out.numel())
            # The pages the read brought in are clean: drop them, so the page cache does not become a second,
            # unbudgeted expert cache (which would also make every "disk" read after the first a memory copy).
            os.posix_fadvise(fd, offset, out.numel(), os.POSIX_FADV_DONTNEED)

    def _read_direct(self, span: list[tuple[Path, int, torch.Tensor]]) -> None:
        """One file's nearby targets: aligned reads of at most CHUNK through the staging buffer (so it stays
        small), each chunk's bytes copied to the targets it overlaps."""
        fd = self._fd(span[0][0], direct=True)
        lo = span[0][1] - span[0][1] % ALIGN
        hi = max(offset + out.numel() for _, offset, out in span)
        staging = self._aligned(min(CHUNK, _aligned_span([(p, o, out.numel()) for p, o, out in span])))
        for at in range(lo, hi, CHUNK):
            need = min(CHUNK, hi - at)
            buf = staging[: -(-need // ALIGN) * ALIGN]  # the last chunk reads only the blocks it needs
            got = _preadv_all(fd, buf, at, need=need)
            self.bytes_read += got
            for _, offset, out in span:
                a, b = max(at, offset), min(at + got, offset + out.numel())
                if a < b:
                    out[a - offset : b - offset].copy_(buf[a - at : b - at])

    def _aligned(self, nbytes: int) -> torch.Tensor:
        """A staging buffer of `nbytes` whose address is ALIGN-aligned (grown, never shrunk)."""
        if self._staging.numel() < nbytes + ALIGN:
            self._staging = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        skew = -self._staging.data_ptr() % ALIGN
        return self._staging[skew : skew + nbytes]

    def _fd(self, path: Path, direct: bool) -> int:
        key = (path, direct)
        if key not in self._fds:
            flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
            try:
                self._fds[key] = os.open(path, flags)
            except OSError as exc:
                if direct:
                    raise
                raise ModelLoadError(f"{path}: cannot open for expert reads: {exc.strerror}") from None
        return self._fds[key]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _spans(targets: list[tuple[Path, int, T]]) -> list[list[tuple[Path, int, T]]]:
    """Targets (path, offset, a uint8 tensor or a byte count) grouped into runs that are read as one: same file,
    each starting within GAP of the last's end."""
    spans: list[list[tuple[Path, int, T]]] = []
    end = 0
    for target in sorted(targets, key=lambda t: (str(t[0]), t[1])):
        path, offset, size = target[0], target[1], _nbytes(target[2])
        if spans and spans[-1][0][0] == path and offset - end <= GAP:
            spans[-1].append(target)
            end = max(end, offset + size)
        else:
            spans.append([target])
            end = offset + size
    return spans


def _nbytes(target: torch.Tensor | int) -> int:
    return target if isinstance(target, int) else target.numel()


def _aligned_span(run: list[tuple[Path, int, int]]) -> int:
    """Bytes of the whole ALIGN blocks a run of (path, offset, nbytes) covers: what O_DIRECT reads of it."""
    lo = run[0][1] - run[0][1] % ALIGN
    hi = max(offset + nbytes for _, offset, nbytes in run)
    return -(-(hi - lo) // ALIGN) * ALIGN


def _preadv_all(fd: int, buf: torch.Tensor, offset: int, need: int) -> int:
    """Read into the uint8 tensor `buf` from `offset` until `need` bytes are in (a read may come back short);
    returns the bytes transferred. os.preadv releases the GIL for the system call."""
    view = memoryview(buf.numpy())
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ModelLoadError(
                f"unexpected end of file at byte {offset + done} (wanted {need} from {offset})"
            )
        done += n
    return done

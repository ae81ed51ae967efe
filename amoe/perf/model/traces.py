"""Request traces: each request's arrival time, input and output tokens, from published production traces
(`TRACES`, files under amoe/perf/model/data with their origin in its README), and what the cost model needs of
them: the mean context a decoding request holds, and the steady state a deployment holding them reaches.

The Azure LLM inference traces of 2023 (github.com/Azure/AzurePublicDataset, CC-BY 4.0; Patel et al., "Splitwise",
ISCA 2024) are an hour of two Azure services each: `azure-conv` (a chat service: inputs median 1,020 tokens, outputs
median 129) and `azure-code` (a coding assistant: inputs median 1,469, outputs median 13). The files keep every
request, its arrival in seconds from the trace's first and its token counts (`amoe bench trace-derive`).
"""

from __future__ import annotations

import csv
import gzip
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from amoe.errors import ConfigError

DATA = Path(__file__).resolve().parent / "data"
TRACES = {
    "azure-conv": DATA / "azure_llm_2023_conv.csv.gz",
    "azure-code": DATA / "azure_llm_2023_code.csv.gz",
}
COLUMNS = ("arrival_s", "input_tokens", "output_tokens")


@dataclass(frozen=True)
class RequestTrace:
    """Requests in arrival order: arrival_s [n] (seconds from the first), input and output tokens [n] (≥ 1)."""

    name: str
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def rate(self) -> float:
        """Requests per second over the trace."""
        span = float(self.arrival_s[-1] - self.arrival_s[0])
        return (len(self) - 1) / span if span > 0 else float("inf")

    def mean_decode_context(self) -> float:
        """The mean context of a decode row (decode-only: a request of input I and output O decodes O rows, the
        j-th reading I + j tokens): each request weighted by its rows, as a running deployment holds them."""
        i, o = self.input_tokens.astype(np.float64), self.output_tokens.astype(np.float64)
        return float((o * i + o * (o - 1) / 2).sum() / o.sum())


def load_trace(spec: str) -> RequestTrace:
    """A trace by name (TRACES) or the path of a file of COLUMNS (CSV, gzip-compressed or not)."""
    path = TRACES.get(spec, Path(spec).expanduser())
    if not path.is_file():
        raise ConfigError(f"unknown trace {spec!r}: a name ({', '.join(TRACES)}) or a CSV file of {COLUMNS}")
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or tuple(rows[0]) != COLUMNS:
        raise ConfigError(f"{path}: the first line must be {','.join(COLUMNS)}")
    try:
        data = np.array(rows[1:], dtype=np.float64).reshape(-1, 3)
    except ValueError:
        raise ConfigError(f"{path}: every line after the first must be three numbers") from None
    if not len(data) or (data[:, 1:] < 1).any() or (np.diff(data[:, 0]) < 0).any():
        raise ConfigError(f"{path}: needs requests, in arrival order, of at least one input and output token")
    name = spec if spec in TRACES else path.name
    return RequestTrace(name, data[:, 0], data[:, 1].astype(np.int64), data[:, 2].astype(np.int64))


@dataclass(frozen=True)
class RequestDraw:
    """Requests as a deployment holds them: each one's context now, tokens left to decode and trace index."""

    context: np.ndarray  # [n] tokens of KV its next decode row reads
    left: np.ndarray  # [n] decode rows still to run (≥ 1)
    index: np.ndarray  # [n] its request in the trace


def steady_state(trace: RequestTrace, n: int, rng: np.random.Generator) -> RequestDraw:
    """`n` requests as a running deployment holds them: a request is held for as many steps as it decodes, so it
    is drawn with probability proportional to its output, part-way through it (uniform over its rows)."""
    o = trace.output_tokens
    index = rng.choice(len(trace), size=n, p=o / o.sum())
    age = (rng.random(n) * o[index]).astype(np.int64)  # rows already decoded, uniform on [0, O)
    return RequestDraw(trace.input_tokens[index] + age, o[index] - age, index)

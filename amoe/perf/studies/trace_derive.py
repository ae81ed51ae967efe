"""`amoe bench trace-derive`: a published request trace turned into the file amoe's traces read
(amoe.perf.model.traces: arrival_s, input_tokens, output_tokens), every request kept, nothing fitted.

Reads the Azure LLM inference trace CSVs (github.com/Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_*.csv:
TIMESTAMP, ContextTokens, GeneratedTokens): each request's arrival in seconds from the first (to the microsecond),
its context tokens as input and its generated tokens as output. The gzip stream carries no name or time, so the
same input gives the same bytes.
"""

from __future__ import annotations

import csv
import gzip
import io
from datetime import datetime
from pathlib import Path

from amoe.errors import ConfigError
from amoe.perf.model.traces import COLUMNS

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _seconds(stamp: str) -> float:
    """'2023-11-16 18:17:03.9799600' → seconds since the epoch (the fraction may have more digits than
    datetime parses)."""
    whole, _, frac = stamp.strip().partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp() + float(f"0.{frac or '0'}")


def derive(source: Path) -> bytes:
    """The derived trace's gzip bytes from an Azure trace CSV."""
    with source.open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows or tuple(rows[0]) != AZURE_COLUMNS:
        raise ConfigError(f"{source}: expected the Azure trace's columns {','.join(AZURE_COLUMNS)}")
    stamps = [_seconds(r[0]) for r in rows[1:]]
    first = min(stamps)
    order = sorted(range(len(stamps)), key=lambda i: stamps[i])  # arrival order (the files are, checked here)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for i in order:
        writer.writerow([f"{stamps[i] - first:.6f}", int(rows[i + 1][1]), int(rows[i + 1][2])])
    return gzip.compress(out.getvalue().encode(), mtime=0)


def main(args) -> int:
    """`amoe bench trace-derive SOURCE OUT` (its flags: amoe.perf.studies.commands)."""
    data = derive(Path(args.source))
    Path(args.out).write_bytes(data)
    print(f"{args.out}: {len(data)} bytes")
    return 0

"""The cost model's calibrations: one dated JSON file each, frozen once written (docs/cost-model.md "Calibration").

A calibration holds every constant the cost model fits rather than reads off a datasheet — the fractions of the
datasheet peaks real kernels reach, their fixed costs and the slowdowns measured in serving steps, the exchange
kernels' bandwidths — each with its value, unit, source (URL and the exact table row or figure it was read from)
and how it was derived, beside the raw measurements it was derived from. A changed calibration is a new dated file;
an old one is never edited (tests/test_calibration.py pins each file's hash), so a prediction made with it can be
made again by naming it (`amoe bench frontier --calibration NAME`). `ACTIVE` is the one the model uses.

Constants are grouped by GPU architecture (`KernelConstants`: what DeepSeek's kernels measured on an H800 say of
Hopper, what the AMoE paper's A100 figures say of Ampere); an architecture with no measurement of its own names the
one it borrows (`same_as`), which the file says is an assumption. The exchange constants (`ExchangeConstants`:
DeepEP's tables) are the same for every GPU: they are fractions of a NIC's or NVLink's datasheet bandwidth.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path

from amoe.errors import ConfigError

ACTIVE = "2026-11-29"
DIRECTORY = Path(__file__).resolve().parent
FORMAT = 1
# What every constant entry carries (docs/cost-model.md "Calibration": the file's format).
ENTRY_KEYS = ("value", "unit", "source", "where", "derivation")


@dataclass(frozen=True)
class KernelConstants:
    """One architecture's kernel constants (seconds, fractions of a datasheet peak, or ratios).

    A GEMM kernel of M rows takes slowdown · (gemm_fixed_s + max(FLOPs / (peak · compute_fraction · M / (M +
    half_rows)), bytes / (HBM · memory_fraction))); elementwise work streams `elementwise_passes` hidden rows per
    token (+ `elementwise_passes_per_expert` per expert a token visits) at HBM · memory_fraction; attention's core
    runs at its own fractions; a prefill step's exchange kernels take `prefill_comm_sms` SMs from the compute stream
    while they overlap it and run `prefill_comm_slowdown` times their unit-test time, and its compute stream idles
    `prefill_stream_bubble` of its busy time."""

    compute_fraction: float
    half_rows: float
    memory_fraction: float
    gemm_fixed_s: float
    launch_s: float
    decode_dense_slowdown: float
    decode_grouped_slowdown: float
    prefill_dense_slowdown: float
    prefill_grouped_slowdown: float
    attention_decode_compute_fraction: float
    attention_decode_memory_fraction: float
    attention_prefill_compute_fraction: float
    elementwise_passes: float
    elementwise_passes_per_expert: float
    prefill_comm_sms: int
    prefill_comm_slowdown: float
    prefill_stream_bubble: float


@dataclass(frozen=True)
class ExchangeConstants:
    """EP's exchange kernels (DeepEP's README tables: bandwidth in GB/s by EP size, measured on H800s with one
    400 Gb/s NIC each) and the links' efficiency; `*_fixed_s` are the fixed costs of one collective."""

    ll_dispatch_gbps: tuple[tuple[int, float], ...]
    ll_combine_gbps: tuple[tuple[int, float], ...]
    ll_fixed_s: float
    normal_dispatch_gbps: tuple[tuple[int, float], ...]
    normal_combine_gbps: tuple[tuple[int, float], ...]
    normal_nvlink_dispatch_gbps: float
    normal_nvlink_combine_gbps: float
    measured_nic_gbps: float
    nvlink_fixed_s: float
    link_efficiency: float


@dataclass(frozen=True)
class Calibration:
    """A loaded calibration: its name, each architecture's kernel constants and the exchange constants."""

    name: str
    kernels: tuple[tuple[str, KernelConstants], ...]  # (architecture, constants), borrowed ones resolved
    exchange: ExchangeConstants

    def for_arch(self, arch: str) -> KernelConstants:
        table = dict(self.kernels)
        if arch not in table:
            raise ConfigError(f"calibration {self.name}: no constants for architecture {arch!r}")
        return table[arch]


def names() -> list[str]:
    """The dated calibrations there are, oldest first."""
    return sorted(p.stem for p in DIRECTORY.glob("*.json"))


def path_of(name: str) -> Path:
    return DIRECTORY / f"{name}.json"


def load_raw(name: str) -> dict:
    """The file's JSON, or a ConfigError naming the calibrations there are."""
    p = path_of(name)
    if not p.is_file():
        raise ConfigError(f"unknown calibration {name!r}; choose from {', '.join(names())}")
    return json.loads(p.read_text())


@functools.lru_cache(maxsize=8)
def load(name: str = ACTIVE) -> Calibration:
    """The named calibration, validated: every constant the model reads is there with its value, unit, source,
    where and derivation; a missing or malformed one is a ConfigError naming it."""
    raw = load_raw(name)
    if raw.get("format") != FORMAT or raw.get("name") != name:
        raise ConfigError(f"calibration {name}: format {raw.get('format')!r} / name {raw.get('name')!r}")
    archs = raw.get("architectures", {})
    kernels = {}
    for arch, body in archs.items():
        if "same_as" in body:
            continue
        kernels[arch] = _constants(name, f"architectures.{arch}", body.get("constants", {}), KernelConstants)
    for arch, body in archs.items():
        if "same_as" in body:
            if body["same_as"] not in kernels or not body.get("why"):
                raise ConfigError(f"calibration {name}: {arch} borrows {body['same_as']!r} without a why")
            kernels[arch] = kernels[body["same_as"]]
    exchange = _constants(name, "exchange", raw.get("exchange", {}), ExchangeConstants)
    return Calibration(name, tuple(sorted(kernels.items())), exchange)


def _constants(name: str, where: str, entries: dict, cls):
    values = {}
    for f in fields(cls):
        entry = entries.get(f.name)
        if not isinstance(entry, dict) or any(k not in entry for k in ENTRY_KEYS):
            raise ConfigError(f"calibration {name}: {where}.{f.name} needs {', '.join(ENTRY_KEYS)}")
        value = entry["value"]
        if isinstance(value, dict):  # a table by EP size
            value = tuple(sorted((int(k), float(v)) for k, v in value.items()))
        elif f.type == "int":
            value = int(value)
        else:
            value = float(value)
        values[f.name] = value
    return cls(**values)

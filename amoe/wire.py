"""Control-plane wire messages between the coordinator and the runtimes: the one module that defines them.

A message is one ZeroMQ frame: one byte of protocol version, then a msgpack array whose first element is the
message's one-byte type tag (msgspec tagged union, array-like structs). Never pickle. `decode` raises WireError
on anything else (garbage, a truncated frame, an unknown tag, another version); receivers count it, log it and go
on — malformed input is never fatal.

Coordinator → runtime: Welcome, AddRequest, Abort, Shutdown. Runtime → coordinator: Hello, Ready, Failed,
Heartbeat, TokenOut. Token tensors never travel here: they go runtime to runtime over the communicator.
"""

from __future__ import annotations

from typing import Any

import msgspec

from amoe.errors import TransportError

PROTOCOL_VERSION = 2


class WireError(TransportError):
    """A control-plane frame that cannot be decoded (garbage, truncated, unknown type or version)."""


class _Msg(msgspec.Struct, array_like=True, frozen=True, tag_field="t"):
    """Base: array-like (no field names on the wire), tagged by a small int that msgpack encodes in one byte."""


# ---- runtime → coordinator


class Hello(_Msg, tag=1):
    """A runtime loaded its weights and bound its data endpoint; what the coordinator needs to know of the model
    comes from here, so the coordinator never reads model code."""

    runtime: int
    role: str  # "attention" | "expert"
    pid: int
    endpoint: str  # its communicator's data endpoint, for the peer table
    num_kv_blocks: int  # KV blocks of its attention rank (0 on an expert runtime)
    max_model_len: int  # tokens a request may reach on it (model length, configured limit, KV capacity)
    vocab_size: int


class Ready(_Msg, tag=2):
    """Connected to every peer; the engine and the loop run."""

    runtime: int


class Failed(_Msg, tag=3):
    """Start-up or the loop failed; the runtime exits after sending this."""

    runtime: int
    error: str


class Heartbeat(_Msg, tag=4):
    """Every ~0.5 s: the runtime stats of docs/CONTRACTS.md, layer maps flattened by `flatten_stats`."""

    runtime: int
    stats: dict[str, Any]


class TokenOut(_Msg, tag=5):
    """Tokens an attention runtime sampled in one head step (or the end of aborted requests)."""

    runtime: int
    request_ids: list[int]
    token_ids: list[list[int]]  # per request: its new tokens (empty for an abort)
    finish_reasons: list[str | None]  # "stop" | "length" | "abort" | "error" | None
    kv_free_blocks: int
    error: str | None = None  # why a request failed (finish_reason "error")


# ---- coordinator → runtime


class Welcome(_Msg, tag=16):
    """The peer table: every runtime's data endpoint, indexed by runtime id."""

    endpoints: list[str]


class WireSampling(msgspec.Struct, array_like=True, frozen=True):
    """The token-level part of SamplingParams (stop strings stay with the coordinator's detokenizer)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool


class AddRequest(_Msg, tag=17):
    request_id: int
    prompt: list[int]
    params: WireSampling


class Abort(_Msg, tag=18):
    request_id: int


class Shutdown(_Msg, tag=19):
    """Stop the loop and the engine, then exit 0."""


Message = Hello | Ready | Failed | Heartbeat | TokenOut | Welcome | AddRequest | Abort | Shutdown

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_VERSION = bytes([PROTOCOL_VERSION])


def encode(msg: Message) -> bytes:
    return _VERSION + _encoder.encode(msg)


def decode(frame: bytes | memoryview) -> Message:
    """The message in one frame; WireError (never anything else) if it is not a valid one of this version."""
    frame = bytes(frame)
    if not frame:
        raise WireError("empty frame")
    if frame[0] != PROTOCOL_VERSION:
        raise WireError(f"protocol version {frame[0]}, expected {PROTOCOL_VERSION}")
    try:
        return _decoder.decode(frame[1:])
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable frame: {exc}") from None


def to_wire_sampling(params: Any, seed: int | None) -> WireSampling:
    """From amoe.sampling_params.SamplingParams; `seed` is the one the request will really use."""
    return WireSampling(
        max_tokens=params.max_tokens,
        temperature=float(params.temperature),
        top_k=params.top_k,
        top_p=float(params.top_p),
        seed=seed,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def from_wire_sampling(params: WireSampling) -> Any:
    """Back to SamplingParams (validated again: the runtime trusts no socket)."""
    from amoe.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


class WorkerSpec(msgspec.Struct, frozen=True):
    """What a runtime process is started with (JSON on its stdin): config, not a socket message."""

    runtime: int
    role: str  # "attention" | "expert"
    coordinator: str  # the control ROUTER's endpoint
    model_dir: str
    config: dict[str, Any]  # AmoeConfig.to_dict()
    parent_pid: int
    data_bind: str = "ipc"  # where the communicator binds: "ipc" or "tcp://host:0"
    store_path: str | None = None  # gloo / nccl rendezvous: a FileStore in the coordinator's private run dir
    startup_timeout_s: float = 300.0


def encode_spec(spec: WorkerSpec) -> bytes:
    return msgspec.json.encode(spec)


def decode_spec(data: bytes | str) -> WorkerSpec:
    try:
        return msgspec.json.decode(data, type=WorkerSpec)
    except msgspec.DecodeError as exc:
        raise WireError(f"bad worker spec: {exc}") from None


# Engine.stats() keys some maps by layer tuple (kind, block, index); msgpack maps want plain keys.
_LAYER_MAPS = ("depth", "batches", "rows")


def flatten_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """Layer-keyed maps become lists of [kind, block, index, value]."""
    out = dict(stats)
    for name in _LAYER_MAPS:
        if isinstance(out.get(name), dict):
            out[name] = [[*layer, value] for layer, value in out[name].items()]
    return out


def unflatten_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The inverse of flatten_stats: Engine.stats()'s shape again."""
    out = dict(stats)
    for name in _LAYER_MAPS:
        if isinstance(out.get(name), list):
            out[name] = {(kind, block, index): value for kind, block, index, value in out[name]}
    return out

"""Control-plane wire messages between the coordinator and the runtimes: the one module that defines them.

A message is one ZeroMQ frame: one byte of protocol version, then a msgpack array whose first element is the
message's one-byte type tag (msgspec tagged union, array-like structs). Never pickle. `decode` raises WireError
on anything else (garbage, a truncated frame, an unknown tag, another version); receivers count it, log it and go
on — malformed input is never fatal.

Coordinator → runtime: Welcome, AddRequest, Abort, Shutdown, Reconnect, and the live placement's LoadExperts,
DropExperts, SetExpertMap (docs/rebalancing.md). Runtime → coordinator: Hello, Ready, Failed, Heartbeat, TokenOut,
and the placement's ExpertsLoaded, ExpertsDropped, Drained, PlacementFailed. Multi-node, coordinator → node agent:
NodeWelcome, Spawn, Kill, Shutdown; agent → coordinator: NodeHello, NodeStatus. Token tensors never travel here:
they go runtime to runtime over the communicator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from amoe.errors import TransportError
from amoe.logprobs import MAX_LOGPROBS, Logprobs

# 3: TokenOut carries log-probabilities and WireSampling the penalties, min_p, logit_bias, allowed ids, bad words,
# n and a grammar. Their fields have defaults, so a version-2 peer would decode a version-3 frame and silently drop
# what it does not know; the version byte makes a mixed cluster refuse instead.
# 4: the live placement (Hello's model shape and hosted layers, Welcome's placement, the join and drain messages).
PROTOCOL_VERSION = 4


class WireError(TransportError):
    """A control-plane frame that cannot be decoded (garbage, truncated, unknown type or version)."""


class _Msg(msgspec.Struct, array_like=True, frozen=True, tag_field="t"):
    """Base: array-like (no field names on the wire), tagged by a small int that msgpack encodes in one byte."""


# Ranges are part of the types: a message whose numbers are out of range does not decode (it is dropped and
# counted like garbage), so nothing downstream sees a negative count, an id that overflows, or a NaN.
Count = Annotated[int, Meta(ge=0, le=2**62)]
RuntimeId = Annotated[int, Meta(ge=0, le=65535)]
NodeId = Annotated[int, Meta(ge=0, le=65535)]
Endpoint = Annotated[str, Meta(pattern=r"^(ipc|tcp)://", max_length=4096)]
RequestId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Seconds = Annotated[float, Meta(ge=0, le=1e12)]
Role = Literal["attention", "expert"]
FinishReason = Literal["stop", "length", "abort", "error", "rejected"]
Block = Annotated[int, Meta(ge=0, le=65535)]
ExpertId = Annotated[int, Meta(ge=0, le=65535)]
Layer = tuple[Block, ExpertId]  # (block, expert): one expert layer, the unit a replica joins and drains
Layers = Annotated[list[Layer], Meta(max_length=1 << 22)]
Epoch = Annotated[int, Meta(ge=0, le=2**62)]  # the coordinator's placement epoch: +1 per map change


# ---- runtime → coordinator


class Hello(_Msg, tag=1):
    """A runtime loaded its weights and bound its data endpoint; what the coordinator needs to know of the model
    comes from here, so the coordinator never reads model code."""

    runtime: RuntimeId
    role: Role
    pid: Count
    endpoint: Annotated[
        str, Meta(pattern=r"^(ipc|tcp)://", max_length=4096)
    ]  # its data endpoint, for the peer table
    num_kv_blocks: Count  # KV blocks of its attention rank (0 on an expert runtime)
    max_model_len: Annotated[int, Meta(ge=1, le=2**31 - 1)]  # tokens a request may reach on it
    vocab_size: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    # Multi-node: its CURVE tcp:// endpoint for peers on other hosts (`endpoint` stays for those on its own)
    secure_endpoint: Endpoint | None = None
    generation: Count = 0  # of this process of its rank (WorkerSpec.generation): what its peers are told
    # The model's expert grid and, on an expert runtime, the layers it loaded: the coordinator's expert map is
    # made of these (docs/rebalancing.md); expert_groups: its router's groups, EPLB's hierarchical policy.
    num_blocks: Count = 0
    num_expert_ids: Count = 0
    expert_groups: Annotated[int, Meta(ge=1, le=65535)] = 1
    hosted: Layers = []


class Ready(_Msg, tag=2):
    """Connected to every peer; the engine and the loop run."""

    runtime: RuntimeId


class Failed(_Msg, tag=3):
    """Start-up or the loop failed; the runtime exits after sending this."""

    runtime: RuntimeId
    error: Annotated[str, Meta(max_length=65536)]


class Heartbeat(_Msg, tag=4):
    """Every ~0.5 s: the runtime stats of docs/CONTRACTS.md, layer maps flattened by `flatten_stats` (checked
    against `RuntimeReport` before anything reads them)."""

    runtime: RuntimeId
    stats: dict[str, Any]


class TokenOut(_Msg, tag=5):
    """Tokens an attention runtime sampled in one head step, or the end of requests (aborted, rejected by the
    runtime, or failed in a batch — which any runtime may report)."""

    runtime: RuntimeId
    request_ids: list[RequestId]
    token_ids: list[list[TokenId]]  # per request: its new tokens (empty when it ended without one)
    finish_reasons: list[FinishReason | None]
    kv_free_blocks: Count
    error: Annotated[str, Meta(max_length=65536)] | None = (
        None  # why ("rejected": the request; "error": the runtime)
    )
    # Per request, when any wanted them: Logprobs of its new tokens (asked for, or best_of ranks its sequences:
    # the coordinator sums them, so a moved sequence's score goes on where it was) / of its prompt (first token
    # only), or None.
    logprobs: list[Logprobs | None] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None

    def __post_init__(self) -> None:
        if not len(self.request_ids) == len(self.token_ids) == len(self.finish_reasons):
            raise ValueError("request_ids, token_ids and finish_reasons differ in length")
        for column in (self.logprobs, self.prompt_logprobs):
            if column is not None and len(column) != len(self.request_ids):
                raise ValueError("logprobs and request_ids differ in length")
        if self.logprobs is not None and any(
            lp is not None and lp.token_ids != tokens for lp, tokens in zip(self.logprobs, self.token_ids)
        ):
            raise ValueError("logprobs are not of the tokens they travel with")


class ExpertsLoaded(_Msg, tag=6):
    """An expert runtime's joins of `epoch` landed: their weights are in its executor and its queues take rows."""

    runtime: RuntimeId
    epoch: Epoch
    layers: Layers
    bytes: Count  # weight bytes loaded


class ExpertsDropped(_Msg, tag=7):
    """An expert runtime stopped taking rows of these layers and freed their weights."""

    runtime: RuntimeId
    epoch: Epoch
    layers: Layers
    bytes: Count  # weight bytes freed


class Drained(_Msg, tag=8):
    """An attention runtime routes by the map of `epoch`, and every row it sent to a replica that map retired has
    been answered."""

    runtime: RuntimeId
    epoch: Epoch


class PlacementFailed(_Msg, tag=9):
    """A placement command of `epoch` could not be carried out (a weight load raised, a bad map)."""

    runtime: RuntimeId
    epoch: Epoch
    error: Annotated[str, Meta(max_length=65536)]


# ---- coordinator → runtime


class PlacementState(msgspec.Struct, array_like=True, frozen=True):
    """The live placement a runtime starts from: the map of `epoch` (replicas per block and expert) the attention
    runtimes route by, and the layers this runtime hosts (an expert runtime's: what it must load before Ready)."""

    epoch: Epoch
    replicas: Annotated[list[list[list[RuntimeId]]], Meta(max_length=65536)]
    hosted: Layers = []


class Welcome(_Msg, tag=16):
    """The peer table: every runtime's data endpoint, indexed by runtime id, and the generation of the process
    behind it (0 first, +1 per replacement: a gloo / nccl pair's groups are keyed by both members'); and the live
    placement, when the deployment has one."""

    endpoints: list[Annotated[str, Meta(pattern=r"^(ipc|tcp)://", max_length=4096)]]
    generations: list[Count] = []
    placement: PlacementState | None = None


class WireSampling(msgspec.Struct, array_like=True, frozen=True):
    """The token-level part of SamplingParams (stop strings and text options stay with the coordinator's
    detokenizer): everything the attention rank's sampler and logits processors need. The runtime validates it
    again as SamplingParams."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_token_ids: list[TokenId]
    ignore_eos: bool
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: list[tuple[TokenId, float]] = []
    allowed_token_ids: list[TokenId] | None = None
    bad_words_token_ids: list[list[TokenId]] = []
    grammar: Annotated[str, Meta(max_length=1 << 20)] | None = None  # compiled (amoe.structured)
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None


class AddRequest(_Msg, tag=17):
    request_id: RequestId
    prompt: list[TokenId]
    params: WireSampling
    # A request moved from a lost attention runtime: the last num_generated prompt tokens are its own output so
    # far (recomputed here), so a seeded sampler resumes its draws where it stopped.
    num_generated: Count = 0
    # n > 1: the ids of its other sequences (params.n or best_of, less one), forked from its prefill at the rank.
    seq_ids: list[RequestId] = []


class Abort(_Msg, tag=18):
    request_id: RequestId


class Shutdown(_Msg, tag=19):
    """Stop the loop and the engine, then exit 0."""


class Reconnect(_Msg, tag=20):
    """Runtime `runtime` was replaced by a new process at `endpoint`: send there from now on (and ask it again for
    what the old one never answered)."""

    runtime: RuntimeId
    endpoint: Annotated[str, Meta(pattern=r"^(ipc|tcp)://", max_length=4096)]
    generation: Count = 0  # the new process's (see Welcome)


class LoadExperts(_Msg, tag=21):
    """Join: load these layers' weights off the loop, then take their rows; answer ExpertsLoaded (or
    PlacementFailed). An expert runtime's."""

    epoch: Epoch
    layers: Layers


class DropExperts(_Msg, tag=22):
    """Drain's end: take no more rows of these layers and free their weights (or cancel their join of `epoch`);
    answer ExpertsDropped. An expert runtime's."""

    epoch: Epoch
    layers: Layers


class SetExpertMap(_Msg, tag=23):
    """Route rows of each (block, expert) to these replicas from now on; answer Drained once the replicas this
    retired owe nothing. An attention runtime's."""

    epoch: Epoch
    entries: Annotated[list[tuple[Block, ExpertId, list[RuntimeId]]], Meta(max_length=1 << 22)]


# ---- node agent ↔ coordinator (multi-node)


class NodeHello(_Msg, tag=32):
    """A node agent joined (or joined again after a restart: it then runs none of the old agent's runtimes)."""

    node: NodeId
    host: Annotated[str, Meta(max_length=256)]  # its --node-ip
    pid: Count


class NodeStatus(_Msg, tag=33):
    """Every ~0.5 s: the agent's runtime processes, by runtime and spawn number: running (with pid) or ended
    (with exit code; negative: killed by that signal). Also its heartbeat."""

    node: NodeId
    running: list[tuple[RuntimeId, Count, Count]]  # runtime, spawn seq, pid
    exited: list[tuple[RuntimeId, Count, Annotated[int, Meta(ge=-64, le=255)]]]  # runtime, seq, code


class NodeWelcome(_Msg, tag=34):
    """The coordinator took the agent in; repeated every second as its keep-alive."""

    node: NodeId


class Spawn(_Msg, tag=35):
    """Start runtime `runtime` (spawn number `seq`) on this node with the cluster's config."""

    runtime: RuntimeId
    role: Role
    seq: Count
    config: dict[str, Any]
    startup_timeout_s: Seconds
    generation: Count = 0  # of this process of its rank (WorkerSpec.generation)


class Kill(_Msg, tag=36):
    """SIGKILL runtime `runtime`'s process of spawn number `seq` (a stopped or wedged one being replaced)."""

    runtime: RuntimeId
    seq: Count


Message = (
    Hello | Ready | Failed | Heartbeat | TokenOut | ExpertsLoaded | ExpertsDropped | Drained | PlacementFailed
    | Welcome | AddRequest | Abort | Shutdown | Reconnect | LoadExperts | DropExperts | SetExpertMap
    | NodeHello | NodeStatus | NodeWelcome | Spawn | Kill
)  # fmt: skip
PLACEMENT_REPLIES = (ExpertsLoaded, ExpertsDropped, Drained, PlacementFailed)  # runtime → coordinator
PLACEMENT_COMMANDS = (LoadExperts, DropExperts, SetExpertMap)  # coordinator → runtime
NODE_MESSAGES = (NodeHello, NodeStatus)  # what an agent may send

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
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: a __post_init__ check
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
        n=params.n,
        best_of=params.best_of,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        min_p=float(params.min_p),
        min_tokens=params.min_tokens,
        logit_bias=[(t, float(b)) for t, b in params.logit_bias],
        allowed_token_ids=None if params.allowed_token_ids is None else list(params.allowed_token_ids),
        bad_words_token_ids=[list(w) for w in params.bad_words_token_ids],
        grammar=params.grammar,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
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
        n=params.n,
        best_of=params.best_of,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        min_tokens=params.min_tokens,
        logit_bias=tuple(params.logit_bias),
        allowed_token_ids=params.allowed_token_ids,
        bad_words_token_ids=params.bad_words_token_ids,
        grammar=params.grammar,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
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
    # Multi-node: also listen here (tcp://node-ip:0) with CURVE, and reach tcp:// peers and the coordinator with
    # these keys (amoe.curve.ClusterKeys; the spec travels over a local pipe, never the network).
    secure_bind: str | None = None
    curve: dict[str, str] | None = None
    startup_timeout_s: float = 300.0
    generation: int = 0  # of this process of its rank: 0 first, +1 per replacement (see Welcome)


def encode_spec(spec: WorkerSpec) -> bytes:
    return msgspec.json.encode(spec)


def decode_spec(data: bytes | str) -> WorkerSpec:
    try:
        return msgspec.json.decode(data, type=WorkerSpec)
    except msgspec.DecodeError as exc:
        raise WireError(f"bad worker spec: {exc}") from None


# ---- the runtime report a Heartbeat carries (docs/CONTRACTS.md "Runtime stats"), as far as anyone reads it

LayerValue = tuple[Literal["attn", "expert"], Annotated[int, Meta(ge=0, le=65535)], Annotated[int, Meta(ge=0, le=65535)], Annotated[float, Meta(ge=0, le=1e18)]]  # fmt: skip


class _Report(msgspec.Struct, forbid_unknown_fields=False):
    """Base: fields beyond the declared ones are allowed (and unread)."""


class BatchRows(_Report):
    buckets: list[Seconds]
    counts: dict[str, list[Count]]
    sum: dict[str, Count]


class CommReport(_Report):
    dropped: dict[str, Count] = {}
    rejected_handshakes: Count = 0
    failed_peers: list[RuntimeId] = []
    departed_peers: list[RuntimeId] = []


class OffloadReport(_Report):
    """An expert runtime's expert store (amoe.offload.store.ExpertStore.stats)."""

    hits: Count = 0
    misses: Count = 0
    loads: Count = 0
    evictions: Count = 0
    bytes_read: Count = 0
    prefetches: Count = 0
    prefetch_used: Count = 0
    stall_s: Seconds = 0.0
    slots: Count = 0
    resident: Count = 0
    experts: Count = 0
    expert_bytes: Count = 0


class RuntimeReport(_Report):
    """What the coordinator reads of a runtime's heartbeat stats: every number in range, every map well formed."""

    runtime: RuntimeId
    role: Role
    incarnation: Annotated[str, Meta(max_length=256)] = ""
    busy_s: Seconds = 0.0
    idle_s: Seconds = 0.0
    uptime_s: Seconds = 0.0
    polls: Count = 0
    pool_entries: Count = 0
    pool_parts: Count = 0
    dispatch_pending: Count = 0
    tokens_in: Count = 0
    tokens_out: Count = 0
    messages_out: Count = 0
    errors: Count = 0
    resent_rows: Count = 0
    loaded_layers: Count = 0  # expert runtime: layers its joins have loaded so far (a join's progress)
    inflight: list[Count] = []
    expected_parts: Count = 0
    tracked_requests: Count = 0
    kv_used_blocks: Count = 0
    kv_total_blocks: Count = 0
    depth: list[LayerValue] = []
    batches: list[LayerValue] = []
    rows: list[LayerValue] = []
    dropped: dict[str, Count] = {}
    routed: list[list[Count]] = []
    batch_rows: BatchRows | None = None
    comm: CommReport | None = None
    offload: OffloadReport | None = None


def check_report(runtime: int, stats: dict[str, Any]) -> dict[str, Any]:
    """The heartbeat's stats with its layer maps unflattened, if they are a well-formed report of `runtime`;
    WireError otherwise."""
    try:
        report = msgspec.convert(stats, RuntimeReport)
    except msgspec.ValidationError as exc:
        raise WireError(f"malformed runtime report: {exc}") from None
    if report.runtime != runtime:
        raise WireError(f"a report of runtime {report.runtime} in a heartbeat of runtime {runtime}")
    return unflatten_stats(stats)


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

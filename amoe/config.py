"""The one configuration object: a few nested frozen dataclasses, validated once, CLI flags generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

from amoe.errors import ConfigError
from amoe.tool_calls.formats import PARSERS

logger = logging.getLogger(__name__)

# The layer schedulers of AMoE §3.4: the paper's defragging Algorithm 1 and its two strawmen, and `waves`, which
# keeps each attention rank's requests in waves that stay apart (docs/scheduler.md).
POLICIES = ("defrag", "mtfs", "flfs", "waves")
# The one default policy of `amoe serve`, `amoe plan` and every study: what the planner simulates and serves, at
# 0.97-1.02 of AEP's bound at 32 blocks where defrag reaches 0.41-0.54 (docs/findings.md). defrag gives the lower
# ITL at light load (docs/scheduler.md).
DEFAULT_POLICY = "waves"
# Policies no longer served, and what replaces each: `wave` merged waves and measured the worst of five.
RETIRED_POLICIES = {"wave": "waves"}
# Weight and activation dtypes by name (amoe.device maps them to torch dtypes; this module stays torch-free).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_DTYPE_SYNONYMS = {"half": "float16", "float": "float32"}
# ep's expert GEMM (EPS-MoE's load-aware choice): one grouped GEMM for a device's experts, one dense GEMM per
# expert, or the cost model's pick by tokens per expert.
EP_KERNELS = ("auto", "grouped", "dense")
# Where a runtime's tensors live (docs/gpu.md): auto = CUDA when this host has it.
DEVICE_KINDS = ("auto", "cpu", "cuda")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be positive; got {value}")


@dataclass(frozen=True)
class ModelSection:
    """Which checkpoint to serve and how to hold it."""

    path: str | None = None  # None: the shipped default model (amoe.model.make.default_model_path)
    # auto: float32 on the CPU; on a GPU the checkpoint's 16-bit dtype, else bfloat16 (amoe.device.model_dtype)
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    # Sampling defaults as vLLM's --generation-config: auto (the checkpoint's generation_config.json), vllm (none),
    # or a directory holding one (amoe.generation_config)
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        # vLLM's other names for the same dtypes (`--dtype half`, `--dtype float`)
        object.__setattr__(self, "dtype", _DTYPE_SYNONYMS.get(self.dtype, self.dtype))
        _choice("model.dtype", self.dtype, ("auto", *DTYPE_NAMES))
        if self.max_model_len is not None:
            _positive("model.max_model_len", self.max_model_len)


@dataclass(frozen=True)
class CacheSection:
    """The paged KV cache of each attention rank."""

    block_size: int = 16
    # None: as many as device.memory_utilization leaves room for (amoe.device.kv_blocks_for_memory)
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256  # requests decoding at once on one attention rank

    def __post_init__(self) -> None:
        _positive("cache.block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive("cache.num_kv_blocks", self.num_kv_blocks)
        _positive("cache.max_num_seqs", self.max_num_seqs)


@dataclass(frozen=True)
class DeviceSection:
    """Where each runtime computes (docs/gpu.md): one device per runtime process."""

    # auto | cpu | cuda; a node's runtimes take GPUs 0..G-1 in placement order. AMOE_DEVICE stands in for the
    # built-in default (`make test` runs the suite with AMOE_DEVICE=cpu).
    kind: str = field(default_factory=lambda: os.environ.get("AMOE_DEVICE") or "auto")
    # vLLM's --gpu-memory-utilization: the fraction of the device's memory this runtime may use (weights, activations
    # and the KV cache, which gets what is left). On the CPU the same fraction of the host's RAM, shared by the
    # node's runtimes.
    memory_utilization: float = 0.9
    # cuda: how many of a node's runtimes share one GPU (runtime i of a node takes GPU i // N), each with 1/N of
    # its memory. Above 1 a host with fewer GPUs than runtimes still serves (aep's attention and expert runtimes
    # on one GPU), over the inline or gloo plane: NCCL refuses two ranks of a group on one GPU.
    runtimes_per_gpu: int = 1

    def __post_init__(self) -> None:
        _choice("device.kind", self.kind, DEVICE_KINDS)
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ConfigError(f"device.memory_utilization must be in (0, 1]; got {self.memory_utilization}")
        _positive("device.runtimes_per_gpu", self.runtimes_per_gpu)


@dataclass(frozen=True)
class ParallelSection:
    """How the model is placed on runtimes."""

    mode: str = "aep"  # "local": no runtimes, the single-process reference engine (tests of the API layer)
    attn_ranks: int = 1  # ep: the number of devices (each hosts an attention rank and its share of experts)
    expert_ranks: int = 2  # ignored by ep
    threads_per_rank: int = 1
    micro_batches: int = 2  # pingpong: m of MegaScale-Infer's ping-pong pipeline
    # aep / pingpong: the expert runtime (0..expert_ranks-1) of each expert, "0,1,2,3,0,1,2,3"; None: e mod M.
    # `amoe plan` writes one that balances a skewed routing.
    expert_map: str | None = None
    # ep: EPS-MoE's expert pipeline (docs/eps.md "Serving with it"): each block's experts run as PN chunks,
    # one group of every device's hosted experts each, chunk p's all-to-all in flight while chunk p-1 computes.
    # "N" (1..the experts a device hosts) or "auto" (the cost model's choice per iteration's load); None: 1.
    ep_pipelines: str | None = None
    # ep: the expert GEMM of a chunk: grouped (one grouped step for a device's experts), dense (one GEMM per
    # expert) or auto (the cost model's choice by tokens per expert); None: grouped.
    ep_kernel: str | None = None
    # aep: the most runtimes the cluster holds at once, attention and expert together, as `amoe scale` adds and
    # removes them (docs/rebalancing.md "Scaling"); never fewer than it starts with. A slot no runtime holds costs
    # each communicator an idle entry, no socket and no thread.
    max_runtimes: int = 64

    def __post_init__(self) -> None:
        _choice("parallel.mode", self.mode, ("aep", "ep", "pingpong", "local"))
        if type(self.ep_pipelines) is int:  # a JSON config's 5 (a bool is no PN: it stays and is refused)
            object.__setattr__(self, "ep_pipelines", str(self.ep_pipelines))
        self._check_ep_pipeline()
        _positive("parallel.attn_ranks", self.attn_ranks)
        _positive("parallel.expert_ranks", self.expert_ranks)
        _positive("parallel.threads_per_rank", self.threads_per_rank)
        _positive("parallel.micro_batches", self.micro_batches)
        _positive("parallel.max_runtimes", self.max_runtimes)

    def _check_ep_pipeline(self) -> None:
        for name, value in (("--ep-pipelines", self.ep_pipelines), ("--ep-kernel", self.ep_kernel)):
            if value is not None and self.mode != "ep":
                raise ConfigError(f"{name} applies to --parallel ep only; got --parallel {self.mode}")
        if self.ep_kernel is not None and self.ep_kernel not in EP_KERNELS:
            raise ConfigError(f"--ep-kernel must be one of {', '.join(EP_KERNELS)}; got {self.ep_kernel!r}")
        pipelines = self.ep_pipelines
        if pipelines not in (None, "auto") and not (str(pipelines).isdigit() and int(pipelines) >= 1):
            raise ConfigError(f"--ep-pipelines must be a positive integer or auto; got {self.ep_pipelines!r}")

    @property
    def pipelines(self) -> int | None:
        """ep's PN: a number, None for auto (1 when not given)."""
        if self.ep_pipelines == "auto":
            return None
        return int(self.ep_pipelines or 1)

    @property
    def kernel(self) -> str:
        return self.ep_kernel or "grouped"


@dataclass(frozen=True)
class SchedulerSection:
    """The per-runtime layer scheduler (AMoE §3.4)."""

    policy: str = DEFAULT_POLICY
    lookahead: int = (
        4  # K of Algorithm 1: blocks looked ahead (the paper gives no value; 4 is what amoe serves with)
    )
    decay: float = 0.5  # δ of Algorithm 1
    attn_batch_cap: int = 256  # rows per attention batch
    expert_batch_cap: int = 512  # rows per expert (of one μ-queue) in an expert batch
    # An expert runtime runs every hosted expert's queue of the block it picks as one grouped step (one host step,
    # one kernel sequence), as EP and ping-pong run a device's experts; false: one (block, expert) queue a step.
    group_experts: bool = True
    # waves, expert side (docs/scheduler.md "Group cells"): the waves of each attention rank that make one
    # group, which an expert runtime serves as one (block, group) step once every rank's waves of the group are
    # in. 0: the expert side gathers per rank (the straggler wait and the meeting block). A plan sets its
    # bound's group (`amoe plan` prints it): the right size depends on the expert GPU's cost of a step, which
    # the serving config does not know.
    wave_group: int = 0

    def __post_init__(self) -> None:
        if self.policy in RETIRED_POLICIES:
            raise ConfigError(
                f"scheduler.policy {self.policy} is retired: use {RETIRED_POLICIES[self.policy]} (docs/scheduler.md)"
            )
        _choice("scheduler.policy", self.policy, POLICIES)
        if self.wave_group < 0:
            raise ConfigError(f"scheduler.wave_group must be >= 0; got {self.wave_group}")
        if self.lookahead < 0:
            raise ConfigError(f"scheduler.lookahead must be >= 0; got {self.lookahead}")
        if not 0.0 <= self.decay <= 1.0:
            raise ConfigError(f"scheduler.decay must be in [0, 1]; got {self.decay}")
        _positive("scheduler.attn_batch_cap", self.attn_batch_cap)
        _positive("scheduler.expert_batch_cap", self.expert_batch_cap)


@dataclass(frozen=True)
class TransportSection:
    """How token batches move between runtimes (AMoE §3.5)."""

    # auto: nccl between GPU runtimes on one host, inline otherwise (AmoeConfig.tensor_plane)
    plane: str = "auto"
    timeout_s: float = 10.0  # a transfer pending longer than this fails its peer

    def __post_init__(self) -> None:
        _choice("transport.plane", self.plane, ("auto", "inline", "gloo", "nccl"))
        _positive("transport.timeout_s", self.timeout_s)


@dataclass(frozen=True)
class ExecutorSection:
    """What runs a layer: real torch computation, or an emulated GPU holding the runtime for a predicted time (its
    settings: the emulation section)."""

    kind: str = "torch"

    def __post_init__(self) -> None:
        _choice("executor.kind", self.kind, ("torch", "emulated"))


@dataclass(frozen=True)
class EmulationSection:
    """The emulated GPUs (docs/emulation.md): which GPUs the cost model prices and how the emulated executor runs
    them. Read with `executor.kind = emulated`; `gpu` also prices a torch EP deployment's `--ep-pipelines auto`."""

    gpu: str = "a100-80g"  # a100-40g | a100-80g | h100 | h200
    # The expert runtimes' GPU when it differs (a heterogeneous AEP or ping-pong deployment, as MegaScale-Infer
    # runs: attention on memory-rich GPUs, experts on compute-rich ones); "": --gpu. Links and KV are priced on
    # --gpu (the attention GPUs), as the bounds (amoe.perf.plan.bounds) price them.
    expert_gpu: str = ""
    profile: str | None = None  # model shapes to cost (mixtral-8x7b-mqa, ...); None: the checkpoint's
    top_k: int | None = None  # override the profile's top-k
    time_scale: float = 1.0  # wall seconds per emulated second
    # model | uniform | skew-exp[:λ] (benchmarks override the router, as the paper does)
    routing: str = "model"
    seed: int = 0  # of the routing override
    host_overhead: str = "amoe-paper"  # host cost per row of the serving system (amoe-paper | none)
    # Skip prefill as the AMoE paper's evaluation does (KV "populated with dummy data"): a prompt's KV is taken as
    # written and only its last token enters, so throughput is decode throughput.
    decode_only: bool = False
    # GPUs per node, which decides whether a message crosses NVLink or the network; 0: one node
    gpus_per_node: int = 0
    # Each GPU's fixed speed and each step's jitter (amoe.perf.model.variance, docs/cost-model.md):
    # sourced (Sinha et al. SC'22 across GPUs, DeepEP #208 per step) | off | SPREAD[,jitter=J][,seed=N]
    step_variance: str = "sourced"

    def __post_init__(self) -> None:
        _positive("emulation.time_scale", self.time_scale)
        if self.top_k is not None:
            _positive("emulation.top_k", self.top_k)
        if self.gpus_per_node < 0:
            raise ConfigError(f"emulation.gpus_per_node must be >= 0; got {self.gpus_per_node}")
        # The names (GPU, profile, host overhead, routing) are the cost model's: amoe.perf.model.check.check_emulation
        # checks them where an emulation is built (`amoe serve` before it starts anything, every Emulation), so
        # that the serving config does not import the modelling.


@dataclass(frozen=True)
class ServerSection:
    """The coordinator's HTTP API."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer key every endpoint but /health asks for; it may also come from a file (first line) or AMOE_API_KEY,
    # so it need not show in `ps`.
    api_key: str | None = None
    api_key_file: str | None = None
    max_waiting: int = 256  # requests queued for KV space before the API answers 503
    max_body_bytes: int = 16 * 1024 * 1024  # a bigger request body gets 413 before it is parsed
    request_timeout_s: float = 3600.0  # a request's deadline, queueing included: then it ends with an error
    stall_timeout_s: float = 60.0  # a running request that produces no token for this long ends with an error
    abort_timeout_s: float = 30.0  # an abort no runtime confirms frees the request's KV after this anyway
    # Self-healing (aep): a lost runtime is replaced at most max_restarts times in any restart_window_s; past
    # that the server drains and exits non-zero. 0: no replacement (fail-stop).
    max_restarts: int = 5
    restart_window_s: float = 300.0
    # A lost attention runtime's requests move to the serving attention rank with the most free KV if its
    # replacement is not serving within this (0: at once); without room elsewhere they wait for the replacement.
    failover_after_s: float = 5.0
    served_model_name: str | None = None  # None: the model directory's name
    # Seeds the stream of seeds drawn for sampled requests that bring none (vLLM's --seed): the same arrivals then
    # sample the same tokens run after run.
    seed: int = 0
    drain_timeout_s: float = 10.0  # on SIGINT/SIGTERM: how long in-flight requests get before being aborted
    # /metrics: queue depths and batch counters per layer (runtime, block, expert | rank); false sums them per
    # runtime and routed tokens per expert, for models whose layer count would make too many series.
    metrics_per_layer: bool = True
    # Tool calling as vLLM serves it (docs/tools.md): the family's wire format that `tool_choice: "auto"` reads
    # calls in (vLLM's parser names), and whether `auto` is served at all (without it, a 400 as in vLLM).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in [0, 65535]; got {self.port}")
        _positive("server.max_waiting", self.max_waiting)
        for name in (
            "max_body_bytes",
            "request_timeout_s",
            "stall_timeout_s",
            "abort_timeout_s",
            "restart_window_s",
        ):
            _positive(f"server.{name}", getattr(self, name))
        if self.max_restarts < 0:
            raise ConfigError(f"server.max_restarts must be >= 0; got {self.max_restarts}")
        if self.api_key is not None and self.api_key_file is not None:
            raise ConfigError("give server.api_key or server.api_key_file, not both")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("server.served_model_name must not be empty")
        for name in ("drain_timeout_s", "failover_after_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"server.{name} must be >= 0; got {getattr(self, name)}")
        if not isinstance(self.metrics_per_layer, bool):
            raise ConfigError(f"server.metrics_per_layer must be true or false; got {self.metrics_per_layer}")
        if self.tool_call_parser is not None:
            _choice("server.tool_call_parser (--tool-call-parser)", self.tool_call_parser, tuple(PARSERS))
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")


@dataclass(frozen=True)
class DistSection:
    """One cluster over several hosts (docs/multinode.md): node 0 runs the coordinator and its share of the
    runtimes, nodes 1..N-1 run a node agent. Environment variables named after the flags (AMOE_NNODES,
    AMOE_NODE_RANK, AMOE_DIST_INIT_ADDR, ...) stand in for flags not given, for orchestrators."""

    nnodes: int = 1
    node_rank: int = 0
    init_addr: str | None = None  # HOST:PORT of node 0's rendezvous store (torch TCPStore)
    runtimes_per_node: int | None = None  # None: the runtimes spread evenly, in placement order
    node_map: str | None = None  # explicit node of each runtime, in placement order: "0,1,1,2"
    node_ip: str | None = None  # where this node's endpoints bind; None: the address that routes to init_addr
    timeout_s: float = 120.0  # a node that has not joined by then fails start-up with a clear error
    cluster_secret_file: str | None = None  # node 0 writes a new one when None; agents must be given it
    backend: str = "mp"  # mp: processes started by node agents | ray: Ray actors in a placement group

    def __post_init__(self) -> None:
        _positive("dist.nnodes", self.nnodes)
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"dist.node_rank must be in [0, {self.nnodes}); got {self.node_rank}")
        if self.runtimes_per_node is not None:
            _positive("dist.runtimes_per_node", self.runtimes_per_node)
        _positive("dist.timeout_s", self.timeout_s)
        _choice("dist.backend", self.backend, ("mp", "ray"))
        if self.node_ip is not None and self.node_ip in ("0.0.0.0", "::", "*"):
            raise ConfigError("--node-ip must be the address other nodes reach this one at, not a wildcard")
        if self.nnodes > 1 and self.backend == "mp" and not self.init_addr:
            raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's rendezvous address)")

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1 or self.backend == "ray"


# Byte units of --offload-budget: SI (k, M, G, T: powers of 1000) and IEC (Ki, Mi, Gi, Ti: powers of 1024).
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
OFFLOAD_POLICIES = ("activation", "lru", "lfu")  # amoe.offload.policy.POLICIES (this module stays torch-free)


def parse_size(text: str) -> int:
    """Bytes from "512MiB", "2GB", "1.5G", "4096": SI units are powers of 1000, IEC (Ki, Mi, ...) of 1024."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(text))
    if m is None:
        raise ConfigError(f"a size is a number with an optional unit (512MiB, 2GB, 4096); got {text!r}")
    number, prefix, iec = m.groups()
    if iec and not prefix:
        raise ConfigError(f"a size is a number with an optional unit (512MiB, 2GB, 4096); got {text!r}")
    scale = 1024 ** (1 + "kmgt".index(prefix.lower())) if iec else _SIZE_UNITS[prefix.lower()]
    return int(float(number) * scale)


@dataclass(frozen=True)
class OffloadSection:
    """Expert offloading (docs/offload.md): expert weights stay in their safetensors files and a process that
    hosts experts keeps at most `budget` bytes of weights resident — its dense part plus a pool of expert slots."""

    budget: str | None = None  # None: every expert resident (no offloading); else a size: 512MiB, 2GB
    policy: str = "activation"  # which resident expert to evict, which absent ones to fetch early
    eamc: str | None = (
        None  # activation policy: the expert activation matrix collection (`amoe offload build-eamc`)
    )
    record: str | None = None  # JSON Lines file the routing of every finished sequence is written to
    # false: load an expert only when a step asks for it (no look-ahead within a block, no policy prefetch)
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.budget is not None:
            _positive("offload.budget", parse_size(self.budget))
        _choice("offload.policy", self.policy, OFFLOAD_POLICIES)
        if not isinstance(self.prefetch, bool):
            raise ConfigError(f"offload.prefetch must be true or false; got {self.prefetch}")

    @property
    def budget_bytes(self) -> int | None:
        return None if self.budget is None else parse_size(self.budget)


@dataclass(frozen=True)
class EplbSection:
    """Redundant experts and rebalancing (docs/rebalancing.md), as vLLM's EPLBConfig names them: live in `aep`, a
    stop-the-world rebalance in `ep` and `pingpong`."""

    # vLLM's --enable-eplb: recompute the placement every step_interval steps from the last window_size steps' load
    enable: bool = False
    # Extra replicas per block beyond one per expert, placed at start-up by expected load (a shared expert first)
    num_redundant_experts: int = 0
    window_size: int = (
        1000  # steps of expert load a rebalance looks at (a step: one head step of a rank, mean)
    )
    step_interval: int = 3000  # steps between rebalances (beyond window_size only the last window_size count)
    log_balancedness: bool = False  # log each block's balancedness (mean / max runtime load)
    log_balancedness_interval: int = 1  # steps between those logs
    # amoe's own: a rebalance whose joins load no layer's weights for this long fails (the old map serves on); a
    # stall, not a size, so a large join never runs out of time while its layers keep landing
    join_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("enable", "log_balancedness"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"eplb.{name} must be true or false; got {getattr(self, name)!r}")
        if isinstance(self.num_redundant_experts, bool) or self.num_redundant_experts < 0:
            raise ConfigError(f"eplb.num_redundant_experts must be >= 0; got {self.num_redundant_experts}")
        for name in ("window_size", "step_interval", "log_balancedness_interval", "join_timeout_s"):
            _positive(f"eplb.{name}", getattr(self, name))

    @property
    def live(self) -> bool:
        """Whether the placement can change while serving (redundant replicas or rebalancing)."""
        return self.enable or self.num_redundant_experts > 0


@dataclass(frozen=True)
class AmoeConfig:
    """Everything a deployment is configured by; built once, never mutated after start-up."""

    model: ModelSection = field(default_factory=ModelSection)
    cache: CacheSection = field(default_factory=CacheSection)
    device: DeviceSection = field(default_factory=DeviceSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    transport: TransportSection = field(default_factory=TransportSection)
    executor: ExecutorSection = field(default_factory=ExecutorSection)
    emulation: EmulationSection = field(default_factory=EmulationSection)
    server: ServerSection = field(default_factory=ServerSection)
    dist: DistSection = field(default_factory=DistSection)
    offload: OffloadSection = field(default_factory=OffloadSection)
    eplb: EplbSection = field(default_factory=EplbSection)

    def __post_init__(self) -> None:
        if self.dist.multi_node and (self.parallel.mode != "aep" or self.tensor_plane != "inline"):
            raise ConfigError(
                "a multi-node cluster serves --parallel aep over --transport inline (the tensor plane across "
                "hosts is ZeroMQ over CURVE); got "
                f"--parallel {self.parallel.mode} --transport {self.transport.plane}"
            )
        if self.tensor_plane == "nccl" and self.device.kind == "cpu":
            raise ConfigError(
                "--transport nccl moves GPU tensors: it needs --device cuda (or auto on a GPU host)"
            )
        if self.tensor_plane == "nccl" and self.device.runtimes_per_gpu > 1:
            raise ConfigError(
                "--transport nccl needs one GPU per runtime (NCCL refuses two ranks on one GPU); runtimes that "
                f"share a GPU (--runtimes-per-gpu {self.device.runtimes_per_gpu}) use --transport inline or gloo"
            )
        if self.device.runtimes_per_gpu > 1 and self.dist.backend == "ray":
            raise ConfigError(
                "--runtimes-per-gpu applies to runtimes amoe starts itself: Ray gives each runtime a GPU of its own"
            )
        if self.executor.kind == "emulated" and self.device.kind == "cuda":
            raise ConfigError("emulated GPUs hold no tensors: --executor emulated runs with --device cpu")
        if self.emulation.decode_only and self.executor.kind != "emulated":
            raise ConfigError("emulation.decode_only needs --executor emulated (real weights must prefill)")
        if self.emulation.expert_gpu and (self.executor.kind != "emulated" or self.parallel.mode == "ep"):
            raise ConfigError(
                "--expert-gpu times the expert runtimes of an emulated aep or pingpong deployment (an EP device "
                f"runs attention and experts on one GPU); got --executor {self.executor.kind} "
                f"--parallel {self.parallel.mode}"
            )
        offloads = self.offload.budget is not None and self.executor.kind == "torch"
        if offloads and self.parallel.mode not in ("local", "aep"):
            raise ConfigError(
                f"--offload-budget serves --parallel local or aep (expert runtimes hold the store); got --parallel "
                f"{self.parallel.mode}"
            )

        self._check_eplb()

    def _check_eplb(self) -> None:
        if not self.eplb.live:
            return
        par = self.parallel
        if par.mode not in ("aep", "ep", "pingpong"):
            raise ConfigError(
                "--num-redundant-experts and --enable-eplb serve --parallel aep (its experts are queues a replica "
                f"can join), or ep / pingpong (a stop-the-world rebalance); got --parallel {par.mode}"
            )
        if self.offload.budget is not None:
            raise ConfigError(
                "--num-redundant-experts and --enable-eplb do not combine with --offload-budget"
            )
        if par.mode == "ep" and par.ep_pipelines is not None:
            raise ConfigError("--enable-eplb and --num-redundant-experts do not combine with --ep-pipelines")
        devices, flag = (
            (par.attn_ranks, "--attn-ranks") if par.mode == "ep" else (par.expert_ranks, "--expert-ranks")
        )
        if devices < 2:
            raise ConfigError(f"redundant experts and rebalancing need {flag} 2 or more")

    @property
    def tensor_plane(self) -> str:
        """The transport's plane with auto decided: NCCL between GPU runtimes of one host that own a GPU each, inline
        otherwise (the ZeroMQ frame; GPU tensors are staged through pinned host memory). `device.kind` auto counts
        as CPU here: `amoe.device_check.resolve` decides it before a deployment starts."""
        if self.transport.plane != "auto":
            return self.transport.plane
        one_gpu_each = self.device.runtimes_per_gpu == 1
        return (
            "nccl" if self.device.kind == "cuda" and one_gpu_each and not self.dist.multi_node else "inline"
        )

    def replace(self, **sections: dict) -> AmoeConfig:
        """A copy with some fields of some sections changed, e.g. replace(cache={"num_kv_blocks": 64})."""
        changed = {}
        for name, values in sections.items():
            if name not in _SECTIONS:
                raise ConfigError(f"unknown config section {name!r}")
            changed[name] = _build_section(name, values, base=getattr(self, name))
        return dataclasses.replace(self, **changed)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def changes(self) -> dict:
        """The sections and fields that differ from the built-in defaults: a short config file that reads back to
        this config (defaults that come from the environment, such as AMOE_DEVICE, stay the reader's)."""
        default = AmoeConfig()
        out: dict[str, dict] = {}
        for name in _SECTIONS:
            mine, theirs = dataclasses.asdict(getattr(self, name)), dataclasses.asdict(getattr(default, name))
            if changed := {k: v for k, v in mine.items() if v != theirs[k]}:
                out[name] = changed
        return out

    @classmethod
    def from_dict(cls, data: dict) -> AmoeConfig:
        """The config of a JSON object of sections. Also read: a `plan` block (`amoe plan --out`'s record of its
        prediction: logged, not a setting) and the emulated executor's settings under their former section,
        `executor` (read as `emulation`'s, with one log line)."""
        if not isinstance(data, dict):
            raise ConfigError("config must be a JSON object of sections")
        data = dict(data)
        if PLAN_KEY in data:
            _log_plan(data.pop(PLAN_KEY))
        return cls().replace(**_former_sections(data))

    @classmethod
    def from_file(cls, path: str | Path) -> AmoeConfig:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno}"
            ) from None
        return cls.from_dict(data)


_SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(AmoeConfig)}
# The top-level key of a config file that holds `amoe plan`'s record of a plan (its deployment and predicted
# figures): a file that serves the plan also says what it was planned to do. `summary` is the line logged.
PLAN_KEY = "plan"
# Sections whose fields lived in another section before: the emulated executor's settings sat in `executor`
# beside `kind`. Their former spellings (`--executor-gpu`, a file's "executor": {"gpu": ...}) still work.
_FORMER_SECTION = {"emulation": "executor"}


def _log_plan(plan) -> None:
    if not isinstance(plan, dict):
        raise ConfigError(f"the config's {PLAN_KEY!r} block must be an object (amoe plan --out writes it)")
    logger.info("[config] planned by amoe plan: %s", plan.get("summary", "(no summary)"))


def _former_sections(data: dict) -> dict:
    """`data` with the fields a section held before moved to their section now (one log line when any moved)."""
    for now, former in _FORMER_SECTION.items():
        held = data.get(former)
        if not isinstance(held, dict):
            continue
        moved = {k: v for k, v in held.items() if k in {f.name for f in dataclasses.fields(_SECTIONS[now])}}
        if not moved:
            continue
        current = data.get(now, {})
        if not isinstance(current, dict):
            raise ConfigError(f"config section {now!r} must be an object")
        if both := sorted(set(moved) & set(current)):
            raise ConfigError(f"{former}.{both[0]} and {now}.{both[0]} both given: keep {now}.{both[0]}")
        logger.info(
            "[config] read %s as %s (their section now)",
            ", ".join(f"{former}.{k}" for k in moved), ", ".join(f"{now}.{k}" for k in moved),
        )  # fmt: skip
        data = {**data, former: {k: v for k, v in held.items() if k not in moved}, now: {**current, **moved}}
    return data


def _build_section(name: str, values: dict, base=None):
    section_cls = _SECTIONS[name]
    if not isinstance(values, dict):
        raise ConfigError(f"config section {name!r} must be an object")
    known = {f.name for f in dataclasses.fields(section_cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting {name}.{unknown[0]} (known: {', '.join(sorted(known))})")
    base = base if base is not None else section_cls()
    try:
        return dataclasses.replace(base, **values)
    except TypeError as exc:
        raise ConfigError(f"bad value in section {name!r}: {exc}") from None


# ---- CLI flags generated from the dataclasses: --<section>-<field>, plus short aliases users expect.

# vLLM's spellings of the same settings, with the same meaning (`vllm serve --help`): a command line copied from
# vLLM's docs starts `amoe serve`. --help lists them in a group of their own.
_VLLM_ALIASES = {
    ("model", "path"): "--model",
    ("model", "dtype"): "--dtype",
    ("model", "max_model_len"): "--max-model-len",
    ("model", "generation_config"): "--generation-config",
    ("cache", "max_num_seqs"): "--max-num-seqs",
    ("device", "memory_utilization"): "--gpu-memory-utilization",
    ("server", "host"): "--host",
    ("server", "port"): "--port",
    ("server", "api_key"): "--api-key",
    ("server", "served_model_name"): "--served-model-name",
    ("server", "seed"): "--seed",
    ("server", "tool_call_parser"): "--tool-call-parser",
    ("eplb", "num_redundant_experts"): "--num-redundant-experts",
}
# vLLM's on/off flags, given without a value (`--enable-auto-tool-choice`); amoe's own spelling takes one.
_VLLM_SWITCHES = {
    ("server", "enable_auto_tool_choice"): "--enable-auto-tool-choice",
    ("eplb", "enable"): "--enable-eplb",
}

_ALIASES = {
    **_VLLM_ALIASES,
    ("device", "kind"): "--device",
    ("device", "runtimes_per_gpu"): "--runtimes-per-gpu",
    ("parallel", "mode"): "--parallel",
    ("parallel", "attn_ranks"): "--attn-ranks",
    ("parallel", "expert_ranks"): "--expert-ranks",
    ("parallel", "threads_per_rank"): "--threads-per-rank",
    ("parallel", "max_runtimes"): "--max-runtimes",
    ("parallel", "ep_pipelines"): "--ep-pipelines",
    ("parallel", "ep_kernel"): "--ep-kernel",
    ("scheduler", "policy"): "--scheduler",
    ("transport", "plane"): "--transport",
    ("executor", "kind"): "--executor",
    ("emulation", "gpu"): "--gpu",
    ("emulation", "expert_gpu"): "--expert-gpu",
    ("emulation", "time_scale"): "--time-scale",
    ("emulation", "routing"): "--routing",
    ("emulation", "step_variance"): "--step-variance",
    ("server", "api_key_file"): "--api-key-file",
    ("dist", "nnodes"): "--nnodes",
    ("dist", "node_rank"): "--node-rank",
    ("dist", "init_addr"): "--dist-init-addr",
    ("dist", "runtimes_per_node"): "--runtimes-per-node",
    ("dist", "node_map"): "--node-map",
    ("dist", "node_ip"): "--node-ip",
    ("dist", "timeout_s"): "--dist-timeout-s",
    ("dist", "cluster_secret_file"): "--cluster-secret-file",
    ("dist", "backend"): "--distributed-backend",
}


def _default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _flag_type(section_cls, name: str):
    hint = typing.get_type_hints(section_cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if args else hint
    return _bool_flag if hint is bool else hint


def _bool_flag(text: str) -> bool:
    """`--flag true|false` (argparse's bool() would take "false" for True)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def add_config_flags(
    parser: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(_SECTIONS)
) -> argparse._ArgumentGroup:
    """Adds one flag per config field (default None = keep the config file's or the built-in value); those vLLM
    spells too go in a group of their own, which is returned (for the command's other vLLM flags)."""
    parser.add_argument("--config", metavar="FILE", help="JSON file of config sections")
    vllm = parser.add_argument_group("vLLM's flags", "the same spelling and meaning as `vllm serve`'s")
    for section in sections:
        own = parser.add_argument_group(f"{section} options")
        section_cls = _SECTIONS[section]
        for f in dataclasses.fields(section_cls):
            names = _flag_names(section, f.name)
            group = vllm if (section, f.name) in _VLLM_ALIASES else own
            if (section, f.name) in _VLLM_SWITCHES:
                vllm.add_argument(
                    _VLLM_SWITCHES[(section, f.name)], dest=f"{section}__{f.name}", action="store_const",
                    const=True, default=None, help=f"(--{section}-{f.name} true)".replace("_", "-"),
                )  # fmt: skip
            group.add_argument(
                *names,
                dest=f"{section}__{f.name}",
                type=_flag_type(section_cls, f.name),
                default=None,
                metavar=f.name.upper(),
                help=f"(default: {_default_of(f)})",
            )
    if "eplb" in sections:
        vllm.add_argument(
            "--eplb-config", dest="eplb_json", type=_json_object, default=None, metavar="JSON",
            help='vLLM\'s EPLBConfig as JSON, e.g. \'{"window_size": 1000, "step_interval": 3000, '
            '"num_redundant_experts": 2, "log_balancedness": true}\' (the --eplb-* flags win over it)',
        )  # fmt: skip
    return vllm


def _json_object(text: str) -> dict:
    """A flag's JSON object value (argparse turns the error into its one-line usage message)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of settings")
    return value


def _flag_names(section: str, name: str) -> list[str]:
    """A field's flags: its alias (if any), --<section>-<field>, and --<former section>-<field> where the field
    lived in another section before (--executor-gpu for --emulation-gpu)."""
    names = [f"--{s}-{name}".replace("_", "-") for s in (section, _FORMER_SECTION.get(section)) if s]
    return [_ALIASES[(section, name)], *names] if (section, name) in _ALIASES else names


def command_flags(config: AmoeConfig, always: tuple[str, ...] = ()) -> list[str]:
    """The flags that make `config` from the built-in defaults, each field by its first name (alias or
    --<section>-<field>), in the sections' order, and the `always` fields ("section.field") even at their
    defaults: a command line for people to read or paste; programs pass the config itself (`--config FILE`)."""
    changed = config.changes()
    flags = []
    for section in _SECTIONS:
        values = dataclasses.asdict(getattr(config, section))
        for name, value in values.items():
            if value is None or (name not in changed.get(section, {}) and f"{section}.{name}" not in always):
                continue  # a flag cannot unset a field: only fields whose default is None hold None
            flags += [_flag_names(section, name)[0], _flag_text(value)]
    return flags


def _flag_text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def config_from_args(args: argparse.Namespace) -> AmoeConfig:
    """The config file (if any) overlaid with the flags given on the command line."""
    config = AmoeConfig.from_file(args.config) if getattr(args, "config", None) else AmoeConfig()
    changes: dict[str, dict] = {}
    if getattr(args, "eplb_json", None):  # vLLM's --eplb-config: its field names are the section's
        changes["eplb"] = dict(args.eplb_json)
    for key, value in _dist_env().items():  # flags win over the environment
        if getattr(args, f"dist__{key}", None) is None:
            changes.setdefault("dist", {})[key] = value
    for key, value in vars(args).items():
        if "__" in key and value is not None:
            section, name = key.split("__", 1)
            changes.setdefault(section, {})[name] = value
    return config.replace(**changes)


def _dist_env() -> dict:
    """The dist section from AMOE_<FIELD> variables (what an orchestrator sets per pod or task)."""
    from amoe import envs

    values = {}
    for f in dataclasses.fields(DistSection):
        text = envs.flag_variable(_ALIASES[("dist", f.name)])
        if text is None:
            continue
        kind = _flag_type(DistSection, f.name)
        try:
            values[f.name] = kind(text)
        except ValueError:
            raise ConfigError(f"AMOE_{f.name.upper()}={text!r} is not a valid {kind.__name__}") from None
    return values

"""Which runtime does what: the one Placement of every `--parallel` mode (AMoE §3.3).

Torch-free, so the coordinator can ask which runtimes to start without reading the model: the roles depend only on
the parallel section; which runtime hosts which expert also needs the model's number of experts, which the runtimes
know when they start.
"""

from __future__ import annotations

from dataclasses import dataclass

from amoe.config import AmoeConfig, DistSection, ParallelSection
from amoe.errors import ConfigError

ATTENTION, EXPERT = "attention", "expert"


def runtime_roles(parallel: ParallelSection) -> tuple[str, ...]:
    """The role of each runtime, by runtime id: aep and pingpong run A attention runtimes, then M expert runtimes;
    ep runs N runtimes that each take requests (role "attention") and host their share of the experts."""
    if parallel.mode == "ep":
        return (ATTENTION,) * parallel.attn_ranks
    return (ATTENTION,) * parallel.attn_ranks + (EXPERT,) * parallel.expert_ranks


def runtime_slots(parallel: ParallelSection) -> int:
    """Runtime ids the cluster may ever use at once: aep grows and shrinks under `amoe scale` up to
    `parallel.max_runtimes` (never fewer than it starts with); the lock-step modes keep the runtimes they start."""
    start = len(runtime_roles(parallel))
    return max(start, parallel.max_runtimes) if parallel.mode == "aep" else start


@dataclass(frozen=True)
class Placement:
    """attn_runtime[r] serves attention DP rank r; expert_runtime[e] hosts expert e of every block."""

    attn_runtime: tuple[int, ...]
    expert_runtime: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.attn_runtime or not self.expert_runtime:
            raise ConfigError("a placement needs at least one attention rank and one expert")
        if len(set(self.attn_runtime)) != len(self.attn_runtime):
            raise ConfigError(f"two attention ranks share a runtime: {self.attn_runtime}")
        if min(self.attn_runtime + self.expert_runtime) < 0:
            raise ConfigError("runtime ids must be >= 0")

    @classmethod
    def of(cls, parallel: ParallelSection, num_experts: int) -> Placement:
        """The placement `--parallel` asks for, for a model of `num_experts` experts."""
        if parallel.mode == "ep":
            return cls.expert_parallel(parallel.attn_ranks, num_experts)
        return cls.disaggregated(parallel.attn_ranks, parallel.expert_ranks, num_experts, parallel.expert_map)

    @classmethod
    def disaggregated(
        cls, num_attn_ranks: int, num_expert_ranks: int, num_experts: int, expert_map: str | None = None
    ) -> Placement:
        """Runtimes 0..A-1 run attention; expert e goes to runtime A + e mod M (paper §3.3), or to A + m for the
        m that `expert_map` ("m0,m1,...", one per expert) names."""
        if num_expert_ranks > num_experts:
            raise ConfigError(
                f"parallel.expert_ranks ({num_expert_ranks}) exceeds the model's {num_experts} experts"
            )
        where = parse_expert_map(expert_map, num_experts, num_expert_ranks)
        return cls(
            attn_runtime=tuple(range(num_attn_ranks)),
            expert_runtime=tuple(num_attn_ranks + m for m in where),
        )

    @classmethod
    def expert_parallel(cls, num_devices: int, num_experts: int) -> Placement:
        """EP: device d is attention DP rank d and hosts the experts e with e mod N == d."""
        return cls(
            attn_runtime=tuple(range(num_devices)),
            expert_runtime=tuple(e % num_devices for e in range(num_experts)),
        )

    @property
    def num_runtimes(self) -> int:
        return max(self.attn_runtime + self.expert_runtime) + 1

    @property
    def roles(self) -> tuple[str, ...]:
        """By runtime id: "attention" for a runtime that takes requests (in EP it also hosts experts)."""
        attn = set(self.attn_runtime)
        return tuple(ATTENTION if r in attn else EXPERT for r in range(self.num_runtimes))

    @property
    def hosts(self) -> tuple[int, ...]:
        """The runtimes that host experts, in id order."""
        return tuple(sorted(set(self.expert_runtime)))

    def experts_of(self, runtime: int) -> list[int]:
        return [e for e, r in enumerate(self.expert_runtime) if r == runtime]

    def attn_rank_of(self, runtime: int) -> int | None:
        return self.attn_runtime.index(runtime) if runtime in self.attn_runtime else None


def parse_expert_map(text: str | None, num_experts: int, num_expert_ranks: int) -> tuple[int, ...]:
    """The expert runtime of each expert: `text` ("0,1,1,0", one per expert) or round robin. Every expert runtime
    must host at least one expert."""
    if text is None:
        return tuple(e % num_expert_ranks for e in range(num_experts))
    where = _int_list(text, "--parallel-expert-map must be numbers")
    if len(where) != num_experts:
        raise ConfigError(f"--parallel-expert-map names {len(where)} experts; the model has {num_experts}")
    if set(where) != set(range(num_expert_ranks)):
        raise ConfigError(
            f"--parallel-expert-map must place experts on every expert runtime 0..{num_expert_ranks - 1} and no "
            f"other; got {text!r}"
        )
    return where


def _int_list(text: str, what: str) -> tuple[int, ...]:
    """ "0,1,1" → (0, 1, 1); anything else is the one-line error `what` separated by commas."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{what} separated by commas; got {text!r}") from None


def node_map(dist: DistSection, num_runtimes: int) -> tuple[int, ...]:
    """The node of each runtime, by runtime id (docs/multinode.md): `dist.node_map` if given, else runtimes fill
    the nodes in placement order (attention runtimes first, then expert runtimes), `runtimes_per_node` each
    (default: as evenly as they go). One node: all on node 0."""
    if dist.node_map is not None:
        nodes = _int_list(dist.node_map, "--node-map must be node numbers")
        if len(nodes) != num_runtimes:
            raise ConfigError(f"--node-map names {len(nodes)} nodes for {num_runtimes} runtimes")
        if not all(0 <= n < dist.nnodes for n in nodes):
            raise ConfigError(f"--node-map names a node outside [0, {dist.nnodes}): {dist.node_map!r}")
        return nodes
    per_node = dist.runtimes_per_node or -(-num_runtimes // dist.nnodes)
    if per_node * dist.nnodes < num_runtimes:
        raise ConfigError(
            f"{num_runtimes} runtimes do not fit on {dist.nnodes} nodes of --runtimes-per-node {per_node}"
        )
    return tuple(r // per_node for r in range(num_runtimes))


def local_index(config: AmoeConfig, runtime: int) -> int:
    """Runtime `runtime`'s number among its node's runtimes, in placement order: the GPU it takes (docs/gpu.md). A
    Ray actor is given its own GPU by Ray (CUDA_VISIBLE_DEVICES), so there it is always 0."""
    if config.dist.backend == "ray":
        return 0
    nodes = _nodes_with(config, runtime)
    return sum(1 for r in range(runtime) if nodes[r] == nodes[runtime])


def node_of(config: AmoeConfig, runtime: int) -> int:
    """The node runtime `runtime` runs on."""
    return _nodes_with(config, runtime)[runtime]


def _nodes_with(config: AmoeConfig, runtime: int) -> tuple[int, ...]:
    """The start-up node map, extended on one node to a runtime `amoe scale` added past it."""
    nodes = node_map(config.dist, len(runtime_roles(config.parallel)))
    if runtime >= len(nodes):
        if config.dist.nnodes > 1:
            raise ConfigError(f"runtime {runtime} is past the start-up node map of {len(nodes)} runtimes")
        nodes += (0,) * (runtime + 1 - len(nodes))
    return nodes


def runtimes_on_node(config: AmoeConfig, node: int) -> int:
    """How many runtimes node `node` starts (its share of host memory and GPUs)."""
    if config.dist.backend == "ray":
        return 1
    return node_map(config.dist, len(runtime_roles(config.parallel))).count(node)

"""What `amoe bench compare` runs: the deployments (`Setup`: the planner's Deployment and what is measured of it),
the presets (which setups, which load points), the serving config of each (`serve_config`), and the cost model's
upper bound for it. See docs/findings.md."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from amoe.config import DEFAULT_POLICY, AmoeConfig, ParallelSection, ServerSection
from amoe.errors import ConfigError
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.serving import to_config


@dataclass(frozen=True)
class Setup:
    """One emulated deployment to load: what is served (the planner's `deployment`, at the preset's batch caps,
    with its scheduling `policy`, the model `profile` at `top_k`: serve_config) and how it is measured."""

    deployment: Deployment
    policy: str = DEFAULT_POLICY
    top_k: int = 1
    workload: str = "short"
    profile: str = "mixtral-8x7b-mqa"
    group: str = "main"  # setups of one group are compared with each other
    # runs at the preset's time scale × this: more GPUs need more host time per emulated s
    slowdown: float = 1.0

    @classmethod
    def of(
        cls, mode: str, attn: int, experts: int = 0, gpu: str = "a100-80g", gpus_per_node: int = 0, **knobs
    ) -> Setup:
        """`attn` attention runtimes (ep: devices) and `experts` expert runtimes (aep, pingpong) on `gpu`s, on nodes
        of `gpus_per_node` (0: one node; else messages between nodes take the network's time)."""
        dep = Deployment(
            mode, gpu, attn, "" if mode == "ep" else gpu, experts,
            micro_batches=ParallelSection().micro_batches, gpus_per_node=gpus_per_node or attn + experts,
        )  # fmt: skip
        return cls(dep, **knobs)

    @classmethod
    def from_record(cls, record: dict) -> Setup:
        """The setup a point recorded (`record`)."""
        knobs = {
            k: v for k, v in record.items() if k not in ("mode", "attn", "experts", "gpu", "gpus_per_node")
        }
        where = {k: record[k] for k in ("gpu", "gpus_per_node") if k in record}
        return cls.of(record["mode"], record["attn"], record.get("experts", 0), **where, **knobs)

    def record(self) -> dict:
        """The setup as a point records it (results.json's "setup"): flat, gpus_per_node 0 for one node."""
        d = self.deployment
        return {
            "mode": d.mode, "attn": d.num_attn, "experts": d.num_expert, "policy": self.policy, "top_k": self.top_k,
            "workload": self.workload, "profile": self.profile, "gpu": d.attn_gpu, "group": self.group,
            "gpus_per_node": d.gpus_per_node if d.gpus_per_node < self.num_gpus else 0, "slowdown": self.slowdown,
        }  # fmt: skip

    @property
    def mode(self) -> str:
        return self.deployment.mode

    @property
    def attn(self) -> int:
        return self.deployment.num_attn

    @property
    def experts(self) -> int:
        return self.deployment.num_expert

    @property
    def gpu(self) -> str:
        return self.deployment.attn_gpu

    @property
    def name(self) -> str:
        shape = f"ep{self.attn}" if self.mode == "ep" else f"{self.mode}{self.attn}+{self.experts}"
        policy = f"-{self.policy}" if self.mode == "aep" else ""
        return f"{shape}{policy}-top{self.top_k}-{self.workload}"

    @property
    def num_gpus(self) -> int:
        return self.attn + self.experts


@dataclass(frozen=True)
class Preset:
    """Setups swept over load fractions (of the cost-model bound), and the policy comparison at one load."""

    sweeps: tuple[Setup, ...]
    loads: tuple[float, ...]  # request rate as a fraction of the upper bound's rate
    # The policy comparison's load (of AEP's measured maximum), one every policy sustains; None: skip it. The
    # policies' throughputs are also compared at their maxima.
    policy_load: float | None
    policy_base: Setup | None
    duration_s: float  # emulated seconds of arrivals per load point
    time_scale: float
    attn_cap: int  # rows per attention step (AEP scheduler cap, EP/ping-pong admission cap)
    expert_cap: int
    extra: tuple[tuple[Setup, ...], ...] = field(default=())  # more groups, each swept like `sweeps`
    blocks: int | None = None  # keep only this many blocks of every profile (None: the model's depth)
    # The headline's maxima, AEP at EP's ITL and the policies' maxima from steady points (amoe.perf.studies.steady)
    steady: bool = False


# The policy the presets' setups are measured with and recorded under (their recorded runs', docs/findings.md): the
# comparison of `amoe bench compare` is defrag's against mtfs and flfs (EP runs no scheduler: only the record).
MEASURED_POLICY = "defrag"


def _measured(mode: str, attn: int, experts: int = 0, **knobs) -> Setup:
    return Setup.of(mode, attn, experts, policy=MEASURED_POLICY, **knobs)


_AEP = _measured("aep", 4, 4)
# AEP and EP run at one time scale. EP once ran at twice it: its Python barrier exchange cost each device
# ~2.6 ms of host time per block, all 8 waking together on 2 cores after each barrier; the C++ exchange
# (cpp/exchange.h) costs ~0.1 ms, and the plan check's EP plans measure within 6 % of their predictions at AEP's
# scale (experiments/2026-11-25-plan-check-full).
_EP = _measured("ep", 8)


# The routing every setup runs: skew-exp at its default λ (amoe.perf.model.routing: measured Mixtral skew).
ROUTING = "skew-exp"


def _group(name: str, *setups: Setup) -> tuple[Setup, ...]:
    return tuple(replace(s, group=name) for s in setups)


PRESETS: dict[str, Preset] = {
    "ci": Preset(
        sweeps=_group("main", _measured("aep", 2, 2), _measured("ep", 4)),
        loads=(0.1, 0.2), policy_load=None, policy_base=None,
        duration_s=0.2, time_scale=20.0, attn_cap=32, expert_cap=256, blocks=4,
    ),
    # 4 of Mixtral's 32 blocks: a short request lives ~1 s emulated, so the window [60 %, 100 %] of a 2 s point is
    # near steady state. Time scale 25 keeps the host (2 cores) at about one core at AEP's top load; the loads
    # reach EP's saturation and AEP's (experiments/2026-11-25-compare-quick-steady).
    "quick": Preset(
        sweeps=_group("main", _AEP, _EP),
        loads=(0.5, 1.0), policy_load=0.5, policy_base=_AEP,
        duration_s=2.0, time_scale=25.0, attn_cap=256, expert_cap=512, blocks=4, steady=True,
    ),
    # Each setup's maximum, top-2, the medium workload and two nodes (paper Figures 9-11). Time scale 40 keeps the
    # host near one core at 8 GPUs' top load; the 16-GPU group runs twice as slow again. About 75 min here.
    "full": Preset(
        sweeps=_group("main", _AEP, _EP),
        loads=(0.4, 0.8, 1.2), policy_load=0.5, policy_base=_AEP,
        duration_s=2.5, time_scale=40.0, attn_cap=256, expert_cap=512, blocks=4, steady=True,
        extra=(
            _group("top2", replace(_AEP, top_k=2), replace(_EP, top_k=2)),
            _group("medium", replace(_AEP, workload="medium"), replace(_EP, workload="medium")),
            # Figure 10's baseline: the 16-expert model on one 8-GPU node, for the scaling ratios below.
            _group(
                "16e8gpu",
                _measured("aep", 4, 4, profile="mixtral-8x7b-16e"),
                _measured("ep", 8, profile="mixtral-8x7b-16e"),
            ),
            _group(
                "16gpu",
                # Two 8-GPU nodes, as the paper's p4d pair (§5.2): runtimes on different nodes talk over the network.
                _measured("aep", 8, 8, profile="mixtral-8x7b-16e", gpus_per_node=8, slowdown=2.0),
                _measured("ep", 16, profile="mixtral-8x7b-16e", gpus_per_node=8, slowdown=2.0),
            ),
        ),
    ),
}  # fmt: skip


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"--preset must be one of {', '.join(PRESETS)}; got {name!r}")
    return PRESETS[name]


def only_groups(p: Preset, names: list[str]) -> Preset:
    """The preset restricted to the named setup groups; the policy comparison runs only with group main."""
    groups = [g for g in (p.sweeps, *p.extra) if g]
    known = {g[0].group for g in groups}
    if unknown := sorted(set(names) - known):
        raise ConfigError(
            f"--groups: no group {', '.join(unknown)} in this preset; it has {', '.join(sorted(known))}"
        )
    kept = [g for g in groups if g[0].group in names]
    main = "main" in names
    return replace(
        p, sweeps=kept[0], extra=tuple(kept[1:]),
        policy_base=p.policy_base if main else None, policy_load=p.policy_load if main else None,
    )  # fmt: skip


def time_scale(setup: Setup, p: Preset) -> float:
    """Wall seconds per emulated second for this setup."""
    return p.time_scale * setup.slowdown


def profile_name(setup: Setup, p: Preset) -> str:
    """The emulated profile the setup runs: `NAME:N` when the preset keeps N blocks (see models.model_profile)."""
    return setup.profile if p.blocks is None else f"{setup.profile}:{p.blocks}"


def emulated_timeouts(scale: float) -> dict:
    """The server section's request deadline and stall timeout (ServerSection's defaults, which count wall seconds)
    in emulated seconds: the defaults × the time scale. Why: a slow plan at a large time scale has ITLs of tens of
    wall seconds (A100 4 + 4 top-2 at 32 blocks: 0.31 emulated s × 136.3 = 42 s), and a new request's first token
    (its wave's next pass, then one iteration) comes after more than the default 60 s: the coordinator ended it
    with an error and the point lost part of its load (docs/findings.md)."""
    d = ServerSection()
    return {"request_timeout_s": d.request_timeout_s * scale, "stall_timeout_s": d.stall_timeout_s * scale}


def load_settings(scale: float) -> dict:
    """The sections every emulated deployment under load is served with beside its own: the load generator, not
    the coordinator's queue, decides the load (never refuse for overload); timeouts in emulated seconds."""
    return {
        "server": {"max_waiting": 1_000_000, **emulated_timeouts(scale)},
        "transport": {"timeout_s": 60.0},
    }


def serve_config(setup: Setup, p: Preset, seed: int) -> AmoeConfig:
    """What one setup serves: its deployment at the preset's caps on emulated GPUs (port 0: ServerProcess)."""
    deployment = replace(setup.deployment, attn_cap=p.attn_cap, expert_cap=p.expert_cap)
    emulation = {
        "profile": profile_name(setup, p), "top_k": setup.top_k, "routing": ROUTING, "seed": seed,
        "time_scale": time_scale(setup, p),
        # Decode only, as the paper measures (prefill skipped, KV as if written): the bound counts decode tokens.
        "decode_only": True,
    }  # fmt: skip
    # Each deployment's maximum: a rank takes as many requests as its KV holds (as the recorded runs did). AEP
    # needs far more in flight than its batch caps to fill them (docs/simulation.md "Simulation"); with the default
    # 256 per rank the quick preset's AEP measured 0.48 of its bound instead of ~0.8.
    config = to_config(deployment, max_num_seqs=1_000_000, policy=setup.policy, emulation=emulation)
    return config.replace(**load_settings(time_scale(setup, p)))


def _bound(setup: Setup, p: Preset, deployment, full: bool = False) -> float:
    from amoe.bench.workloads import PAPER_WORKLOADS
    from amoe.perf.model import cost_model
    from amoe.perf.model.hosts import host_overhead
    from amoe.perf.model.models import model_profile
    from amoe.perf.model.routing import routing_inclusion
    from amoe.perf.plan import bounds

    model = model_profile(profile_name(setup, p), setup.top_k)
    if full:
        model = bounds.full_depth(model)
    inclusion = routing_inclusion(model, ROUTING)
    ctx = cost_model.mean_decode_context(*PAPER_WORKLOADS[setup.workload])
    return bounds.predict(model, deployment, inclusion, ctx, host_overhead("amoe-paper")).tokens_per_s


def upper_bound(setup: Setup, p: Preset, max_attn_batch: int | None = None, full: bool = False) -> float:
    """Output tokens/s no schedule can beat on the setup's GPUs placed as AEP would (attention + expert GPUs), with
    the routing's skew on the expert side (amoe.perf.plan.bounds): every GPU busy at its most efficient batch
    within the deployment's caps, KV capacity respected. `full`: at the model's full depth (the ratio between
    deployments is the same either way: a truncated profile pays its share of the head)."""
    attn = setup.attn if setup.mode != "ep" else setup.attn // 2
    dep = Deployment(
        "aep", setup.gpu, attn, setup.gpu, setup.num_gpus - attn, max_attn_batch or p.attn_cap, p.expert_cap,
        gpus_per_node=setup.deployment.gpus_per_node,
    )  # fmt: skip
    return _bound(setup, p, dep, full)


def ep_upper_bound(setup: Setup, p: Preset, seed: int = 0, full: bool = False) -> float:
    """The cost model's best case for barrier-synchronised EP on the setup's GPUs (amoe.perf.plan.bounds: the
    all-to-alls' latency and one grouped GEMM per device) under the routing the bench runs, each device batching
    up to the attention cap. With upper_bound it says what AEP / EP ratio the GPUs alone allow."""
    dep = Deployment(
        "ep",
        setup.gpu,
        setup.num_gpus,
        attn_cap=p.attn_cap,
        gpus_per_node=setup.deployment.gpus_per_node,
    )
    return _bound(setup, p, dep, full)


def mean_output_tokens(workload: str) -> float:
    from amoe.bench.workloads import PAPER_WORKLOADS

    low, high = PAPER_WORKLOADS[workload][1]
    return (low + high) / 2

"""What the user asks `amoe plan` for (`PlanRequest`: the model, the GPUs at hand, the workload, the objective and
the search's knobs), what a plan is (`Plan`: a deployment, its prediction and cost), and the checks of the request's
names."""

from __future__ import annotations

from dataclasses import dataclass, replace

from amoe.config import DEFAULT_POLICY, POLICIES
from amoe.errors import ConfigError
from amoe.perf.model.gpus import GPUS
from amoe.perf.model.models import ModelProfile, model_profile
from amoe.perf.model.routing import DEFAULT_LAMBDA
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.prediction import Prediction

ATTN_CAPS = (32, 64, 128, 256, 512, 1024)


EXPERT_CAPS = (256, 512, 1024)


MICRO_BATCHES = (2, 3, 4)


# `--aep-policy best`: each AEP plan refined with each of these and served with the one whose simulation gives more
# within the ITL objective (ties: the first). Why per plan: under 100 ms waves was the better on 3 of the 100 ms
# table's 4 AEP plans and defrag on the fourth (A100 top-1, where a rank holds less than one wave of requests).
BEST = "best"


BEST_OF = ("waves", "defrag")


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks `amoe plan` for."""

    profile: str  # a named model profile, or (with model_dir) the checkpoint's name
    gpus: dict[str, int]  # available GPUs by type
    workload: str = "short"
    top_k: int | None = None
    routing: str = f"skew-exp:{DEFAULT_LAMBDA:g}"
    itl_slo_ms: float | None = None
    prices: dict[str, float] | None = None  # $ per GPU-hour by type
    gpus_per_node: int = 8
    host: str = "amoe-paper"
    modes: tuple[str, ...] = ("aep", "ep", "pingpong")
    seed: int = 0
    attn_caps: tuple[int, ...] = ATTN_CAPS
    expert_caps: tuple[int, ...] = EXPERT_CAPS
    balanced: bool = True  # also try the skew-balanced expert placement
    replicate: bool = True  # also try copies of a smaller deployment behind one load balancer
    simulate_top: int = (
        3  # refine this many of the best plans by simulation; 0: bounds only (no refinement at all)
    )
    # ... and, of each mode, the best plan of this many shapes (GPUs in each role, copies, micro-batches): the best
    # by the bound can need far more requests in flight to fill its batches than a smaller split (H100 top-1).
    simulate_per_mode: int = 3
    # ... and, of a mode whose refined plans all miss the ITL objective, up to this many of its next plans, one at
    # a time, until one meets it (search).
    refine_retries: int = 3
    model_dir: str | None = None  # plan for this checkpoint's config.json instead of a named profile
    # EP deployments with EPS-MoE's expert pipeline, PN and kernel chosen by `auto` (`amoe plan --eps`)
    eps: bool = False
    # the GPUs' step-time variance the plans assume (amoe.perf.model.variance): sourced | off | SPREAD[,...]
    step_variance: str = "sourced"
    # Frontier planning: a mean decode context instead of the workload's (e.g. 2,000 tokens, as the
    # published DeepSeek-V3 deployments ran), and EP also as deployed at scale: EPLB's redundant experts (this
    # many) and two-batch overlap.
    context: float | None = None
    ep_redundant_experts: int = 0
    # the scheduling policy AEP plans are simulated with and served with (`amoe serve --scheduler`)
    # The scheduling policy AEP plans are simulated, measured and served with (`--aep-policy`): the default
    # (amoe.config.DEFAULT_POLICY, waves: docs/scheduler.md), checked against defrag on the 100 ms table's AEP plans
    # before the table was rerun with it (docs/findings.md).
    aep_policy: str = DEFAULT_POLICY


@dataclass(frozen=True)
class Plan:
    deployment: Deployment
    prediction: Prediction
    cost_per_mtok: float | None  # $ per million output tokens, with prices

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.prediction.tokens_per_s / self.deployment.num_gpus


def parse_gpus(text: str) -> dict[str, int]:
    """ "a100-80g:8,h100:4" → {"a100-80g": 8, "h100": 4}."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        if name not in GPUS:
            raise ConfigError(f"--gpus: unknown GPU {name!r}; choose from {', '.join(GPUS)}")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--gpus wants TYPE:COUNT with a positive count; got {part.strip()!r}")
        out[name] = out.get(name, 0) + int(count)
    return out


def parse_prices(text: str | None, gpus: dict[str, int]) -> dict[str, float] | None:
    """ "a100-80g=1.5,h100=3" → $ per GPU-hour; every GPU type of --gpus needs one."""
    if not text:
        return None
    prices: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        try:
            prices[name] = float(value)
        except ValueError:
            raise ConfigError(f"--price wants TYPE=DOLLARS_PER_HOUR; got {part.strip()!r}") from None
        if prices[name] < 0:
            raise ConfigError(f"--price for {name} must be >= 0")
    missing = sorted(set(gpus) - set(prices))
    if missing:
        raise ConfigError(f"--price has no price for {', '.join(missing)}")
    return prices


def plan_profile(req: PlanRequest) -> ModelProfile:
    """The model a plan is for: a named profile, or the shapes of a checkpoint's config.json (any supported
    family; no weights are read)."""
    if req.model_dir is None:
        return model_profile(req.profile, req.top_k)
    from amoe.model.config import load_model_config
    from amoe.perf.model.shapes import profile_of

    profile = profile_of(load_model_config(req.model_dir), name=req.profile)
    if req.top_k is None or req.top_k == profile.top_k:
        return profile
    if not 1 <= req.top_k <= profile.num_experts:
        raise ConfigError(f"top_k must be in [1, {profile.num_experts}] for {req.profile}; got {req.top_k}")
    return replace(profile, top_k=req.top_k)


def check_policy(policy: str) -> str:
    """`policy` if it is a scheduling policy amoe serves with (amoe.config.POLICIES) or BEST, else a ConfigError."""
    if policy not in (*POLICIES, BEST):
        raise ConfigError(f"--aep-policy must be one of {', '.join((*POLICIES, BEST))}; got {policy!r}")
    return policy

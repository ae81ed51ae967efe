"""A deployment the planner considers: its mode, GPUs in each role, batch caps, expert placement and copies, and
its one-line description (what `amoe plan` prints)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Deployment:
    """A candidate deployment: which mode, how many GPUs of which type in which role, the batch caps."""

    mode: str  # aep | ep | pingpong
    attn_gpu: str
    num_attn: int  # ep: the devices of one EP group
    expert_gpu: str = ""
    num_expert: int = 0
    attn_cap: int = 256  # rows per attention step (ep / pingpong: a device's batch)
    expert_cap: int = 512  # rows per expert step (aep)
    micro_batches: int = 1  # pingpong's m
    replicas: int = 1  # independent copies of the deployment serving side by side (behind one load balancer)
    expert_map: tuple[int, ...] | None = None  # expert -> expert GPU (aep / pingpong); None: e mod num_expert
    gpus_per_node: int = 8  # which transfers cross hosts
    # ep: EPS-MoE's expert pipeline (amoe.perf.model.eps): PN (0: auto, the runtime's choice) and the kernel
    # (grouped | dense | auto); 1 and "": EP's one grouped step between two all-to-alls, as before.
    ep_pipelines: int = 1
    ep_kernel: str = ""

    @property
    def pipelined(self) -> bool:
        return self.mode == "ep" and (self.ep_pipelines != 1 or bool(self.ep_kernel))

    # EP as deployed at scale (amoe.perf.model.ep_scale): redundant expert copies placed by EPLB per
    # layer, and two-batch overlap of the exchange with compute.
    redundant_experts: int = 0
    two_batch_overlap: bool = False
    # Multi-token prediction (EP at scale): each request verifies `draft_tokens` drafted tokens a step (1 + draft
    # rows through every layer, the MTP module's layer once more a draft) and keeps `draft_acceptance` of them.
    draft_tokens: int = 0
    draft_acceptance: float = 0.0

    @property
    def tokens_per_request_step(self) -> float:
        """Tokens a request gains per decode step: 1, and with MTP its accepted drafts."""
        return 1.0 + self.draft_tokens * self.draft_acceptance

    @property
    def num_gpus(self) -> int:
        return self.replicas * (self.num_attn + self.num_expert)

    def gpus(self) -> dict[str, int]:
        """GPUs used, by type."""
        used = {self.attn_gpu: self.replicas * self.num_attn}
        if self.num_expert:
            used[self.expert_gpu] = used.get(self.expert_gpu, 0) + self.replicas * self.num_expert
        return used

    def experts_on(self, num_experts: int) -> list[list[int]]:
        """Experts of each expert GPU (ep: of each device)."""
        hosts = self.num_attn if self.mode == "ep" else self.num_expert
        where = self.expert_map or tuple(e % hosts for e in range(num_experts))
        return [[e for e in range(num_experts) if where[e] == g] for g in range(hosts)]


def describe(d: Deployment) -> str:
    copies = f" x{d.replicas} replicas" if d.replicas > 1 else ""
    if d.mode == "ep":
        pipeline = f" eps pn {d.ep_pipelines or 'auto'} {d.ep_kernel or 'grouped'}" if d.pipelined else ""
        scale = f" eplb+{d.redundant_experts}" if d.redundant_experts else ""
        scale += " tbo" if d.two_batch_overlap else ""
        scale += f" mtp{d.draft_tokens}@{d.draft_acceptance:g}" if d.draft_tokens else ""
        return f"ep {d.num_attn}x{d.attn_gpu}{copies} cap {d.attn_cap}{pipeline}{scale}"
    roles = f"{d.num_attn}x{d.attn_gpu} attn + {d.num_expert}x{d.expert_gpu} experts"
    extra = f" ecap {d.expert_cap}" if d.mode == "aep" else f" m={d.micro_batches}"
    placement = " balanced" if d.expert_map is not None else ""
    return f"{d.mode} {roles}{copies} cap {d.attn_cap}{extra}{placement}"

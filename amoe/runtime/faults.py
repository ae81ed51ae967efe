"""Fault injection, for the tests that prove one bad request or batch cannot take a runtime down: the debugging
switch AMOE_FAULTS="stage:token[,stage:token]" makes a runtime fail on purpose for requests whose prompt holds
`token`. Off (None) unless the variable is set; nothing else reads it.

Stages: `admit` (admission raises), `attend` (an attention batch holding such a request raises), `wedge` (that
batch never returns: the loop thread is stuck while the control thread goes on, which liveness must notice). Two
keyed by an expert id instead (docs/rebalancing.md): `join:E`, a replica of expert E (any block) fails to load its
weights; `joinwedge:E`, that load never returns. And one not keyed at all: `alloc:N`, the N-th payload announced to
this runtime on a gloo / nccl plane finds no memory (the communicator's inject_alloc_failure: it is received into a
discard buffer and dropped).
"""

from __future__ import annotations

import threading

from amoe import envs

STAGES = ("admit", "attend", "wedge", "join", "joinwedge")


class InjectedFault(RuntimeError):
    """Raised on purpose by AMOE_FAULTS."""


class Faults:
    def __init__(self, spec: str) -> None:
        self.tokens: dict[str, set[int]] = {stage: set() for stage in STAGES}
        self.alloc_failure: int | None = None  # the announced payload (1-based) whose buffer fails
        for item in filter(None, (part.strip() for part in spec.split(","))):
            stage, _, token = item.partition(":")
            if stage == "alloc" and token.isdigit() and int(token) >= 1:
                self.alloc_failure = int(token)
                continue
            if stage not in STAGES or not token.isdigit():
                raise ValueError(
                    f"AMOE_FAULTS: expected stage:token with stage in {STAGES}, or alloc:N, got {item!r}"
                )
            self.tokens[stage].add(int(token))

    @classmethod
    def from_env(cls) -> Faults | None:
        spec = envs.AMOE_FAULTS
        return cls(spec) if spec else None

    def check_join(self, experts: list[int]) -> None:
        """Fail (or never return from) a replica's weight load as `join` / `joinwedge` say for these experts."""
        if self.tokens["joinwedge"].intersection(experts):
            threading.Event().wait()  # forever: a load stuck in the checkpoint read
        if self.tokens["join"].intersection(experts):
            raise InjectedFault("injected join fault")

    def check(self, stage: str, prompts: list[list[int]]) -> None:
        """Fail as `stage` says if any prompt holds one of its tokens."""
        marked = self.tokens[stage]
        if not marked or not any(marked.intersection(p) for p in prompts):
            return
        if stage == "wedge":
            threading.Event().wait()  # forever: a loop stuck in a layer
        raise InjectedFault(f"injected {stage} fault")

"""Operator endpoints beside the OpenAI surface, behind the same API key as every endpoint but /health.

- `GET /admin/placement`: the live expert map (docs/rebalancing.md) — its epoch, the rebalance under way, the
  replicas of each (block, expert), each block's balancedness, the rebalances so far.
- `POST /admin/rebalance` {"replicas": [[[runtime, ...] per expert] per block] (optional), "wait": false}: start a
  rebalance now — to the given map, or to EPLB's map for the measured load — and answer when it has started (or,
  with `wait`, ended). 409 while another is under way or a runtime is being replaced.
- `GET /admin/scale`: the runtimes serving (attention, expert, the most there may be), the join or drain under
  way, and the joins and drains so far.
- `POST /admin/scale` {"expert_runtimes": "+1" | -1 | 3, "remove": [runtime, ...] (optional), "wait": false}: add or
  remove expert runtimes while serving (docs/rebalancing.md "Scaling"). A signed string or a negative number is a
  change, a plain number the count wanted. 400 naming the parameter for bad input; 409 while a scale, a
  rebalance or a replacement is under way.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from coordinator.api.openai_errors import ApiError
from coordinator.cluster.rebalance import RebalanceBusy
from coordinator.requests.backend import Backend

# The most replica ids a request may list (a map of 256 experts x 64 blocks x 8 replicas is 131072): a bound, so a
# body can never make the coordinator build an unbounded structure.
MAX_REPLICA_IDS = 1 << 20


class RebalanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: list[list[list[int]]] | None = Field(
        default=None, description="per block, per expert, the expert runtimes serving it; omitted: EPLB's map"
    )
    wait: bool = Field(default=False, description="answer once the rebalance has ended, not when it started")


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Any: the count or change is read by amoe.scaling, so the API and the CLI refuse the same input alike.
    expert_runtimes: Any = Field(default=None, description='"+1", -1 (a change) or 3 (the count wanted)')
    attention_runtimes: Any = Field(default=None, description="attention runtimes do not join or leave yet")
    remove: list[int] | None = Field(default=None, max_length=1024, description="which expert runtimes leave")
    wait: bool = Field(default=False, description="answer once every join and drain has ended")


def add_admin_routes(app: FastAPI, backend: Backend) -> None:
    add_scale_routes(app, backend)

    @app.get("/admin/placement")
    async def placement() -> dict[str, Any]:
        report = backend.placement()
        if report is None:
            raise ApiError(404, "this deployment's experts never move (a live placement serves --parallel aep)",
                           type="not_found_error")  # fmt: skip
        return report

    @app.post("/admin/rebalance")
    async def rebalance(body: RebalanceRequest | None = None) -> dict[str, Any]:
        body = body or RebalanceRequest()
        if body.replicas is not None and sum(len(w) for row in body.replicas for w in row) > MAX_REPLICA_IDS:
            raise ApiError(400, f"'replicas' lists more than {MAX_REPLICA_IDS} runtime ids", param="replicas")
        try:
            return await backend.rebalance(body.replicas, body.wait)
        except RebalanceBusy as exc:
            raise ApiError(409, str(exc), code="rebalance_busy") from None


def add_scale_routes(app: FastAPI, backend: Backend) -> None:
    @app.get("/admin/scale")
    async def shape() -> dict[str, Any]:
        report = backend.shape()
        if report is None:
            raise ApiError(404, "this deployment's runtimes are fixed (runtimes join and leave --parallel aep)",
                           type="not_found_error")  # fmt: skip
        return report

    @app.post("/admin/scale")
    async def scale(body: ScaleRequest) -> dict[str, Any]:
        try:
            return await backend.scale(body.expert_runtimes, body.attention_runtimes, body.remove, body.wait)
        except RebalanceBusy as exc:  # ScaleBusy too
            raise ApiError(409, str(exc), code="scale_busy") from None

"""Operator endpoints beside the OpenAI surface, behind the same API key as every endpoint but /health.

- `GET /admin/placement`: the live expert map (docs/rebalancing.md) — its epoch, the rebalance under way, the
  replicas of each (block, expert), each block's balancedness, the rebalances so far.
- `POST /admin/rebalance` {"replicas": [[[runtime, ...] per expert] per block] (optional), "wait": false}: start a
  rebalance now — to the given map, or to EPLB's map for the measured load — and answer when it has started (or,
  with `wait`, ended). 409 while another is under way or a runtime is being replaced.
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


def add_admin_routes(app: FastAPI, backend: Backend) -> None:
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

"""The coordinator's Prometheus metrics, all in one place (names: amoe_<component>_<quantity>_<unit>)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

OUTCOMES = ("success", "error", "aborted")


class CoordinatorMetrics:
    """One registry per app, so several servers in one process (tests) don't collide."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "amoe_coordinator_requests",
            "Finished API requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "amoe_coordinator_prompt_tokens", "Prompt tokens of admitted requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "amoe_coordinator_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.running = Gauge(
            "amoe_coordinator_running_requests", "Requests bound to a rank", registry=self.registry
        )
        self.waiting = Gauge(
            "amoe_coordinator_waiting_requests", "Requests waiting for KV space", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

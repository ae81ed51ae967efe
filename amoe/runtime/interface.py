"""What the control plane and the worker process ask of a runtime (`Runtime`), whichever kind it is: the AEP runtime
(amoe/runtime/aep_runtime.py) and the synchronous one of ep / pingpong (amoe/runtime/sync_runtime.py) both offer
it, and tests/test_seams.py checks both against it.

The worker's main thread builds it, reports it in Hello, `start`s it with the peer table, then drives it from the
control plane (amoe/runtime/control.py: `serve_commands`) until Shutdown, and `stop`s it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from amoe.model.spec import ModelConfig
from amoe.runtime.requests import HeadOutput, RankRequest
from amoe.sampling_params import SamplingParams
from amoe.wire import Message, PlacementState


class DataEndpoints(Protocol):
    """What Hello tells of a runtime's communicator (amoe._core.ZmqCommunicator): where peers reach it."""

    @property
    def endpoint(self) -> str: ...

    @property
    def secure_endpoint(self) -> str:
        """Its CURVE endpoint for peers on other hosts ("" on one host)."""


class Runtime(Protocol):
    """One runtime process's runtime, as its worker and control plane use it (main thread, unless said)."""

    id: int  # its runtime id
    role: str  # "attention" | "expert"
    model_config: ModelConfig  # Hello reports its vocabulary
    comm: DataEndpoints

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks of its attention rank (0 without one)."""

    @property
    def kv_free_blocks(self) -> int:
        """Free KV blocks of its attention rank now (0 without one)."""

    @property
    def max_model_len(self) -> int:
        """The longest context it serves."""

    def start(
        self,
        endpoints: list[str],
        generations: list[int],
        publish: Callable[[HeadOutput], None],
        placement: PlacementState | None = None,
    ) -> None:
        """Connect to the peers (their endpoints and process generations), take on the live `placement` (the
        coordinator's, when the deployment has one) and start the loop thread, which hands every head step's
        output to `publish`."""

    def linked(self) -> bool:
        """Every peer's tensor-plane link is built: it may say Ready."""

    def check(self) -> None:
        """Raise if the loop thread died, or a start-up link could not be made."""

    def add_request(
        self,
        request_id: int,
        prompt: list[int],
        params: SamplingParams,
        num_generated: int = 0,
        seq_ids: Sequence[int] = (),
    ) -> RankRequest:
        """Bind a request to its attention rank; AmoeError if the request itself is bad."""

    def abort(self, request_id: int) -> bool:
        """Mark a request aborted; False if it is unknown or finished already."""

    def expire_aborts(self) -> list[int]:
        """The aborted requests it gave up waiting for (their KV is freed): the coordinator is told they ended."""

    def reconnect(self, runtime: int, endpoint: str, generation: int = 0) -> int:
        """A peer was replaced by its process of `generation`; returns the rows sent to it again."""

    def resend_overdue(self) -> None:
        """Ask again for expert outputs awaited too long."""

    def place(self, msg: Message) -> None:
        """A placement command (LoadExperts, DropExperts, SetExpertMap: docs/rebalancing.md); its answers come
        from `placement_replies`. EngineDeadError where the runtime has no live placement."""

    def placement_replies(self) -> list[Message]:
        """Answers to placement commands that are ready to go to the coordinator."""

    @property
    def placement_busy(self) -> bool:
        """A placement command is under way: the control loop looks for its answer often."""

    @property
    def hosted_layers(self) -> list[tuple[int, int]]:
        """The (block, expert) layers whose weights it holds (an expert runtime of a live placement; else none):
        its Hello reports them, the coordinator's map is made of them."""

    def stats(self) -> dict[str, Any]:
        """The runtime report (docs/CONTRACTS.md "Runtime stats") its heartbeat carries."""

    def stop(self) -> None:
        """Stop the loop thread and close what it owns."""

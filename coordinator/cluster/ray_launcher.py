"""`--distributed-backend ray` (the optional extra `amoe[ray]`): every runtime is a Ray actor (amoe.ray_actor) on
one bundle of a placement group with one bundle per device, on a Ray cluster already running (`ray start --head`,
`ray start --address`). The cluster manager sees only "a runtime process" it can poll and kill: a lost actor is
replaced through the self-healing path, on the same bundle. Ray itself is imported only when this launcher is made.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import AmoeError, ConfigError
from coordinator.cluster.control_plane import ControlPlane
from coordinator.cluster.launcher import RuntimeHandle
from coordinator.cluster.nodes import Nodes

logger = logging.getLogger(__name__)


class RayProc:
    """A runtime actor as the cluster manager holds a process: poll / kill / wait / pid (and the host it runs on)."""

    def __init__(self, actor: Any, started: Any, runtime: int, role: str) -> None:
        import ray

        self._ray, self.actor, self.runtime, self.role = ray, actor, runtime, role
        self._started = started  # ObjectRef of (pid, node ip)
        self._ended = actor.wait.remote()  # ObjectRef of the worker's exit code
        self.pid, self.host = 0, None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ray = self._ray
        if self.pid == 0 and ray.wait([self._started], timeout=0)[0]:
            try:
                self.pid, self.host = ray.get(self._started)
                logger.info(
                    "%s runtime %d → Ray node %s (pid %d)", self.role, self.runtime, self.host, self.pid
                )
            except ray.exceptions.RayError as exc:  # the actor died, or could not start the worker
                logger.warning("%s runtime %d did not start: %s", self.role, self.runtime, _first_line(exc))
                self.returncode = 1
                return self.returncode
        if ray.wait([self._ended], timeout=0)[0]:
            try:
                self.returncode = ray.get(self._ended)
            except ray.exceptions.RayError:  # the actor (or its node) is gone, and the worker with it
                self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.returncode


class RayLauncher:
    """Places the runtimes on a running Ray cluster: one bundle per runtime, spread over its nodes; all of them reach
    the control plane over its CURVE endpoint."""

    secure = True

    def __init__(
        self,
        config: AmoeConfig,
        model_dir: str,
        plane: ControlPlane,
        num_runtimes: int,
        startup_timeout_s: float,
    ) -> None:
        """Joins the Ray cluster, places one bundle per runtime, and binds the control plane's CURVE endpoint on
        this (the coordinator's) Ray node."""
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError:
            raise ConfigError("--distributed-backend ray needs Ray: pip install 'amoe[ray]'") from None
        dist = config.dist
        if dist.cluster_secret_file is None:
            raise ConfigError(
                "--distributed-backend ray needs --cluster-secret-file, a file every Ray node holds at that path"
            )
        self.config, self.model_dir, self.timeout_s = config, model_dir, startup_timeout_s
        address = dist.init_addr or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(
                address=address, namespace=f"amoe-{os.getpid()}", log_to_driver=False, configure_logging=False
            )
        except (ConnectionError, RuntimeError) as exc:
            raise AmoeError(f"cannot join the Ray cluster at {address}: {_first_line(exc)}") from None
        self._ray = ray
        # One bundle per runtime (a device: a CPU, and with --device cuda a GPU, which Ray makes the actor's only
        # visible one), spread across the nodes.
        gpus = 1 if config.device.kind == "cuda" else 0
        bundle = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
        self.group = placement_group([bundle] * num_runtimes, strategy="SPREAD")
        if not ray.wait([self.group.ready()], timeout=dist.timeout_s)[0]:
            raise AmoeError(
                f"the Ray cluster could not place {num_runtimes} runtimes ({bundle} each) within "
                f"{dist.timeout_s:.0f} s: see `ray status`"
            )
        self._actor = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(_actor_class())
        logger.info("Ray cluster at %s: %d runtime bundles placed", address, num_runtimes)

        def to_node(identity: bytes, msg: wire.Message) -> None:
            plane.send(identity, msg, retry=False)

        nodes = Nodes(config, num_runtimes, startup_timeout_s, to_node, node_ip=dist.node_ip or self.node_ip)
        self.control = nodes.bind(plane.sock)  # the CURVE endpoint every actor's runtime connects to

    @property
    def node_ip(self) -> str:
        """This (the coordinator's) Ray node's address: where the CURVE control endpoint binds."""
        return self._ray.util.get_node_ip_address()

    async def open(self, roles: list[str]) -> None:
        """The placement group is ready already (placed when the launcher was made)."""

    def spawn(self, runtime: int, role: str, generation: int = 0) -> RayProc:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=runtime)
        actor = self._actor.options(scheduling_strategy=strategy).remote()
        spec = {
            "runtime": runtime, "role": role, "coordinator": self.control, "model_dir": self.model_dir,
            "config": self.config.to_dict(), "startup_timeout_s": self.timeout_s, "generation": generation,
        }  # fmt: skip
        return RayProc(actor, actor.start.remote(spec, self.config.dist.cluster_secret_file), runtime, role)

    def tick(self, now: float) -> None:
        """Ray watches its own nodes: a lost actor shows in its handle's poll."""

    def missing_nodes(self) -> list[int]:
        return []  # the placement group was placed whole

    def handle(self, frames: list[bytes]) -> bool:
        return False  # no node agents: Ray starts the runtimes

    def describe(self, runtime: int, handle: RuntimeHandle) -> dict[str, Any]:
        return {"host": handle.host}

    def stop(self) -> None:
        """The actors stop with their runtimes; the cluster manager kills what is left."""

    def close(self) -> None:
        """Remove the placement group and leave Ray (after the actors were killed: polling one needs Ray)."""
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
        self._ray.shutdown()


def _actor_class() -> type:
    from amoe.ray_actor import RuntimeActor

    return RuntimeActor


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]

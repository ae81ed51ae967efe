"""A runtime process: `python -m amoe.runtime.worker` with a WorkerSpec (JSON) on stdin, spawned by the coordinator's
cluster manager.

Start-up: name the process, die with the parent, build the runtime of the configured mode (load only its weights,
bind its data endpoint), say Hello (endpoint, KV blocks, max model length, vocabulary), receive the peer table
(Welcome), connect, start the engine and the loop thread. Then the main thread serves control commands and
heartbeats until Shutdown, and says Ready once its tensor-plane groups with every peer are built (at once on the
inline plane; meanwhile it already takes a Reconnect for a peer replaced during its start-up). Any failure is
reported as one Failed message and exit code 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch
import zmq

from amoe import wire
from amoe.config import AmoeConfig
from amoe.curve import ClusterKeys
from amoe.log import setup_logging
from amoe.process import die_with_parent, name_process
from amoe.runtime.control import Channel, serve_commands, token_publisher
from amoe.runtime.interface import Runtime

logger = logging.getLogger(__name__)


def make_runtime(spec: wire.WorkerSpec) -> Runtime:
    """The runtime of the configured mode: AEP (C++ engine) or a synchronous baseline (ep / pingpong)."""
    mode = AmoeConfig.from_dict(spec.config).parallel.mode
    if mode in ("ep", "pingpong"):
        from amoe.runtime.sync_runtime import SyncRuntime

        return SyncRuntime(spec)
    from amoe.runtime.aep_runtime import AepRuntime

    return AepRuntime(spec)


def run(spec: wire.WorkerSpec) -> int:
    """Start, serve until Shutdown; 0 on a clean stop, 1 after reporting a failure."""
    ctx = zmq.Context()
    identity = f"rt{spec.runtime}".encode()
    keys = ClusterKeys(**spec.curve) if spec.curve is not None else None
    control = Channel(ctx, spec.coordinator, identity, keys)
    outputs = Channel(ctx, spec.coordinator, identity + b".out", keys)  # the loop thread's own socket
    runtime = None
    try:
        runtime = make_runtime(spec)
        control.send(_hello(spec, runtime))
        welcome = control.wait_for(wire.Welcome, spec.startup_timeout_s)
        generations = welcome.generations or [0] * len(welcome.endpoints)
        publish = token_publisher(outputs, spec.runtime)
        runtime.start(welcome.endpoints, generations, publish, placement=welcome.placement)
        logger.debug("runtime %d: %s runtime started", spec.runtime, spec.role)
        serve_commands(control, runtime, ready=wire.Ready(spec.runtime))
        return 0
    except Exception as exc:  # noqa: BLE001 - any failure becomes one Failed line at the coordinator
        # The coordinator prints the one line users see; the traceback is for -v.
        logger.debug("runtime %d: failed", spec.runtime, exc_info=exc)
        control.send(wire.Failed(spec.runtime, f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        if runtime is not None:
            runtime.stop()
        control.close()
        outputs.close()
        ctx.term()


def _hello(spec: wire.WorkerSpec, runtime: Runtime) -> wire.Hello:
    """What the coordinator needs from a runtime it never looks inside: where it listens and what it can hold."""
    return wire.Hello(
        runtime=spec.runtime,
        role=spec.role,
        pid=os.getpid(),
        endpoint=runtime.comm.endpoint,
        num_kv_blocks=runtime.num_kv_blocks,
        max_model_len=runtime.max_model_len,
        vocab_size=runtime.model_config.vocab_size,
        secure_endpoint=runtime.comm.secure_endpoint or None,
        generation=spec.generation,
        **_model_shape(runtime),
    )


def _model_shape(runtime: Runtime) -> dict:
    """The expert grid and, on an expert runtime of a live placement, the layers it loaded (docs/rebalancing.md)."""
    cfg = runtime.model_config
    groups = cfg.router.num_groups if cfg.num_shared_experts == 0 else 1  # a shared expert is in no group
    return {
        "num_blocks": cfg.num_blocks,
        "num_expert_ids": cfg.num_expert_ids,
        "expert_groups": groups,
        "hosted": [list(layer) for layer in runtime.hosted_layers],
    }


def main() -> int:
    spec = wire.decode_spec(sys.stdin.buffer.read())
    name_process(f"amoe: {spec.role} runtime {spec.runtime}")
    die_with_parent(spec.parent_pid)
    # Ctrl-C, `timeout` and systemd's stop signal the whole process group: the coordinator drains the requests in
    # flight and then stops its runtimes itself (PR_SET_PDEATHSIG covers its death), so a runtime must not die
    # under it first, which the coordinator would take for a crash and heal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging()
    torch.set_num_threads(AmoeConfig.from_dict(spec.config).parallel.threads_per_rank)
    return run(spec)


if __name__ == "__main__":
    code = main()
    # run() has stopped and closed everything the runtime owns (its threads are daemons): skip the interpreter's
    # teardown of torch and of the model's objects, which took seconds of CPU per runtime on a busy host while the
    # coordinator waited for the exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

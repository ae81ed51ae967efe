"""The synchronous baselines of `--parallel`: `ep` (SGLang / vLLM expert parallelism) and `pingpong`
(MegaScale-Infer), on the same communicator, model layers, executors, KV cache and sampler as AEP, without the
C++ μ-queue scheduler. See docs/baselines.md."""

from amoe.runtime.sync.batch import TokenInbox
from amoe.runtime.sync.device import SyncDevice
from amoe.runtime.sync.ep import run_ep_loop
from amoe.runtime.sync.loops import run_sync_loop
from amoe.runtime.sync.pingpong import run_pingpong_loop, t_total

__all__ = [
    "SyncDevice",
    "TokenInbox",
    "run_ep_loop",
    "run_pingpong_loop",
    "run_sync_loop",
    "t_total",
]

"""Phase-2 transfers over NCCL between two GPU runtimes (two processes, one GPU each): messages of every size the
runtimes send — one row to tens of megabytes, token ids and float32 / bfloat16 / float16 hidden states — arrive
bit-exact, in a receive buffer on the receiver's own GPU, one direction at a time and both at once (what an attention
and an expert runtime do to each other all the time)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
import torch
from test_comm_basic import message, same

from amoe import core

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

SPAWN = mp.get_context("spawn")  # CUDA cannot be used in a forked child
WORLD = 2
TIMEOUT_S = 20.0  # a transfer pending this long fails its peer: the first pair set-up is slow, a hang is not
WAIT_S = 120.0  # for everything a test waits on: no test outlives its pytest timeout

# (rows, hidden, dtype): hidden 0 is a message of int64 token ids. From one row up to 64 MB, past NCCL's
# per-channel buffers (4 MB by default) so one transfer takes many steps.
SPECS = [
    (1, 0, torch.int64),
    (7, 0, torch.int64),
    (1, 64, torch.float32),
    (3, 4096, torch.bfloat16),
    (64, 1024, torch.float32),
    (200, 4096, torch.bfloat16),
    (513, 6144, torch.float16),
    (1000, 4096, torch.float32),
    (2, 16, torch.float16),
    (4096, 4096, torch.bfloat16),
    (4096, 4096, torch.float32),
    (1, 4096, torch.bfloat16),
]


def expected(src: int, i: int) -> core.Message:
    """Message i from `src`, on the CPU: both sides build it from the same seed, so the receiver knows its bytes."""
    rows, hidden, dtype = SPECS[i]
    return message(rows, hidden, dtype, seed=src * 1000 + i, tag=src * 1000 + i)


def on_device(m: core.Message, device: torch.device, i: int) -> core.Message:
    """`m` with its tensor on `device`, as a runtime's layer output is; every third one a column slice of a wider
    tensor (not contiguous), which the communicator must make contiguous before NCCL reads it."""
    data = m.data.to(device)
    if data.dim() == 2 and i % 3 == 0:
        wide = torch.zeros(data.shape[0], data.shape[1] + 8, dtype=data.dtype, device=device)
        wide[:, : data.shape[1]] = data
        data = wide[:, : data.shape[1]]
    return core.Message.from_bytes(m.to_bytes(), data)


def _peer(rank: int, plane: str, store_path: str, script: str, conn) -> None:
    """One runtime: its GPU, the NCCL group, the communicator; then it sends and receives as `script` says and
    reports what arrived. Everything is checked here: CUDA tensors do not cross the pipe. (plane "gloo" runs the
    same script on the CPU: how this file is checked on a host without a GPU.)"""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one host: NCCL's bootstrap stays on loopback
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if plane == "nccl":
        torch.cuda.set_device(
            rank
        )  # before the group and the communicator: the plane allocates on the current GPU
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group(
        plane, store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=WAIT_S)
    )
    # As the runtimes do (amoe/runtime/comm.py): one group per direction, so a large message each way never
    # waits behind the other's receive on one NCCL stream.
    groups = (dist.group.WORLD, dist.new_group(list(range(WORLD)), backend=plane))
    comm = core.ZmqCommunicator(
        rank, WORLD, bind="ipc", plane=plane, process_group=groups, timeout_s=TIMEOUT_S
    )
    conn.send(comm.endpoint)
    comm.connect(conn.recv())
    peer = 1 - rank
    sends = script == "both" or (script == "0to1") == (rank == 0)
    receives = script == "both" or not sends
    report = {"rank": rank, "received": [], "problems": []}
    if sends:
        outgoing = [on_device(expected(rank, i), device, i) for i in range(len(SPECS))]
        for m in outgoing:
            comm.send(peer, m)
    if receives:
        deadline = time.monotonic() + WAIT_S
        while len(report["received"]) < len(SPECS) and time.monotonic() < deadline:
            for m in comm.recv(0.05):
                i = (
                    int(m.meta()["request_id"][0]) // 1_000_000 - peer * 1000
                )  # message(): ids are tag * 1e6 + row
                if not 0 <= i < len(SPECS):
                    report["problems"].append(
                        f"a message no one sent (request id {m.meta()['request_id'][0]})"
                    )
                    continue
                report["received"].append(i)
                if m.src_runtime != peer:
                    report["problems"].append(f"message {i}: from {m.src_runtime}, not {peer}")
                if m.data.device != device:
                    report["problems"].append(f"message {i}: arrived on {m.data.device}, not {device}")
                if not same(expected(peer, i), on_host(m)):
                    report["problems"].append(f"message {i} {SPECS[i]}: bytes differ")
    if sends:  # the sender's transfers must all have completed, not only been handed over
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            s = comm.stats()
            if s["in_flight_send"] == 0 and s["backlog"] == 0 and s["messages_out"] == len(SPECS):
                break
            time.sleep(0.01)
    report["stats"] = comm.stats()
    conn.send(report)
    conn.recv()  # "done": the peer may still be receiving from this communicator
    comm.close()
    dist.destroy_process_group()


def on_host(m: core.Message) -> core.Message:
    return core.Message.from_bytes(m.to_bytes(), m.data.cpu())


def run(store_dir, script: str, plane: str = "nccl") -> list[dict]:
    """Both peers' reports; fails, never hangs, when one does not come."""
    store_dir.mkdir(parents=True, exist_ok=True)
    pipes = [SPAWN.Pipe() for _ in range(WORLD)]
    procs = [
        SPAWN.Process(
            target=_peer, args=(r, plane, str(store_dir / "store"), script, pipes[r][1]), daemon=True
        )
        for r in range(WORLD)
    ]
    conns = [parent for parent, _ in pipes]
    for p in procs:
        p.start()
    try:
        endpoints = [_recv(conn, proc, "its endpoint") for conn, proc in zip(conns, procs)]
        for conn in conns:
            conn.send(endpoints)
        return [_recv(conn, proc, "its report") for conn, proc in zip(conns, procs)]
    finally:
        for conn in conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send("done")
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _recv(conn, proc, what: str):
    deadline = time.monotonic() + WAIT_S + 60  # NCCL set-up, then the peer's own wait
    while not conn.poll(0.1):
        assert proc.is_alive(), (
            f"runtime process {proc.pid} died (exit {proc.exitcode}) before sending {what}"
        )
        assert time.monotonic() < deadline, f"runtime process {proc.pid} sent no {what} in time"
    return conn.recv()


def _check(report: dict, receives: bool, plane: str = "nccl") -> None:
    rank, s = report["rank"], report["stats"]
    assert s["plane"] == plane, rank
    assert report["problems"] == [], f"rank {rank}: {report['problems']}"
    assert s["timeouts"] == 0 and s["transfer_errors"] == 0 and s["failed_peers"] == [], f"rank {rank}: {s}"
    assert s["in_flight_send"] == 0 and s["in_flight_recv"] == 0, f"rank {rank}: {s}"
    assert sum(s["dropped"].values()) == 0 and s["send_dropped"] == 0, f"rank {rank}: {s}"
    if receives:
        assert sorted(report["received"]) == list(range(len(SPECS))), (
            f"rank {rank}: each message exactly once"
        )


@pytest.mark.timeout(400)
def test_variable_sized_transfers_arrive_bit_exact_one_way_then_the_other(tmp_path):
    for script, receiver in (("0to1", 1), ("1to0", 0)):
        reports = run(tmp_path / script, script)
        for report in reports:
            _check(report, receives=report["rank"] == receiver)


@pytest.mark.timeout(400)
def test_variable_sized_transfers_arrive_bit_exact_both_ways_at_once(tmp_path):
    for report in run(tmp_path, "both"):
        _check(report, receives=True)

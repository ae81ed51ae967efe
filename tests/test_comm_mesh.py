"""3 senders x 4 receivers in separate processes on every CPU plane: random sizes from one row to megabytes, random
interleaving; every message arrives exactly once and bit-identical."""

from __future__ import annotations

import multiprocessing as mp
import random
import time

import pytest
import torch
from test_comm_basic import same

from amoe import core

SPAWN = mp.get_context("spawn")
SENDERS, RECEIVERS, PER_PAIR = 3, 4, 10


def mesh_message(src: int, dst: int, i: int) -> core.Message:
    """Message i from src to dst: a reproducible size (1 row .. 4 MB), dtype and content; request ids name it."""
    gen = torch.Generator().manual_seed(src * 10_000 + dst * 100 + i)
    rng = random.Random(src * 10_000 + dst * 100 + i)
    n = int(2 ** rng.uniform(0, 10))  # 1 .. 1024 rows, log-uniform
    kind = rng.choice(["f32", "bf16", "ids"])
    if kind == "f32":
        data = torch.randn(n, 1024, generator=gen)  # up to 4 MB
    elif kind == "bf16":
        data = torch.randn(n, 640, generator=gen).to(torch.bfloat16)
    else:
        data = torch.randint(0, 50_000, (n,), generator=gen)
    ident = (src * 100 + dst) * 1000 + i
    return core.make_message(
        data,
        request_id=[ident] * n,
        kind=[core.EXPERT] * n,
        block=torch.randint(0, 32, (n,), generator=gen),
        index=torch.randint(0, 8, (n,), generator=gen),
        position=torch.arange(n),
        weight=torch.rand(n, generator=gen),
    )


def make_comm(rank: int, world: int, plane: str, store_path: str, timeout_s: float = 30.0):
    """A communicator for this process; gloo gets a process group rendezvousing through a FileStore."""
    pg = None
    if plane == "gloo":
        import torch.distributed as dist

        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        pg = dist.group.WORLD
    return core.ZmqCommunicator(rank, world, plane=plane, process_group=pg, timeout_s=timeout_s)


def _mesh_worker(rank: int, plane: str, store_path: str, conn) -> None:
    world = SENDERS + RECEIVERS
    comm = make_comm(rank, world, plane, store_path)
    conn.send(comm.endpoint)
    comm.connect(conn.recv())
    if rank < SENDERS:
        plan = [(dst, i) for dst in range(SENDERS, world) for i in range(PER_PAIR)]
        rng = random.Random(rank)
        rng.shuffle(plan)
        for dst, i in plan:
            comm.send(dst, mesh_message(rank, dst, i))
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0, 0.01))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s = comm.stats()
            if s["in_flight_send"] == 0 and s["backlog"] == 0 and s["messages_out"] == len(plan):
                break
            time.sleep(0.01)
        result = {"stats": comm.stats()}
    else:
        seen, bad = [], 0
        deadline = time.monotonic() + 60
        while len(seen) < SENDERS * PER_PAIR and time.monotonic() < deadline:
            for m in comm.recv(0.05):
                ident = int(m.meta()["request_id"][0]) if m.num_rows else -1
                src, dst, i = ident // 100_000, ident // 1000 % 100, ident % 1000
                ok = m.src_runtime == src and dst == rank and same(mesh_message(src, dst, i), m)
                seen.append((src, i))
                bad += not ok
        result = {"seen": seen, "bad": bad, "stats": comm.stats()}
    conn.send(result)
    conn.recv()  # everyone is done: closing now cannot cut a transfer short
    comm.close()


def run_workers(target, num: int, *args) -> list:
    """Starts num spawned workers target(rank, *args, conn), wires their endpoints, returns their results."""
    pipes = [SPAWN.Pipe() for _ in range(num)]
    procs = [SPAWN.Process(target=target, args=(r, *args, pipes[r][1]), daemon=True) for r in range(num)]
    for p in procs:
        p.start()
    try:
        endpoints = [parent.recv() for parent, _ in pipes]
        for parent, _ in pipes:
            parent.send(endpoints)
        results = [parent.recv() for parent, _ in pipes]
        for parent, _ in pipes:
            parent.send("done")
        for p in procs:
            p.join(30)
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plane", ["inline", "gloo"])
def test_every_message_arrives_once_and_bit_identical(plane, tmp_path):
    results = run_workers(_mesh_worker, SENDERS + RECEIVERS, plane, str(tmp_path / "store"))
    expected = sorted((src, i) for src in range(SENDERS) for i in range(PER_PAIR))
    for res in results[SENDERS:]:
        assert res["bad"] == 0
        assert sorted(res["seen"]) == expected  # exactly once
        s = res["stats"]
        assert s["plane"] == plane and s["messages_in"] == len(expected)
        assert sum(s["dropped"].values()) == 0 and s["timeouts"] == 0 and s["failed_peers"] == []
    for res in results[:SENDERS]:
        s = res["stats"]
        assert s["messages_out"] == RECEIVERS * PER_PAIR and s["in_flight_send"] == 0
        assert s["transfer_errors"] == 0 and s["failed_peers"] == []

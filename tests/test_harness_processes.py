"""A harness stops only what it started (amoe.testing.processes), shown on real processes of Ray's shape: daemons a
starter leaves behind (re-parented to init) under Ray's process names — those `ray stop` ends wherever they come
from — one ignoring SIGTERM as Ray's GCS server does on its way out, one that has started a worker. They end;
processes of the same names that another harness, or nobody, started run on."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import psutil
import pytest

from amoe.testing.processes import TaggedProcesses

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the fake Ray nodes are bash scripts")

NAMES = ["gcs_server", "raylet", "raylet", "sleep", "sleep"]  # as the fake node's processes end up named


def fake_ray_binaries(where) -> dict[str, str]:
    """`sleep` under Ray's daemon names: a process's name is the file it was started from."""
    sleep = shutil.which("sleep")
    paths = {}
    for name in ("raylet", "gcs_server"):
        paths[name] = str(where / name)
        os.symlink(sleep, paths[name])
    return paths


def start_fake_node(bins: dict[str, str], env: dict[str, str], marker) -> None:
    """What `ray start` leaves: its starter gone, its daemons re-parented. A raylet; a GCS server that ignores
    SIGTERM; a raylet that has started a worker (renamed, as Ray's are); a daemon that notes SIGTERM and exits."""
    script = f"""
        {bins["raylet"]} 600 &
        (trap '' TERM; exec {bins["gcs_server"]} 600) &
        ({bins["raylet"]} 600 & exec -a ray::IDLE sleep 600) &
        bash -c 'trap "echo TERM > {marker}; exit 0" TERM; sleep 600 & wait' &
    """
    subprocess.run(["bash", "-c", script], env=env, check=True, timeout=30)


def started(processes: TaggedProcesses) -> list[psutil.Process]:
    """The fake node's processes, once every one of them runs what it was started for (the test's timeout bounds
    the wait)."""
    while True:
        procs = processes.running()
        names = sorted(p.name() for p in procs)
        if names == sorted([*NAMES, "bash"]):
            return procs
        time.sleep(0.05)


def alive(proc: psutil.Process) -> bool:
    """Running, and not a zombie its new parent (init) has yet to reap."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(60)
def test_stopping_a_harness_ends_its_processes_and_no_one_elses(tmp_path):
    bins = fake_ray_binaries(tmp_path)
    mine, theirs = TaggedProcesses(), TaggedProcesses()
    start_fake_node(bins, mine.env(), tmp_path / "mine-termed")
    start_fake_node(bins, theirs.env(), tmp_path / "theirs-termed")
    untagged = subprocess.Popen([bins["raylet"], "600"])  # a Ray process nobody's harness started
    try:
        procs = started(mine)
        others = started(theirs)
        assert all(p.ppid() != os.getpid() for p in procs), "the daemons outlive their starter"
        gcs = next(p for p in procs if p.name() == "gcs_server")

        killed = mine.stop(grace_s=3.0)

        assert mine.running() == [] and not any(map(alive, procs))
        assert gcs.pid in {p.pid for p in killed}, "the one ignoring SIGTERM is killed after the grace period"
        assert (tmp_path / "mine-termed").read_text() == "TERM\n", "the others are asked first"
        assert all(map(alive, others)) and sorted(p.pid for p in theirs.running()) == sorted(
            p.pid for p in others
        )
        assert untagged.poll() is None
        assert not (tmp_path / "theirs-termed").exists()
    finally:
        theirs.stop(grace_s=0.1)
        mine.stop(grace_s=0.1)
        untagged.kill()
        untagged.wait(10)
    assert theirs.running() == []


@pytest.mark.timeout(60)
def test_stopping_a_harness_that_started_nothing_is_a_no_op():
    assert TaggedProcesses().stop() == []

"""The processes one test harness started, and only those.

Each process the harness starts carries the harness's tag in its environment, and every descendant inherits it:
daemons that outlive their starter and re-parent to init (as `ray start`'s do), workers they spawn, workers that
rename themselves (setproctitle; SPT_NOENV keeps it off the environment's memory, where the tag lives). Stopping
finds them by the tag, asks them to end, and kills those still there after a grace period. Nothing anyone else
started is touched — unlike `ray stop`, which ends every process of Ray's names on the host.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid

import psutil

logger = logging.getLogger(__name__)

TAG_VARIABLE = "AMOE_TEST_TAG"
_POLL_S = 0.05


class TaggedProcesses:
    """A fresh tag: `env()` for every process the harness starts, `stop()` ends whichever carry it."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (by default this process's environment) with the tag."""
        return {**(os.environ if base is None else base), TAG_VARIABLE: self.tag, "SPT_NOENV": "1"}

    def running(self) -> list[psutil.Process]:
        return tagged(self.tag)

    def stop(self, grace_s: float = 5.0, kill_wait_s: float = 10.0) -> list[psutil.Process]:
        """SIGTERM to each, SIGKILL to those still running after `grace_s`; returns those that had to be killed.
        Goes round again while tagged processes are found (one ending may have started another); raises if
        some outlive SIGKILL or keep appearing."""
        killed: list[psutil.Process] = []
        for _ in range(3):
            procs = self.running()
            if not procs:
                return killed
            _send(procs, signal.SIGTERM)
            left = _wait_gone(procs, grace_s)
            if left:
                logger.info("[harness] %d processes ignored SIGTERM for %.1f s: killed", len(left), grace_s)
            _send(left, signal.SIGKILL)
            killed += left
            if stuck := _wait_gone(left, kill_wait_s):
                raise RuntimeError(f"processes of tag {self.tag} outlived SIGKILL: {stuck}")
        if left := self.running():
            raise RuntimeError(f"processes of tag {self.tag} kept appearing: {left}")
        return killed


def tagged(tag: str) -> list[psutil.Process]:
    """The live processes whose environment carries `tag` (zombies have ended already)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG_VARIABLE) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):  # gone meanwhile, or a kernel thread without an environment
            continue
    return found


def _send(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)  # psutil checks the pid was not reused by another process meanwhile
        except psutil.NoSuchProcess:
            continue


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of `procs` still running after up to `timeout_s`. Polled: most are not our children (re-parented to
    init), so there is nothing to wait on, and a zombie its parent has not reaped yet counts as gone."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return left

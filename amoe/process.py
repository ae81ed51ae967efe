"""What every child process of amoe does first: take a name `ps` shows, and die with its parent, so nothing is
ever orphaned (runtime workers, the rendezvous store, a node agent's runtimes)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


def name_process(title: str) -> None:
    """So `ps` shows the role: the full title via setproctitle, else at least the 15-char comm name."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, title.encode()[:15], 0, 0, 0)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent dies (even by SIGKILL), so no child is ever orphaned."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)

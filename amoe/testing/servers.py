"""`amoe serve` as a child process, for tests, benchmarks and studies: started from a config (written to a file it
reads, `amoe serve --config FILE`, on port 0), its URL parsed from the log line, stopped with a signal (SIGINT: the
server drains and stops its runtimes), killed if it does not exit.

`with ServerProcess(config) as url:` serves for the block; `start()`, `wait_for_url()` and `stop()` do the same by
hand, for a test that signals or waits on the process itself."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from amoe.config import AmoeConfig, command_flags
from amoe.errors import AmoeError

logger = logging.getLogger(__name__)

_URL_LINE = re.compile(r"amoe serve: listening on (http://\S+)$")
_KEEP_LINES = 1000  # of the server's log: what a test reads back, and the error message when it dies
_WARNING = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b")


class ServerProcess:
    """One `amoe serve` of `config` on port 0; `env` adds environment variables, `new_session` puts it (and the
    runtimes it starts) in a process group of its own, which `kill` ends whole."""

    def __init__(
        self,
        config: AmoeConfig,
        startup_timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
        *,
        new_session: bool = False,
        cwd: str | None = None,
    ) -> None:
        self.config = config.replace(server={"port": 0})
        self.startup_timeout_s = startup_timeout_s
        self.env = env or {}  # extra environment variables
        self.new_session = new_session
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=_KEEP_LINES)
        # Every warning or error the server logged, numbered: a benchmark point records the ones logged while it
        # ran (warnings_since), so a point read from a deployment that lost or replaced a runtime says so.
        self.warnings: collections.deque[tuple[int, str]] = collections.deque(maxlen=_KEEP_LINES)
        self.num_warnings = 0
        self.url: str | None = None
        self._listening = threading.Event()
        self._config_dir: tempfile.TemporaryDirectory | None = None

    @property
    def lines(self) -> list[str]:
        """The server's log so far (its last lines)."""
        return list(self._lines)

    def start(self) -> ServerProcess:
        """Start the process (and the thread that reads its log); returns at once."""
        # What differs from the defaults: the server's own defaults (AMOE_DEVICE, say) stay its environment's.
        self._config_dir = tempfile.TemporaryDirectory(prefix="amoe-serve-")
        path = Path(self._config_dir.name) / "config.json"
        path.write_text(json.dumps(self.config.changes(), indent=1))
        cmd = [sys.executable, "-m", "amoe", "serve", "--config", str(path)]
        logger.info(
            "[server] starting amoe serve --config %s: %s", path, " ".join(command_flags(self.config))
        )
        env = {**os.environ, "AMOE_LOG_LEVEL": os.environ.get("AMOE_LOG_LEVEL", "INFO"), **self.env}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
            cwd=self.cwd, start_new_session=self.new_session,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def wait_for_url(self, timeout_s: float | None = None) -> str:
        """The URL once the server listens; AmoeError (with its last log lines) if it exits or takes longer than
        `timeout_s` (default: the startup timeout)."""
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        while not self._listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AmoeError("amoe serve did not start:\n" + "\n".join(self.lines[-20:]))
        return self.url

    def __enter__(self) -> str:
        self.start()
        try:
            return self.wait_for_url()
        except AmoeError:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self._lines.append(line)
            if _WARNING.search(line):
                self.warnings.append((self.num_warnings, line))
                self.num_warnings += 1
            if not self._listening.is_set() and (match := _URL_LINE.search(line)):
                self.url = match.group(1)
                self._listening.set()

    def warnings_since(self, mark: int) -> list[str]:
        """The warning and error lines logged since `num_warnings` was `mark` (those still kept)."""
        return [line for n, line in list(self.warnings) if n >= mark]

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int | None:
        """Send `sig` (the server drains), wait up to `timeout_s`, kill it if it is still there; its exit code."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("[server] amoe serve (pid %d) did not stop; killing it", self.proc.pid)
                    self.kill()
        finally:
            if self._config_dir is not None:
                self._config_dir.cleanup()
                self._config_dir = None
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL now: the process, or with `new_session` its whole group (the runtimes it started too)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.new_session:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.kill()
        self.proc.wait(10)

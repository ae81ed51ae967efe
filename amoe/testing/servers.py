"""An `amoe serve` subprocess for benchmarks, studies and tests: started from a config (written to a file it reads,
`amoe serve --config FILE`, on port 0), its URL parsed from the log line, stopped with SIGINT (the server drains
and stops its runtimes), killed if it does not exit."""

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
_KEEP_LINES = 200  # of the server's log, for the error message when it dies
_WARNING = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b")


class ServerProcess:
    """`with ServerProcess(config) as url:` — one `amoe serve` of `config` for the duration of the block."""

    def __init__(
        self, config: AmoeConfig, startup_timeout_s: float = 180.0, env: dict[str, str] | None = None
    ) -> None:
        self.config = config.replace(server={"port": 0})
        self.startup_timeout_s = startup_timeout_s
        self.env = env or {}  # extra environment variables
        self.proc: subprocess.Popen | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=_KEEP_LINES)
        # Every warning or error the server logged, numbered: a benchmark point records the ones logged while it
        # ran (warnings_since), so a point read from a deployment that lost or replaced a runtime says so.
        self.warnings: collections.deque[tuple[int, str]] = collections.deque(maxlen=_KEEP_LINES)
        self.num_warnings = 0
        self.url: str | None = None
        self._config_dir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> str:
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
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        found = threading.Event()
        threading.Thread(target=self._read, args=(found,), daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not found.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise AmoeError("amoe serve did not start:\n" + "\n".join(list(self.lines)[-20:]))
        return self.url

    def _read(self, found: threading.Event) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            if _WARNING.search(line):
                self.warnings.append((self.num_warnings, line))
                self.num_warnings += 1
            if not found.is_set() and (match := _URL_LINE.search(line)):
                self.url = match.group(1)
                found.set()

    def warnings_since(self, mark: int) -> list[str]:
        """The warning and error lines logged since `num_warnings` was `mark` (those still kept)."""
        return [line for n, line in list(self.warnings) if n >= mark]

    def __exit__(self, *exc: object) -> None:
        try:
            self._stop()
        finally:
            if self._config_dir is not None:
                self._config_dir.cleanup()
                self._config_dir = None

    def _stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            logger.warning("[server] amoe serve (pid %d) did not stop; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.wait(10)

"""Several "hosts" on one machine for multi-node tests: network namespaces with their own addresses, joined by a
bridge that lives in a namespace of its own (the test's own namespace gets a leg on it too, to reach the API).

Needs root and iproute2; `Hosts.available()` says whether this machine can. Everything is removed on close, also
after a failed test; names carry a random tag so parallel or leftover runs never collide. `MultiHost` runs one
`amoe serve` cluster over such hosts (tests/test_multinode.py, bench/multinode.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import psutil

from amoe.testing.processes import TaggedProcesses, tagged

SUBNET = "10.77"


def write_secret(path, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return str(path)


class Node:
    """`amoe serve` on one namespaced host; everything it starts carries a tag we can find it by."""

    def __init__(self, hosts: Hosts, host: int, argv: list[str]) -> None:
        self.tag = uuid.uuid4().hex
        env = {**os.environ, "AMOE_LOG_LEVEL": "INFO", "AMOE_TEST_TAG": self.tag, "SPT_NOENV": "1"}
        cmd = hosts.command(host, [sys.executable, "-m", "amoe", "serve", *argv])
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        self.lines: list[str] = []
        self._eof = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
        self._eof.set()

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        """The first log line matching `pattern` (it may be the last thing the process said)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = self._eof.is_set()
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            assert not ended, f"exited ({self.proc.wait()}) before saying {pattern!r}:\n" + self.log()
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n" + self.log())

    def log(self) -> str:
        return "\n".join(self.lines[-60:])

    def tagged(self) -> list[psutil.Process]:
        return tagged(self.tag)

    def kill_all(self) -> None:
        for proc in self.tagged():
            proc.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class MultiHost:
    """`amoe serve` over `hosts`: node 0 (the coordinator and the first runtimes) and one agent per other host;
    runtimes fill the hosts in placement order, `per_node` each."""

    def __init__(
        self, hosts: Hosts, model_dir, secret: str, extra: list[str] = (), *, attn: int = 1, experts: int = 2,
        per_node: int = 1,
    ) -> None:  # fmt: skip
        self.hosts, self.model_dir, self.secret = hosts, model_dir, secret
        self.port = _free_port()
        self.init_addr = f"{hosts.addrs[0]}:{self.port}"
        common = [
            "--model", str(model_dir), "--nnodes", str(len(hosts.names)), "--dist-init-addr", self.init_addr,
            "--attn-ranks", str(attn), "--expert-ranks", str(experts), "--runtimes-per-node", str(per_node),
            "--cluster-secret-file", secret, "--dist-timeout-s", "60", *extra,
        ]  # fmt: skip
        self.common = common
        self.head = Node(hosts, 0, [*common, "--node-rank", "0", "--host", hosts.addrs[0], "--port", "0"])
        self.agents = {r: self.start_agent(r) for r in range(1, len(hosts.names))}
        self.url = self.head.wait_for(r"amoe serve: listening on (http://\S+)$").group(1)

    def start_agent(self, rank: int, *flags: str) -> Node:
        """Node `rank`'s agent; later flags override the cluster's (e.g. another --cluster-secret-file)."""
        return Node(self.hosts, rank, [*self.common, "--node-rank", str(rank), "--headless", *flags])

    def stop(self) -> int | None:
        code = None
        if self.head.proc.poll() is None:
            self.head.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.head.proc.wait(30)
        for node in [self.head, *self.agents.values()]:
            node.kill_all()
        return code if code is not None else self.head.proc.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """`count` namespaces, host i at 10.77.<k>.(i+1)/24; this namespace at .254 on the same bridge."""

    def __init__(self, count: int) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.net = f"{SUBNET}.{int(self.tag[:2], 16) % 250 + 1}"  # a /24 per run
        self.switch = f"amoe-sw-{self.tag}"
        self.names = [f"amoe-h{i}-{self.tag}" for i in range(count)]
        self.addrs = [f"{self.net}.{i + 1}" for i in range(count)]
        self.local_addr = f"{self.net}.254"
        self._root_link = f"amoe-r{self.tag}"
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and shutil.which("ip") is not None

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, addr) in enumerate(zip(self.names, self.addrs)):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            leg = f"p{i}"
            _ip("-n", self.switch, "link", "add", leg, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", self.switch, "link", "set", leg, "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
        _ip("link", "add", self._root_link, "type", "veth", "peer", "name", "root", "netns", self.switch)
        _ip("-n", self.switch, "link", "set", "root", "master", "br0", "up")
        _ip("addr", "add", f"{self.local_addr}/24", "dev", self._root_link)
        _ip("link", "set", self._root_link, "up")

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv run inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self._root_link)
        for name in [*self.names, self.switch]:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", name)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RayNodes:
    """A Ray cluster over the first `count` of `hosts`: the head on host 0, a worker node on each other one
    (`ray start`, as a user would), `cpus` each. Every process of it — the nodes' daemons, the workers and actors
    they start, what those start — carries this cluster's tag, and close stops those alone (`ray stop` would end
    every Ray process on the machine). Needs the optional `ray` package."""

    def __init__(self, hosts: Hosts, count: int = 2, cpus: int = 2) -> None:
        self.hosts = hosts
        self.processes = TaggedProcesses()
        self.port = _free_port()
        self.address = f"{hosts.addrs[0]}:{self.port}"
        self.env = self.processes.env({**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        common = ["--num-cpus", str(cpus), "--disable-usage-stats", "--object-store-memory", str(200 * 2**20)]
        # Each "host" its own temp dir: the namespaces share one filesystem, where Ray keeps its sockets.
        self.temp_dirs = [f"/tmp/amoe-ray-{hosts.tag}-{host}" for host in range(count)]
        try:
            self._run(0, [ray, "start", "--head", "--port", str(self.port), "--node-ip-address", hosts.addrs[0],
                          "--include-dashboard", "false", "--temp-dir", self.temp_dirs[0], *common])  # fmt: skip
            for host in range(1, count):
                self._run(host, [ray, "start", "--address", self.address, "--node-ip-address",
                                 hosts.addrs[host], "--temp-dir", self.temp_dirs[host], *common])  # fmt: skip
        except BaseException:
            self.close()
            raise

    def _run(self, host: int, argv: list[str]) -> None:
        out = subprocess.run(
            self.hosts.command(host, argv), capture_output=True, text=True, env=self.env, timeout=180
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:3])} failed on host {host}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
            )

    def close(self) -> None:
        """Stop this cluster's processes (SIGTERM, SIGKILL after a grace period: its GCS server hangs flushing
        its events on SIGTERM) and remove its temp dirs; idempotent."""
        try:
            self.processes.stop()
        finally:
            for path in getattr(self, "temp_dirs", []):
                shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> RayNodes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP (ip, port) a process listens on, read in its own network namespace: psutil reads the caller's
    /proc/net tables, where another namespace's sockets do not appear."""
    try:
        inodes = {
            os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
            for fd in os.listdir(f"/proc/{pid}/fd")
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
        }
    except OSError:
        return set()
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.add(_address(fields[1]))
    return found


def _address(hex_addr: str) -> tuple[str, int]:
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four little-endian 32-bit words
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)

"""A node agent holding another cluster secret than node 0 is refused at the rendezvous, in one line that names its
secret file, instead of waiting out --dist-timeout-s for a CURVE handshake that cannot succeed. On loopback: no
network namespaces needed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from amoe.curve import fingerprint
from amoe.model.make import make_model
from amoe.testing.netns import write_secret


def test_the_fingerprint_tells_secrets_apart_and_hides_them():
    salt = b"\x01" * 16
    one, other = b"a" * 64, b"b" * 64
    assert fingerprint(one, salt) == fingerprint(one, salt)
    assert fingerprint(one, salt) != fingerprint(other, salt)
    assert fingerprint(one, salt) != fingerprint(one, b"\x02" * 16)  # per cluster: the salt is random
    assert "a" * 8 not in fingerprint(one, salt)


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _store_up(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


@pytest.mark.timeout(200)
def test_an_agent_with_another_secret_is_refused_naming_its_secret_file(tmp_path):
    model = make_model("tiny", tmp_path / "tiny-secret", seed=0)
    addr = _free_addr()
    mine = write_secret(tmp_path / "secret", "m" * 64)
    other = write_secret(tmp_path / "other-secret", "o" * 64)
    common = ["--model", str(model), "--nnodes", "2", "--dist-init-addr", addr, "--attn-ranks", "1",
              "--expert-ranks", "1", "--dist-timeout-s", "120"]  # fmt: skip
    head = subprocess.Popen(
        [sys.executable, "-m", "amoe", "serve", *common, "--cluster-secret-file", mine, "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _store_up(addr):
            assert head.poll() is None and time.monotonic() < deadline, "node 0's store never came up"
            time.sleep(0.2)
        # Well inside --dist-timeout-s: the agent must not wait it out.
        agent = subprocess.run(
            [
                sys.executable,
                "-m",
                "amoe",
                "serve",
                *common,
                "--cluster-secret-file",
                other,
                "--node-rank",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        head.kill()
        head.wait()
    assert agent.returncode != 0 and "Traceback" not in agent.stderr, agent.stderr[-2000:]
    last = agent.stderr.strip().splitlines()[-1]
    assert last.startswith("amoe: error: the cluster secret in ") and other in last, last

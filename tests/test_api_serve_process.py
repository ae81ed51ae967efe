"""`amoe serve` as a real process: start-up line with the real port, draining exit 0 on signals."""

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from factories import config_of

from amoe.model.make import make_model
from amoe.testing.servers import ServerProcess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("ckpt") / "tiny-proc", seed=0)


def start_server(model_dir, *flags: str, new_session: bool = False) -> ServerProcess:
    env = {"AMOE_LOG_LEVEL": "INFO"}  # the tests read its INFO lines
    config = config_of("--model", str(model_dir), *flags)
    return ServerProcess(config, startup_timeout_s=60, env=env, new_session=new_session).start()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_when_idle_exits_0(model_dir, sig):
    server = start_server(model_dir)
    try:
        url = server.wait_for_url()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and not url.endswith(":0")
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        server.proc.send_signal(sig)
        assert server.proc.wait(45) == 0  # a loaded host may take a while to stop
    finally:
        server.kill()
    assert not [line for line in server.lines if "Traceback" in line]


def _signal_mid_stream(url: str, max_tokens: int, send) -> list[str]:
    """Start a streamed completion, call send() after its first event, and return the events that follow."""
    body = {
        "model": "tiny-proc",
        "prompt": "go",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(lines)
        send()
        return [line for line in lines if line]


@pytest.mark.timeout(120)
def test_sigterm_drains_an_in_flight_stream_and_exits_0(model_dir):
    server = start_server(model_dir, "--server-drain-timeout-s", "1")
    try:
        url = server.wait_for_url()
        rest = _signal_mid_stream(url, 2000, lambda: server.proc.send_signal(signal.SIGTERM))
        assert server.proc.wait(45) == 0  # a loaded host may take a while to stop
        # It kept streaming during the drain, then was aborted at the deadline and still ended cleanly.
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"abort"' in rest[-2]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        server.kill()
    assert any("SIGTERM: draining" in line for line in server.lines)
    assert any("aborting 1 in-flight requests" in line for line in server.lines)


@pytest.mark.timeout(120)
def test_sigterm_to_the_whole_process_group_drains_without_healing(model_dir):
    """systemd and `timeout` signal every process of the group: the runtimes keep serving the drain, none is
    taken for crashed and replaced, and the server exits 0 without killing stragglers."""
    server = start_server(model_dir, "--server-drain-timeout-s", "5", new_session=True)
    try:
        url = server.wait_for_url()
        rest = _signal_mid_stream(url, 40, lambda: os.killpg(server.proc.pid, signal.SIGTERM))
        assert server.proc.wait(45) == 0  # a loaded host may take a while to stop
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2]
    finally:
        server.kill()
    log = "\n".join(server.lines)
    assert "replacing it" not in log and "did not stop" not in log, log


@pytest.mark.timeout(120)
def test_a_port_in_use_is_one_line_before_any_runtime_starts(model_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cmd = [sys.executable, "-m", "amoe", "serve", "--model", str(model_dir), "--port", port]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"amoe: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "Traceback" not in result.stderr and "runtime" not in result.stderr

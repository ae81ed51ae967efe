"""`amoe serve` over runtime processes, through the real server and the official openai client: greedy outputs equal
the single-process reference; a client that disconnects frees its KV; a runtime killed with requests in flight
fails them promptly, /health says so, and shutdown leaves no process behind; `ps` shows each runtime's role."""

import asyncio
import os
import shutil
import signal
import subprocess
import time
import uuid

import httpx
import openai
import psutil
import pytest
from factories import config_of
from safetensors.torch import load_file, save_file

from amoe.llm import LLM
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.testing.servers import ServerProcess

MODEL = "tiny-cluster"
# Mixed lengths: one-token, short, one KV block exactly, several blocks.
PROMPTS = [[1], [1, 5, 9, 200], [1] + list(range(30, 45)), [1] + list(range(100, 140)), [1, 77, 3]]
MAX_TOKENS = [12, 6, 8, 5, 10]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("cluster") / MODEL, seed=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=str(model_dir))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params)]


class TaggedServer(ServerProcess):
    """`amoe serve` of `model_dir` as a child process, started; its runtimes inherit a unique environment tag we can
    find them by."""

    def __init__(self, model_dir, *flags: str) -> None:
        self.tag = uuid.uuid4().hex
        # SPT_NOENV: setproctitle must not reuse the environment's memory, where the tag lives.
        env = {"AMOE_LOG_LEVEL": "INFO", "AMOE_TEST_TAG": self.tag, "SPT_NOENV": "1"}
        super().__init__(config_of("--model", str(model_dir), *flags), startup_timeout_s=90, env=env)
        self.start()

    def tagged(self) -> list[psutil.Process]:
        """Every live process started by this server (including itself)."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("AMOE_TEST_TAG") == self.tag and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int | None:
        code = super().stop(sig, timeout_s)
        for proc in self.tagged():  # never leave anything behind, even when a test failed
            proc.kill()
        return code


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=5)


async def _complete_all(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> str:
        await asyncio.sleep(0.15 * i)  # later ones arrive while earlier ones decode
        reply = await client.completions.create(
            model=MODEL,
            prompt=PROMPTS[i],
            max_tokens=MAX_TOKENS[i],
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == MAX_TOKENS[i]
        return reply.choices[0].text

    async def streamed(i: int) -> str:  # the longest one streams from the start
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    try:
        return await asyncio.gather(streamed(0), *(one(i) for i in range(1, len(PROMPTS))))
    finally:
        await client.close()


# A covering subset of attention ranks {1, 2} × expert ranks {1..4}: every policy, both CPU transports.
LAYOUTS = [
    (1, 1, "defrag", "inline"),
    (2, 3, "mtfs", "gloo"),
    (1, 4, "flfs", "inline"),
    (2, 2, "defrag", "gloo"),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("attn,experts,policy,plane", LAYOUTS, ids=lambda v: str(v))
def test_greedy_outputs_equal_the_reference(model_dir, reference, attn, experts, policy, plane):
    flags = [
        "--attn-ranks",
        str(attn),
        "--expert-ranks",
        str(experts),
        "--scheduler",
        policy,
        "--transport",
        plane,
    ]
    server = TaggedServer(model_dir, *flags)
    try:
        url = server.wait_for_url()
        assert asyncio.run(_complete_all(url)) == reference
        report = health(url).json()
        assert report["status"] == "ok" and len(report["runtimes"]) == attn + experts
        assert len(report["kv"]) == attn
    finally:
        assert server.stop() == 0, "\n".join(server.lines)
    assert not server.tagged()


@pytest.fixture(scope="module")
def server(model_dir):
    server = TaggedServer(model_dir, "--attn-ranks", "1", "--expert-ranks", "2")
    server.wait_for_url()
    yield server
    assert server.stop() == 0, "\n".join(server.lines)
    assert not server.tagged()


@pytest.mark.timeout(60)
def test_ps_shows_each_runtime_role(server):
    children = psutil.Process(server.proc.pid).children()
    titles = sorted(" ".join(child.cmdline()).strip() for child in children)
    assert titles == ["amoe: attention runtime 0", "amoe: expert runtime 1", "amoe: expert runtime 2"]
    comms = subprocess.run(
        ["ps", "-o", "comm=", "--ppid", str(server.proc.pid)], capture_output=True, text=True
    )
    assert sorted(comms.stdout.split("\n")[:3]) == ["amoe: attention", "amoe: expert ru", "amoe: expert ru"]


@pytest.mark.timeout(60)
def test_a_client_that_disconnects_frees_its_kv_blocks(server):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        (kv,) = health(server.url).json()["kv"]
        assert kv["free_blocks"] < kv["total_blocks"]  # it holds blocks while it decodes
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        report = health(server.url).json()
        (kv,) = report["kv"]
        if kv["free_blocks"] == kv["total_blocks"] and report["running"] == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"KV not freed: {report}")


# Slow: "promptly" is wall time after the kill (a wide margin).
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_restarts_a_killed_runtime_fails_requests_and_the_server_exits_non_zero(model_dir):
    """Fail-stop (--server-max-restarts 0): in-flight requests fail promptly, the server drains and exits 1 (so an
    orchestrator restarts it), and no process is left behind."""
    server = TaggedServer(model_dir, "--attn-ranks", "1", "--expert-ranks", "2", "--server-max-restarts", "0")
    try:
        url = server.wait_for_url()
        runtimes = {r["runtime"]: r["pid"] for r in health(url).json()["runtimes"]}
        pids = [p.pid for p in server.tagged()]
        outcomes: list[tuple[str, float]] = []

        async def in_flight(i: int, started: asyncio.Event) -> None:
            body = {
                "model": MODEL,
                "prompt": [1, i + 2],
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            async with (
                httpx.AsyncClient(timeout=30) as client,
                client.stream("POST", f"{url}/v1/completions", json=body) as response,
            ):
                failed = False
                async for line in response.aiter_lines():
                    started.set()
                    failed = failed or '"error"' in line
                outcomes.append(("error" if failed else "ended", time.monotonic()))

        async def scenario() -> float:
            events = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.ensure_future(in_flight(i, e)) for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
            os.kill(runtimes[2], signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return killed

        killed = asyncio.run(scenario())
        assert [kind for kind, _ in outcomes] == ["error"] * 3
        assert all(t - killed < 30 for _, t in outcomes)
        assert server.proc.wait(30) == 1
        log = "\n".join(server.lines)
        assert "the cluster cannot recover" in log and "expert runtime 2" in log and "SIGKILL" in log
    finally:
        server.stop()
    assert not server.tagged()
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


@pytest.mark.timeout(60)
def test_a_runtime_that_cannot_load_is_one_line_and_leaves_nothing(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors.pop("model.layers.1.block_sparse_moe.experts.3.w1.weight")
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    server = TaggedServer(broken, "--attn-ranks", "1", "--expert-ranks", "2")
    try:
        assert server.proc.wait(60) == 1
    finally:
        server.stop()
    time.sleep(0.2)  # the reader thread drains stderr
    errors = [line for line in server.lines if line.startswith("amoe: error:")]
    assert len(errors) == 1 and "expert runtime 2" in errors[0] and "experts.3.w1" in errors[0], server.lines
    assert not [line for line in server.lines if "Traceback" in line]
    assert not server.tagged()


@pytest.mark.timeout(60)
def test_seeded_sampling_equals_the_reference(server, model_dir):
    # Each request draws from its own generator seeded from `seed`, in the runtime as in the reference engine,
    # so asynchrony and batch composition must not change sampled tokens either.
    prompts = [[1, 5, 9, 200], [1] + list(range(30, 45))]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
    want = [out.outputs[0].text for out in LLM(model=str(model_dir)).generate(prompts, params)]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    got = [
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, top_p=0.95, seed=1234,
            extra_body={"top_k": 50, "ignore_eos": True},
        ).choices[0].text
        for prompt in prompts
    ]  # fmt: skip
    assert got == want

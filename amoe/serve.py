"""`amoe serve`: config → backend → coordinator API → uvicorn, with a draining shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from amoe import envs
from amoe.config import AmoeConfig, ServerSection
from amoe.errors import AmoeError, ConfigError
from amoe.perf.model.check import check_emulation
from coordinator.api.app import abort_all, create_app
from coordinator.api.tools import ToolServing
from coordinator.api.validation import ModelInfo
from coordinator.requests.backend import Backend

logger = logging.getLogger(__name__)

_BACKSTOP_S = (
    5.0  # after the drain timeout, how long aborted responses get to finish before uvicorn cuts them
)


def main(config: AmoeConfig, headless: bool = False) -> int:
    """Serve until SIGINT/SIGTERM, then drain and return 0; 1 if the cluster could not recover from a loss (an
    orchestrator restarts the server then, as it would vLLM's). On nodes 1..N-1 of a multi-node cluster (vLLM's
    `--headless`): the node agent, which starts this node's runtimes and nothing else (docs/multinode.md)."""
    dist = config.dist
    if headless and dist.node_rank == 0:
        raise ConfigError("--headless runs a node agent: give it --node-rank R with 1 <= R < --nnodes")
    config = resolve_device(config)  # --device cuda on a host without CUDA fails here, before anything starts
    check_emulation(config.emulation, config.executor.kind == "emulated")  # an unknown --gpu / --routing too
    _check_ep_pipeline(config)  # a PN above the experts a device hosts too
    if dist.node_rank > 0:
        from amoe.node_agent import main as agent_main

        return agent_main(config, _model_dir(config))
    server = AmoeServer(config)
    asyncio.run(server.run())
    return server.exit_code


def _check_ep_pipeline(config: AmoeConfig) -> None:
    """`--ep-pipelines N` against the model's experts per device, from its config.json (or emulated profile)."""
    par = config.parallel
    if par.mode != "ep" or par.pipelines is None:
        return
    from amoe.runtime import build

    model_dir = (
        None
        if config.emulation.profile is not None and config.executor.kind == "emulated"
        else _model_dir(config)
    )
    em = build.emulation(config, model_dir)
    cfg = build.runtime_model_config(em, model_dir)
    build.ep_pipeline(config, build.placement(config, cfg.num_expert_ids), cfg, em)


class AmoeServer:
    """One coordinator process: owns the backend, the listening socket and the uvicorn server."""

    def __init__(self, config: AmoeConfig) -> None:
        self.config = config
        self.backend: Backend | None = None
        self.url: str | None = None
        self.started = threading.Event()  # set once the URL is live (tests wait on it)
        self.exit_code = 0
        self._uvicorn: _UvicornServer | None = None

    async def run(self) -> None:
        self._api_key = api_key(self.config.server)  # a missing key file fails here, before anything starts
        model_dir = _model_dir(self.config)
        # Bind first: a port in use fails in a moment, before any model load or runtime process.
        sock = _bind(self.config.server.host, self.config.server.port)
        try:
            await self._run_bound(model_dir, sock)
        finally:
            sock.close()

    async def _run_bound(self, model_dir: Path, sock: socket.socket) -> None:
        try:
            tokenizer, backend, model = await self._start_backend(model_dir)
        except BaseException:
            if self.backend is not None:  # a half-started cluster: no runtime may outlive us
                await self.backend.shutdown()
            raise
        try:
            app = create_app(
                backend,
                tokenizer,
                model,
                _detokenizer_factory(tokenizer),
                server=self.config.server,
                api_key=self._api_key,
            )
            await self._serve(app, sock)
        finally:
            logger.info("stopping the backend")
            await backend.shutdown()
            logger.info("stopped")

    def _cluster_died(self, reason: str) -> None:
        """The cluster lost a runtime it could not replace: drain what is left, then exit non-zero."""
        logger.error("the cluster cannot recover (%s); draining and exiting", reason)
        self.exit_code = 1
        self.request_exit()

    def request_exit(self) -> None:
        """Begin the draining shutdown, from any thread (what SIGTERM does)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    async def _start_backend(self, model_dir: Path):
        from amoe.generation_config import sampling_defaults
        from amoe.structured import Grammars
        from amoe.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(model_dir)
        # a bad generation config fails here, before a load
        defaults = sampling_defaults(model_dir, self.config.model.generation_config)
        if self.config.offload.budget is not None:
            from amoe.offload.wiring import check_offload

            check_offload(self.config, model_dir)  # a budget too small, a bad EAMC: one line, nothing started
        if self.config.parallel.mode == "local":
            backend, max_model_len, vocab = await self._start_local(model_dir)
        else:
            backend, max_model_len, vocab = await self._start_cluster(model_dir)
        name = self.config.server.served_model_name or _default_name(self.config, model_dir)
        eos = tokenizer.backend.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
        # Checks structured output requests against the served tokenizer (the runtimes use the model's eos ids).
        grammars = Grammars(tokenizer.backend.to_str(), vocab, (eos,) if eos is not None else (0,))
        model = ModelInfo(
            name=name,
            max_model_len=max_model_len,
            vocab_size=vocab,
            grammars=grammars,
            sampling_defaults=defaults,
            tools=ToolServing(
                self.config.server.tool_call_parser, self.config.server.enable_auto_tool_choice
            ),
            eos_token_ids=_eos_token_ids(model_dir, eos),
        )
        logger.info("serving %r, max_model_len %d", name, model.max_model_len)
        return tokenizer, backend, model

    async def _start_local(self, model_dir: Path):
        from amoe.backends.local import LocalBackend
        from amoe.engine.config import EngineConfig
        from amoe.engine.local import LocalEngine

        logger.info("loading the model from %s (local backend: one engine thread)", model_dir)
        engine_config = EngineConfig.from_amoe_config(self.config)
        backend = LocalBackend(lambda: LocalEngine(model_dir, engine_config), engine_config.block_size)
        self.backend = backend
        await backend.start()
        return backend, backend.engine.max_model_len, backend.engine.model_config.vocab_size

    async def _start_cluster(self, model_dir: Path):
        from coordinator.requests.cluster_backend import ClusterBackend

        par, ex, em = self.config.parallel, self.config.executor, self.config.emulation
        if par.mode == "ep":
            layout = f"{par.attn_ranks} ep runtimes (attention + experts each)"
        else:
            layout = f"{par.attn_ranks} attention + {par.expert_ranks} expert runtimes"
        executor = (
            ex.kind if ex.kind == "torch" else f"emulated {em.gpu} ×{em.time_scale:g} time, {em.routing}"
        )
        logger.info(
            "serving %s with %s (%s, %s executor on %s, %s transport, %s scheduler)",
            em.profile if ex.kind == "emulated" and em.profile else model_dir, layout, par.mode, executor, self.config.device.kind, self.config.tensor_plane,
            self.config.scheduler.policy,
        )  # fmt: skip
        backend = ClusterBackend(self.config, model_dir, on_dead=self._cluster_died)
        self.backend = backend
        await backend.start()
        return backend, backend.max_model_len, backend.vocab_size

    async def _serve(self, app, sock: socket.socket) -> None:
        server_config = self.config.server
        host, port = sock.getsockname()[:2]
        url = f"http://{_url_host(host)}:{port}"
        uv_config = uvicorn.Config(
            app,
            log_config=None,  # keep amoe's logging set-up
            access_log=False,
            # A backstop only: our own drain timer aborts requests first, so their responses end cleanly.
            timeout_graceful_shutdown=server_config.drain_timeout_s + _BACKSTOP_S,
        )
        self._uvicorn = _UvicornServer(
            uv_config,
            on_started=lambda: self._announce(url),
            drain_timeout_s=server_config.drain_timeout_s,
            on_drain_timeout=lambda: abort_all(app),
        )
        await self._uvicorn.serve(sockets=[sock])

    def _announce(self, url: str) -> None:
        self.url = url
        self.started.set()
        logger.info("amoe serve: listening on %s", url)


class _UvicornServer(uvicorn.Server):
    """uvicorn, with a start-up hook and signal handling that ends in a clean exit 0."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_started: Callable[[], None],
        drain_timeout_s: float,
        on_drain_timeout: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._drain_timeout_s = drain_timeout_s
        self._on_drain_timeout = on_drain_timeout

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown (stop accepting, wait for responses), with in-flight requests aborted at the deadline."""
        timer = asyncio.get_running_loop().call_later(self._drain_timeout_s, self._drain_timed_out)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _drain_timed_out(self) -> None:
        logger.warning("drain timeout (%.1f s) reached", self._drain_timeout_s)
        self._on_drain_timeout()

    def handle_exit(self, sig: int, frame) -> None:
        # Not recorded for re-raising (as uvicorn does): after the drain it would re-raise SIGTERM and turn a
        # clean exit 0 into death by signal.
        if self.should_exit and sig == signal.SIGINT:
            logger.warning("second interrupt: aborting in-flight requests now")
            self.force_exit = True
        else:
            name = signal.Signals(sig).name
            logger.info("%s: draining (up to %.1f s for in-flight requests)", name, self._drain_timeout_s)
            self.should_exit = True


def resolve_device(config: AmoeConfig) -> AmoeConfig:
    """`config` with its device decided for this node (amoe.device_check; a Ray cluster's runtimes decide on their
    own hosts, which Ray gives GPUs)."""
    if config.dist.backend == "ray":
        return config
    from amoe.device_check import resolve
    from amoe.placement import runtimes_on_node

    here = 1 if config.parallel.mode == "local" else runtimes_on_node(config, config.dist.node_rank)
    return resolve(config, here)


def api_key(server: ServerSection) -> str | None:
    """The API key: --api-key, else the first line of --api-key-file, else $AMOE_API_KEY (the last two keep it
    out of `ps`); None when none is set."""
    if server.api_key:
        return server.api_key
    if server.api_key_file:
        try:
            key = Path(server.api_key_file).read_text().strip().splitlines()
        except OSError as exc:
            raise ConfigError(
                f"cannot read server.api_key_file {server.api_key_file}: {exc.strerror}"
            ) from None
        if not key or not key[0].strip():
            raise ConfigError(f"server.api_key_file {server.api_key_file} is empty")
        return key[0].strip()
    return envs.AMOE_API_KEY


def _model_dir(config: AmoeConfig) -> Path:
    """The checkpoint; without --model the shipped default model's directory, which also supplies the tokenizer
    when an emulated profile names the model (no checkpoint read: token-id prompts are exact, text uses the
    default tokenizer's ids, which are valid in any larger vocabulary)."""
    if config.model.path is not None:
        return Path(config.model.path)
    if config.parallel.mode == "local" and config.executor.kind == "emulated":
        raise ConfigError("--executor emulated needs runtimes: use --parallel aep, ep or pingpong")
    from amoe.model.make import default_model_path

    return default_model_path()


def _default_name(config: AmoeConfig, model_dir: Path) -> str:
    if config.model.path is None and config.executor.kind == "emulated" and config.emulation.profile:
        return config.emulation.profile
    return model_dir.name


def _eos_token_ids(model_dir: Path, tokenizer_eos: int | None) -> frozenset[int]:
    """What ends a request when sampled: the tokenizer's eos and config.json's eos_token_id (one id or a list)."""
    ids = set() if tokenizer_eos is None else {tokenizer_eos}
    try:
        eos = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # no readable config (an emulated profile): the tokenizer's
        eos = None
    ids |= {
        e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and not isinstance(e, bool)
    }
    return frozenset(ids)


def _detokenizer_factory(tokenizer):
    from amoe.tokenizer import IncrementalDetokenizer

    return lambda prompt_ids, skip_special_tokens=True: IncrementalDetokenizer(
        tokenizer, prompt_ids, skip_special_tokens
    )


def _bind(host: str, port: int) -> socket.socket:
    """Bind here rather than in uvicorn, so port 0 resolves to the real port before the URL is logged."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP, and without
    # it every streamed token on a kept-alive connection waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise AmoeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

"""The synchronous modes in one process: every device a Python thread running its loop, wired by the loopback
communicator (like amoe.testing.inproc.InProcessCluster for AEP). For tests, the benchmark harness and `amoe
generate --parallel ep` (amoe.testing.sync_inproc re-exports it for the tests)."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from pathlib import Path

import torch

from amoe import core
from amoe import device as devices
from amoe.config import EplbSection
from amoe.errors import ConfigError, EngineDeadError
from amoe.model.config import ModelConfig, load_model_config
from amoe.model.layers import build_attention_rank, build_expert_layer_set, build_expert_layers
from amoe.placement import Placement
from amoe.runtime.executors import AttentionExecutor, ExpertExecutor, TorchAttention
from amoe.runtime.requests import RankRequest, RankRequests
from amoe.runtime.sync.device import SyncDevice
from amoe.runtime.sync.loops import run_sync_loop
from amoe.runtime.sync.rebalance import stop_the_world
from amoe.sampling_params import SamplingParams
from amoe.structured import Grammars

logger = logging.getLogger(__name__)

MODES = ("ep", "pingpong")


class SyncCluster:
    """`ep` over `num_devices`, or `pingpong` over `num_attn` + `num_expert` devices, with torch executors on a
    checkpoint (`model_dir`) or emulated ones (`emulation`, an amoe.runtime.emulated.Emulation); `pipeline`: ep's
    expert pipeline; `eplb` (a config.EplbSection with redundant experts or rebalancing): the stop-the-world
    rebalance (amoe.runtime.sync.rebalance)."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        mode: str = "ep",
        num_devices: int = 2,
        num_attn: int = 1,
        num_expert: int = 2,
        micro_batches: int = 2,
        emulation=None,
        num_kv_blocks: int = 256,
        block_size: int = 16,
        max_batch_rows: int | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 10.0,
        poll_s: float = 0.005,
        pipeline=None,
        eplb: EplbSection | None = None,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"parallel mode must be one of {MODES} here; got {mode!r}")
        if (model_dir is None) == (emulation is None):
            raise ConfigError("give a checkpoint directory (torch executors) or an emulation, not both")
        self.mode, self.emulation = mode, emulation
        cfg = emulation.model_config if emulation is not None else load_model_config(model_dir)
        # None: auto, as every engine picks it (float32 on the CPU, whatever the checkpoint stores).
        self.model_dir, self.dtype = model_dir, dtype or devices.model_dtype("auto", cfg.dtype, devices.CPU)
        self.model_config: ModelConfig = cfg
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.options = {"timeout_s": timeout_s, "poll_s": poll_s}
        if pipeline is not None:  # ep's expert pipeline (amoe.runtime.sync.eps.ExpertPipeline)
            self.options["pipeline"] = pipeline
        if mode == "pingpong":
            self.options["micro_batches"] = micro_batches
            place = Placement.disaggregated(num_attn, num_expert, cfg.num_expert_ids)
        else:
            place = Placement.expert_parallel(num_devices, cfg.num_expert_ids)
        self.devices = [self._device(rank, place, max_batch_rows) for rank in range(place.num_runtimes)]
        if eplb is not None and eplb.live:
            self._rebalancing(eplb, place, pipeline)
        self.hub = core.LoopbackHub(len(self.devices))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: dict[int, BaseException] = {}
        self._ids = itertools.count(1)

    def _rebalancing(self, eplb: EplbSection, place: Placement, pipeline) -> None:
        if pipeline is not None:
            raise ConfigError("the stop-the-world rebalance does not run with an EP pipeline")
        load = functools.partial(build_expert_layer_set, self.model_dir, self.model_config, dtype=self.dtype)
        stop_the_world(self.devices, eplb, place, self.model_config, self.mode, self.emulation, load)

    def _device(self, rank: int, place: Placement, max_batch_rows: int | None) -> SyncDevice:
        hosted = place.experts_of(rank)
        attn_rank = place.attn_rank_of(rank)
        return SyncDevice(
            rank, self.model_config, place.expert_runtime, attn_devices=place.attn_runtime,
            expert_devices=place.hosts,
            attention=self._attention_executor(rank) if attn_rank is not None else None,
            experts=self._expert_executor(hosted, rank) if hosted else None,
            attn_rank=attn_rank or 0, max_batch_rows=max_batch_rows,
        )  # fmt: skip

    def _attention_executor(self, rank: int) -> AttentionExecutor:
        cfg = self.model_config
        requests = RankRequests(
            vocab_size=cfg.vocab_size, eos_token_ids=cfg.stop_token_ids, num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=min(cfg.max_position_embeddings, self.num_kv_blocks * self.block_size),
            grammars=Grammars.for_model(self.model_dir, cfg.vocab_size, cfg.stop_token_ids),
        )  # fmt: skip
        if self.emulation is not None:
            return AttentionExecutor(requests, self.emulation.attention(rank), cfg)
        model = build_attention_rank(self.model_dir, cfg, self.dtype)
        return AttentionExecutor(
            requests, TorchAttention(model, cfg, self.num_kv_blocks, self.block_size), cfg
        )

    def _expert_executor(self, hosted: list[int], rank: int):
        if self.emulation is not None:
            return self.emulation.expert_executor(rank)
        return ExpertExecutor(build_expert_layers(self.model_dir, self.model_config, hosted, self.dtype))

    @property
    def attention(self) -> list[SyncDevice]:
        return [d for d in self.devices if d.attention is not None]

    def start(self) -> SyncCluster:
        for device in self.devices:
            thread = threading.Thread(
                target=self._serve, args=(device,), name=f"amoe-{self.mode}-{device.rank}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def _serve(self, device: SyncDevice) -> None:
        try:
            comm = self.hub.communicator(device.rank)
            # Each request's state (output, done) is what wait() reads, so nothing more is published.
            run_sync_loop(self.mode, device, comm, self._stop, lambda out: None, **self.options)
        except BaseException as exc:  # noqa: BLE001 - surfaced to callers of generate() as EngineDeadError
            logger.warning("[sync] device %d died: %s: %s", device.rank, type(exc).__name__, exc)
            self.errors[device.rank] = exc

    def stop(self) -> None:
        """Stop every loop (they leave together at the next iteration boundary); idempotent."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.options["timeout_s"] + 5)

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        rank: int | None = None,
        seq_ids=(),
        request_id: int | None = None,
    ) -> RankRequest:
        """Add one request (to attention rank `rank`, default round-robin); it joins at the next iteration.
        With n > 1, `seq_ids` name its other sequences (they appear in its `children` once forked).
        `request_id`: the caller's (unique) id; None: the next of 1, 2, ..."""
        request_id = next(self._ids) if request_id is None else request_id
        ranks = self.attention
        device = ranks[(request_id - 1) % len(ranks) if rank is None else rank]
        params = params or SamplingParams(temperature=0)
        return device.add_request(request_id, prompt, params, seq_ids=seq_ids)

    def wait(self, reqs: list[RankRequest], timeout: float = 120.0) -> list[list[int]]:
        """Each request's output tokens once all are done; EngineDeadError if a device died or time ran out."""
        deadline = time.monotonic() + timeout
        for req in reqs:
            while not req.done.wait(0.05):
                self._check()
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"a request did not finish within {timeout} s")
        return [req.output for req in reqs]

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None, timeout: float = 120.0
    ) -> list[list[int]]:
        """Token ids generated for each prompt; prompt i goes to attention rank i mod A."""
        reqs = [self.submit(p, params, rank=i % len(self.attention)) for i, p in enumerate(prompts)]
        return self.wait(reqs, timeout)

    def _check(self) -> None:
        if self.errors:
            rank, exc = next(iter(self.errors.items()))
            raise EngineDeadError(f"device {rank} died: {type(exc).__name__}: {exc}") from exc

    def stats(self) -> list[dict]:
        """Per device: rank, role, busy/wait/idle seconds, stall fraction, iterations, rows per expert per block
        (and the emulated clock's stats when emulated)."""
        out = []
        for d in self.devices:
            s = {"rank": d.rank, "role": d.role, **d.stats.snapshot()}
            if self.emulation is not None:
                s["emulated"] = {
                    k: ex.stats() for k, ex in (("attention", d.attention), ("experts", d.experts)) if ex
                }
            out.append(s)
        return out

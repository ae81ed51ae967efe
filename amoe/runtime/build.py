"""What a runtime process builds from the config: the model shapes it serves, its placement, its communicator's link
delays (emulated runs), its KV capacity, and its executors — torch (real weights) or emulated
(`executor.kind = emulated`: no weights, a cost model).

Runtime-side only: the coordinator learns what it needs (KV blocks, max model length, vocabulary) from each
runtime's Hello, and never builds any of this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from amoe import device as devices
from amoe.config import AmoeConfig
from amoe.device import Device
from amoe.expert_map import ExpertMap, expected_load
from amoe.model.config import ModelConfig, load_model_config
from amoe.perf.model.links import link_delays as emulated_link_delays
from amoe.perf.model.links import runtime_nodes
from amoe.placement import Placement, local_index, node_of, runtimes_on_node
from amoe.runtime.emulated import Emulation
from amoe.runtime.executors import AttentionExecutor, ExpertExecutor, TorchAttention
from amoe.runtime.faults import Faults
from amoe.runtime.requests import RankRequests
from amoe.structured import Grammars

logger = logging.getLogger(__name__)


def emulation(config: AmoeConfig, model_dir: str | Path | None) -> Emulation | None:
    """The `Emulation` of the emulation section, or None when layers run in torch."""
    em = config.emulation
    if config.executor.kind != "emulated":
        return None
    return Emulation(
        em, None if em.profile is not None else load_model_config(model_dir), offload=emulated_offload(config)
    )


def emulated_offload(config: AmoeConfig):
    """`--offload-budget` on the emulated executor: each emulated device holds that many bytes of routed experts in
    its memory, the rest wait in host memory (docs/offload-policy.md "Emulated tiers"); None without a budget."""
    off = config.offload
    if off.budget is None:
        return None
    from amoe.perf.model.offload_tiers import OffloadSpec

    return OffloadSpec(off.budget_bytes, off.policy, off.eamc, prefetch=off.prefetch)


def runtime_model_config(em: Emulation | None, model_dir: str | Path | None) -> ModelConfig:
    """The shapes every runtime of this deployment uses (emulated: the profile's, with the wire width)."""
    return em.model_config if em is not None else load_model_config(model_dir)


def placement(config: AmoeConfig, num_experts: int) -> Placement:
    return Placement.of(config.parallel, num_experts)


def expert_map(config: AmoeConfig, place: Placement, cfg: ModelConfig) -> ExpertMap:
    """The expert map a runtime starts from (docs/rebalancing.md): each expert on its home runtime, plus
    `--num-redundant-experts` replicas a block placed by the expected load (no load is measured yet). The
    coordinator's map, which every runtime takes on before it serves, is made of what the expert runtimes built."""
    homes = ExpertMap.homes(place, cfg.num_blocks)
    redundant = config.eplb.num_redundant_experts
    if not redundant or config.parallel.mode != "aep":
        return homes
    prior = expected_load(cfg.num_blocks, cfg.num_experts, cfg.num_shared_experts, cfg.top_k)
    return homes.with_redundant(redundant, prior, place.hosts)


def expert_loader(
    config: AmoeConfig, model_dir, cfg: ModelConfig, em: Emulation | None, executor, dev: Device
):
    """How a joining replica's weights load, on the join's own thread (amoe.runtime.replicas): from the
    checkpoint onto `dev`, or on an emulated GPU after the modelled copy's time."""
    faults = Faults.from_env()  # tests only (AMOE_FAULTS "join", "joinwedge")

    def load(layers: list[tuple[int, int]]) -> dict:
        if faults is not None:
            faults.check_join([e for _, e in layers])
        if em is not None:
            time.sleep(executor.join_wall_s(layers))
            return dict.fromkeys(layers)
        from amoe.model.layers import build_expert_layer_set

        return build_expert_layer_set(model_dir, cfg, layers, dtype(config, cfg, dev), dev.torch)

    return load


def link_delays(
    config: AmoeConfig, em: Emulation, rank: int, num_runtimes: int = 0
) -> tuple[list[float], list[float]]:
    """(latency_s, seconds_per_row) per source runtime (of `num_runtimes` slots, at least the start-up ones) for
    `rank`'s communicator: the emulated GPU's links, with runtimes placed on nodes of `emulation.gpus_per_node`
    (emulated runs only). A runtime past the start-up ones (`amoe scale`) is on the last one's node."""
    par, ex = config.parallel, config.emulation
    num_expert = 0 if par.mode == "ep" else par.expert_ranks
    nodes = runtime_nodes(par.mode, par.attn_ranks, num_expert, ex.gpus_per_node)
    nodes += nodes[-1:] * (max(num_runtimes, rank + 1) - len(nodes))
    return emulated_link_delays(em.gpu, em.profile, nodes, rank, ex.time_scale)


def device(config: AmoeConfig, runtime: int) -> Device:
    """The device runtime `runtime` owns (its node's GPU of its place in placement order, or the CPU), made current
    before any CUDA work. Emulated GPUs hold no tensors: the CPU."""
    if config.executor.kind == "emulated":
        return devices.CPU
    return devices.runtime_device(
        config.device.kind, local_index(config, runtime), config.device.runtimes_per_gpu
    )


def dtype(config: AmoeConfig, cfg: ModelConfig, dev: Device):
    """Weights' and activations' dtype: `--model-dtype`, auto by device (amoe.device.model_dtype)."""
    return devices.model_dtype(config.model.dtype, cfg.dtype, dev)


def num_kv_blocks(
    config: AmoeConfig,
    em: Emulation | None,
    local_experts: Sequence[int] = (),
    *,
    cfg: ModelConfig | None = None,
    dev: Device | None = None,
    runtime: int = 0,
) -> int:
    """KV blocks of one attention rank: `cache.num_kv_blocks`; (emulated) what the GPU's memory holds beside the
    attention weights and, in EP, the experts sharing the GPU; else what `--gpu-memory-utilization` of this
    runtime's device leaves beside the weights it has loaded (call it after loading them)."""
    if em is not None:
        return em.num_kv_blocks(config.cache.block_size, local_experts)
    bs, limit = config.cache.block_size, _model_limit(config, cfg)
    if config.cache.num_kv_blocks is not None:
        blocks = config.cache.num_kv_blocks
        how = "--cache-num-kv-blocks"
    else:
        budget = kv_budget(config, cfg, dev, memory_share(config, dev, runtime))
        blocks = budget.num_blocks
        how = f"--gpu-memory-utilization {config.device.memory_utilization:g} of {dev.describe()}"
    logger.info(
        "runtime %d: KV cache of %d blocks of %d tokens (%s); max concurrent requests at %d tokens: %.1f",
        runtime, blocks, bs, how, limit, blocks / devices.blocks_for(limit, bs),
    )  # fmt: skip
    return blocks


def memory_share(config: AmoeConfig, dev: Device, runtime: int) -> int:
    """How many runtimes use the memory `runtime`'s budget comes from: the host's RAM is its node's runtimes', a
    GPU is its own runtime's or shared by --runtimes-per-gpu of them."""
    here = 1 if config.parallel.mode == "local" else runtimes_on_node(config, node_of(config, runtime))
    return min(here, config.device.runtimes_per_gpu) if dev.is_cuda else here


def kv_budget(config: AmoeConfig, cfg: ModelConfig, dev: Device, share: int) -> devices.KVBudget:
    """What `--gpu-memory-utilization` buys on `dev` for a model of `cfg` (amoe.device.kv_budget)."""
    bs = config.cache.block_size
    per_request = devices.blocks_for(_model_limit(config, cfg), bs)
    rows = max(config.scheduler.attn_batch_cap, config.scheduler.expert_batch_cap)
    # The activation reserve: float32 logits and hidden rows of the biggest batch, with 4x headroom.
    activation = 4 * rows * (cfg.vocab_size + 8 * cfg.hidden_size) * 4
    return devices.kv_budget(
        dev,
        block_bytes=devices.kv_block_bytes(
            cfg.num_layers, bs, cfg.kv_elements_per_token, dtype(config, cfg, dev)
        ),
        utilization=config.device.memory_utilization,
        share=share,
        activation_bytes=activation,
        max_blocks=config.cache.max_num_seqs * per_request,
        blocks_per_request=per_request,
    )


def _model_limit(config: AmoeConfig, cfg: ModelConfig) -> int:
    return min(config.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def max_model_len(config: AmoeConfig, cfg: ModelConfig, kv_blocks: int) -> int:
    """Tokens a request may reach: the model's limit, the configured one, and one rank's whole KV cache."""
    limit = config.model.max_model_len or cfg.max_position_embeddings
    return min(limit, cfg.max_position_embeddings, kv_blocks * config.cache.block_size)


def attention_executor(
    config: AmoeConfig,
    model_dir,
    cfg: ModelConfig,
    em: Emulation | None,
    local_experts: Sequence[int] = (),
    dev: Device = devices.CPU,
    runtime: int = 0,
) -> AttentionExecutor:
    """An attention rank: its requests over this rank's KV capacity, and torch or emulated compute. Torch weights
    load onto `dev` first, so the KV cache gets what they leave."""
    model = None
    if em is None:
        from amoe.model.layers import build_attention_rank

        model = build_attention_rank(model_dir, cfg, dtype(config, cfg, dev), dev.torch)
    blocks = num_kv_blocks(config, em, local_experts, cfg=cfg, dev=dev, runtime=runtime)
    requests = RankRequests(
        vocab_size=cfg.vocab_size,
        eos_token_ids=cfg.stop_token_ids,
        num_kv_blocks=blocks,
        block_size=config.cache.block_size,
        max_model_len=max_model_len(config, cfg, blocks),
        skip_prefill=em is not None and config.emulation.decode_only,
        grammars=Grammars.for_model(model_dir, cfg.vocab_size, cfg.stop_token_ids),
        computes_logits=em is None,
    )
    if em is not None:
        return AttentionExecutor(requests, em.attention(runtime), cfg)
    from amoe.offload.wiring import Offload

    rank = runtime if runtime < config.parallel.attn_ranks else 0
    recorder = Offload.attention_rank(config.offload, model_dir, cfg, rank, config.parallel.attn_ranks)
    compute = TorchAttention(model, cfg, blocks, config.cache.block_size, dev)
    return AttentionExecutor(
        requests, compute, cfg, offload=recorder if recorder.recorder is not None else None
    )


def expert_executor(
    config: AmoeConfig,
    model_dir,
    cfg: ModelConfig,
    experts: list[int],
    em: Emulation | None,
    dev: Device = devices.CPU,
    runtime: int = 0,
    layers: Collection[tuple[int, int]] | None = None,
):
    """The executor of this runtime's experts (every block of each, or exactly the (block, expert) `layers` of a
    live placement), their weights on `dev`; emulated, on the GPU of runtime `runtime`."""
    if em is not None:
        return em.expert_executor(runtime)
    from amoe.model.layers import build_expert_layer_set, build_expert_layers
    from amoe.offload.wiring import Offload

    weights_dtype = dtype(config, cfg, dev)
    if layers is not None and config.eplb.live:  # no offloading here (AmoeConfig refuses the two together)
        return ExpertExecutor(build_expert_layer_set(model_dir, cfg, layers, weights_dtype, dev.torch), dev)
    # --offload-budget: the routed experts stay on disk behind the store; only the shared ones load here.
    offload = Offload.expert_runtime(config.offload, model_dir, cfg, experts, weights_dtype, dev)
    if offload.store is None:
        return ExpertExecutor(build_expert_layers(model_dir, cfg, experts, weights_dtype, dev.torch), dev)
    shared = [e for e in experts if e >= cfg.num_experts]
    layers = build_expert_layers(model_dir, cfg, shared, weights_dtype, dev.torch) if shared else {}
    return ExpertExecutor(layers, dev, offload=offload)


def chunk_cost(config: AmoeConfig, devices: int, em: Emulation | None):
    """tokens per device → the runtime's host seconds per EP pipeline chunk as its clock counts them
    (ep_block.chunk_host_s): the devices' host work shares this machine's cores, and the emulated clock divides real
    time by the time scale. (An in-process group shares one core through the GIL: this is its lower bound.)"""
    import os

    from amoe.perf.model import ep_block

    contention = devices / (os.cpu_count() or 1)
    scale = config.emulation.time_scale if em is not None else 1.0
    return lambda tokens: ep_block.chunk_host_s(tokens, contention, scale)


def ep_pipeline(config: AmoeConfig, place: Placement, cfg: ModelConfig, em: Emulation | None):
    """EP's expert pipeline (`--ep-pipelines`, `--ep-kernel`), or None when neither is given; ConfigError for a PN
    above the experts a device hosts. `auto` asks the cost model, on the emulated GPU's profile (torch: the
    checkpoint's shapes on `--gpu`)."""
    from amoe.runtime.sync.eps import ExpertPipeline, fewest_hosted

    par = config.parallel
    if par.mode != "ep" or (par.ep_pipelines is None and par.ep_kernel is None):
        return None
    most = fewest_hosted(place.expert_runtime, place.hosts)
    choose_pn = choose_kernel = None
    if par.pipelines is None or par.kernel == "auto":
        from amoe.perf.model import ep_block
        from amoe.perf.model.gpus import gpu_profile
        from amoe.perf.model.hosts import host_overhead
        from amoe.perf.model.shapes import profile_of

        profile = em.profile if em is not None else profile_of(cfg)
        gpu = gpu_profile(config.emulation.gpu)
        host = host_overhead(config.emulation.host_overhead)
        # The emulated router is seeded alike in every process: `auto` can price its skew (tokens are uniform).
        q = None
        if em is not None:
            from amoe.perf.model.routing import routing_inclusion

            q = routing_inclusion(profile, config.emulation.routing, config.emulation.seed)
        choose_pn = ep_block.pipeline_chooser(
            profile, gpu, len(place.hosts), most, host, chunk_cost(config, len(place.hosts), em), q
        )
        choose_kernel = ep_block.kernel_chooser(profile, gpu)
    return ExpertPipeline(par.pipelines, par.ep_kernel, most, choose_pn, choose_kernel)

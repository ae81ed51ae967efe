"""The device layer on a host without a GPU: what `--device`, `--model-dtype auto`, `--gpu-memory-utilization` and
`--transport auto` decide, and that asking for CUDA here fails in one line before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from amoe import LLM, SamplingParams
from amoe import device as devices
from amoe.config import AmoeConfig
from amoe.device_check import probe, resolve
from amoe.errors import ConfigError
from amoe.placement import local_index, runtimes_on_node
from amoe.runtime import build

CUDA = devices.Device(torch.device("cuda", 0))  # a description only: nothing is allocated on it

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="these tests describe a host without CUDA")


def test_auto_is_cpu_here_and_cuda_fails_in_one_line():
    assert not probe()["cuda"]
    config = resolve(AmoeConfig().replace(device={"kind": "auto"}))
    assert config.device.kind == "cpu" and config.tensor_plane == "inline"
    assert devices.runtime_device("auto") == devices.CPU
    with pytest.raises(ConfigError, match=r"^--device cuda: ") as err:
        resolve(AmoeConfig().replace(device={"kind": "cuda"}))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^--device cuda: "):
        devices.runtime_device("cuda")


def test_serve_device_cuda_without_cuda_exits_before_starting(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "amoe", "serve", "--device", "cuda", "--port", "0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("amoe: error: --device cuda: "), done.stderr
    # No model load, no runtime process: it stops at the check (what it logged says so, not how long it took).
    assert "loading" not in done.stdout + done.stderr and "runtime" not in lines[0]


def test_emulated_runs_on_the_cpu():
    emulated = AmoeConfig().replace(
        executor={"kind": "emulated"}, emulation={"routing": "uniform"}, device={"kind": "auto"}
    )
    assert resolve(emulated).device.kind == "cpu"
    with pytest.raises(ConfigError, match="emulated GPUs hold no tensors"):
        emulated.replace(device={"kind": "cuda"})


def test_transport_auto_is_nccl_only_between_gpu_runtimes_of_one_host():
    assert AmoeConfig().replace(device={"kind": "cpu"}).tensor_plane == "inline"
    assert AmoeConfig().replace(device={"kind": "cuda"}).tensor_plane == "nccl"
    assert AmoeConfig().replace(device={"kind": "cuda"}, transport={"plane": "gloo"}).tensor_plane == "gloo"
    multi = AmoeConfig().replace(device={"kind": "cuda"}, dist={"nnodes": 2, "init_addr": "10.0.0.1:29500"})
    assert multi.tensor_plane == "inline"  # across hosts: ZeroMQ over CURVE
    with pytest.raises(ConfigError, match="needs --device cuda"):
        AmoeConfig().replace(device={"kind": "cpu"}, transport={"plane": "nccl"})


def test_model_dtype_auto():
    auto = devices.model_dtype
    assert auto("auto", "bfloat16", devices.CPU) == torch.float32  # CPU: float32, exact against the reference
    assert (
        auto("auto", "float32", CUDA) == torch.bfloat16
    )  # a float32 checkpoint is served in bfloat16 on a GPU
    assert auto("auto", "float16", CUDA) == torch.float16  # the checkpoint's 16-bit dtype when it names one
    assert auto("auto", "bfloat16", CUDA) == torch.bfloat16
    assert auto("float32", "bfloat16", CUDA) == torch.float32  # an explicit dtype wins
    with pytest.raises(ConfigError, match="model.dtype"):
        AmoeConfig().replace(model={"dtype": "int8"})


def test_env_stands_in_for_the_device_default(monkeypatch):
    monkeypatch.setenv("AMOE_DEVICE", "cpu")
    assert AmoeConfig().device.kind == "cpu"
    monkeypatch.delenv("AMOE_DEVICE")
    assert AmoeConfig().device.kind == "auto"
    assert AmoeConfig().replace(device={"kind": "cpu"}).device.kind == "cpu"


def test_runtimes_take_their_node_s_gpus_in_placement_order():
    one = AmoeConfig().replace(parallel={"attn_ranks": 2, "expert_ranks": 2})
    assert [local_index(one, r) for r in range(4)] == [0, 1, 2, 3]
    assert runtimes_on_node(one, 0) == 4
    two = one.replace(dist={"nnodes": 2, "init_addr": "10.0.0.1:29500"})  # nodes [0, 0, 1, 1]
    assert [local_index(two, r) for r in range(4)] == [0, 1, 0, 1]
    mapped = one.replace(dist={"nnodes": 2, "init_addr": "10.0.0.1:29500", "node_map": "1,0,1,1"})
    assert [local_index(mapped, r) for r in range(4)] == [0, 0, 1, 2]
    assert runtimes_on_node(mapped, 1) == 3


def test_runtimes_sharing_a_gpu_take_gpu_i_over_n_and_a_plane_other_than_nccl():
    aep = {"attn_ranks": 1, "expert_ranks": 3}
    shared = AmoeConfig().replace(device={"kind": "cuda", "runtimes_per_gpu": 2}, parallel=aep)
    assert [local_index(shared, r) // shared.device.runtimes_per_gpu for r in range(4)] == [0, 0, 1, 1]
    assert shared.tensor_plane == "inline"  # NCCL refuses two ranks on one GPU: auto does not pick it
    assert shared.replace(transport={"plane": "gloo"}).tensor_plane == "gloo"
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one GPU"):
        shared.replace(transport={"plane": "nccl"})
    with pytest.raises(ConfigError, match="Ray gives each runtime a GPU of its own"):
        shared.replace(dist={"backend": "ray"})
    with pytest.raises(ConfigError, match="device.runtimes_per_gpu must be positive"):
        AmoeConfig().replace(device={"runtimes_per_gpu": 0})
    # A GPU's memory is divided among the runtimes on it; the host's RAM among the node's.
    assert build.memory_share(shared, CUDA, 0) == 2
    assert build.memory_share(shared.replace(device={"runtimes_per_gpu": 8}), CUDA, 0) == 4
    assert build.memory_share(shared, devices.CPU, 0) == 4
    assert build.memory_share(AmoeConfig().replace(parallel=aep), CUDA, 0) == 1


def _budget(
    utilization: float, block_bytes: int, max_blocks: int = 10**9, share: int = 1
) -> devices.KVBudget:
    return devices.kv_budget(
        devices.CPU, block_bytes=block_bytes, utilization=utilization, share=share, activation_bytes=0,
        max_blocks=max_blocks, blocks_per_request=4,
    )  # fmt: skip


def test_kv_budget_follows_memory_utilization():
    used, total = devices.CPU.memory()
    block = 16 * 2**20
    half, more = _budget(0.5, block), _budget(0.8, block)
    assert more.num_blocks > half.num_blocks
    assert half.num_blocks == min((int(0.5 * total) - used) // block, (devices.CPU.free_bytes()) // block)
    # The host's RAM is shared by the node's runtimes; what they can use is the cap.
    assert _budget(0.5, block, share=4).num_blocks < half.num_blocks
    assert _budget(0.5, block, max_blocks=7).num_blocks == 7
    assert _budget(0.5, block, max_blocks=8).max_concurrent == 2.0
    with pytest.raises(ConfigError, match="no memory left for the KV cache"):
        _budget(used / total / 2, block)  # less than the weights already hold


def test_engine_sizes_kv_from_memory(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", max_num_seqs=3)
    engine = llm.engine
    per_request = -(-engine.model_config.max_position_embeddings // engine.config.block_size)
    assert engine.blocks.num_total_blocks == 3 * per_request  # RAM is plenty: what 3 requests can use
    assert engine.runner.kv.key[0].device.type == "cpu" and engine.runner.kv.key[0].dtype == torch.float32
    out = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(ConfigError, match="no memory left"):
        LLM(tiny_checkpoint, device="cpu", memory_utilization=1e-6)


def test_runtime_kv_blocks_from_memory(tiny_checkpoint):
    config = AmoeConfig().replace(device={"kind": "cpu"}, cache={"max_num_seqs": 5})
    cfg = build.runtime_model_config(None, tiny_checkpoint)
    executor = build.attention_executor(config, tiny_checkpoint, cfg, None, dev=devices.CPU)
    per_request = -(-cfg.max_position_embeddings // 16)
    assert executor.requests.blocks.num_total_blocks == 5 * per_request
    fixed = build.attention_executor(config.replace(cache={"num_kv_blocks": 9}), tiny_checkpoint, cfg, None)
    assert fixed.requests.blocks.num_total_blocks == 9  # an explicit count wins

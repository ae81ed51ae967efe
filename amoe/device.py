"""Where a runtime's tensors live and in what type: the one module that knows device kinds (docs/gpu.md).

Everything else computes on `Device.torch` and moves tensors with `Device.put` / `Device.host`; the lines that differ
between a CPU and a GPU are here, behind `Device.is_cuda`, and in cpp/plane_c10d.cpp (NCCL's events) and
cpp/zmq_comm.cpp (pinned staging). A CPU run goes through the same calls, so it covers the same paths but those.

`python -m amoe.device` prints what this host has as one JSON line (amoe.device_check runs it: the coordinator
never loads torch).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass

import torch

from amoe.config import DTYPE_NAMES
from amoe.errors import ConfigError

logger = logging.getLogger(__name__)

_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_SIXTEEN_BIT = ("bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config or checkpoint dtype name (one of DTYPE_NAMES)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}") from None


@dataclass(frozen=True)
class Device:
    """The one device a runtime process computes on."""

    torch: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.torch.type == "cuda"

    def put(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """`tensor` on this device. A host tensor bound for a GPU goes through pinned memory, so the copy is a DMA
        the GPU orders on its stream rather than a pageable copy the driver stages itself."""
        if tensor is None or tensor.device == self.torch:
            return tensor
        if self.is_cuda and tensor.device.type == "cpu":
            return tensor.pin_memory().to(self.torch, non_blocking=True)
        return tensor.to(self.torch)

    @staticmethod
    def host(tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the CPU (token ids and routing metadata: all that leaves a GPU)."""
        return tensor.cpu()

    def memory(self) -> tuple[int, int]:
        """(bytes in use by this process, bytes of the device in all): what a memory budget is taken from."""
        if self.is_cuda:
            _, total = torch.cuda.mem_get_info(self.torch)
            return torch.cuda.memory_reserved(self.torch), total
        return _rss_bytes(), _meminfo("MemTotal")

    def free_bytes(self) -> int:
        """Bytes nothing holds now (other processes count): a budget never reaches past them."""
        if self.is_cuda:
            return torch.cuda.mem_get_info(self.torch)[0]
        return _meminfo("MemAvailable")

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing only; the serving path never waits on the host)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.torch)

    def describe(self) -> str:
        if self.is_cuda:
            return f"{self.torch} ({torch.cuda.get_device_name(self.torch)})"
        return "cpu"


CPU = Device(torch.device("cpu"))


def runtime_device(kind: str, local_index: int = 0, per_gpu: int = 1) -> Device:
    """The device of a runtime that is number `local_index` among its node's runtimes, `per_gpu` of which share a
    GPU, made current before any CUDA work (so every allocation, stream and NCCL communicator of the process lands
    on it). `kind` auto: CUDA when this host has it. CUDA_VISIBLE_DEVICES is respected: index i is the i-th
    visible GPU."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return CPU
    if not torch.cuda.is_available():
        raise ConfigError(f"--device cuda: {cuda_missing_reason()}")
    count, gpu = torch.cuda.device_count(), local_index // per_gpu
    if gpu >= count:
        raise ConfigError(
            f"--device cuda: this node's runtime {local_index} needs GPU {gpu}, but {count} "
            f"{'is' if count == 1 else 'are'} visible{_visible_note()}; run fewer runtimes per node or more per "
            "GPU (--runtimes-per-gpu)"
        )
    torch.cuda.set_device(gpu)
    return Device(torch.device("cuda", gpu))


def model_dtype(name: str, checkpoint_dtype: str, device: Device) -> torch.dtype:
    """The dtype weights and activations are held in: `name`, or for auto float32 on the CPU (exact against the
    reference) and on a GPU the checkpoint's 16-bit dtype when it names one, else bfloat16 (vLLM's choice)."""
    if name != "auto":
        return torch_dtype(name)
    if not device.is_cuda:
        return torch.float32
    return torch_dtype(checkpoint_dtype if checkpoint_dtype in _SIXTEEN_BIT else "bfloat16")


@dataclass(frozen=True)
class KVBudget:
    """What a memory budget buys: KV blocks, and what they mean to a user."""

    num_blocks: int
    block_bytes: int
    budget_bytes: int
    max_concurrent: float  # requests of max_model_len tokens that fit at once

    def describe(self, block_size: int, max_model_len: int) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks of {block_size} tokens "
            f"({self.num_blocks * self.block_bytes / 2**20:.1f} MiB); "
            f"max concurrent requests at {max_model_len} tokens: {self.max_concurrent:.1f}"
        )


def kv_budget(
    device: Device,
    *,
    block_bytes: int,
    utilization: float,
    share: int,
    activation_bytes: int,
    max_blocks: int,
    blocks_per_request: int,
    unfilled_bytes: int = 0,
) -> KVBudget:
    """KV blocks from memory, as vLLM sizes them: this runtime may use `utilization` of the device (of a GPU or of
    the host's RAM, divided among the `share` runtimes that use it); what its weights already hold, what it has set
    aside and not yet filled (`unfilled_bytes`: an offload store's slots) and an activation reserve come off, and
    the rest, never more than is free now, holds blocks. No more than `max_blocks` (what max_num_seqs requests of
    max_model_len tokens can use): a CPU budget of gigabytes would otherwise commit the whole of it for a small
    model."""
    used, total = device.memory()
    used += unfilled_bytes
    share = max(share, 1)
    budget = int(utilization * total / share) - used - activation_bytes
    budget = min(budget, device.free_bytes() - unfilled_bytes - activation_bytes)
    blocks = min(budget // block_bytes, max_blocks) if budget > 0 else 0
    if blocks < 1:
        raise ConfigError(
            f"no memory left for the KV cache on {device.describe()}: --gpu-memory-utilization {utilization} "
            f"allows {utilization * total / share / 2**30:.2f} GiB, the weights hold {used / 2**30:.2f} GiB; "
            "raise it, or give --cache-num-kv-blocks"
        )
    return KVBudget(blocks, block_bytes, budget, blocks / max(blocks_per_request, 1))


def kv_block_bytes(num_layers: int, block_size: int, elements_per_token: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over every layer of a rank: `elements_per_token` per token and layer (K and V of
    every KV head, or MLA's latent and rope key: ModelConfig.kv_elements_per_token)."""
    return num_layers * block_size * elements_per_token * torch.empty((), dtype=dtype).element_size()


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def _visible_note() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""


def cuda_missing_reason() -> str:
    """Why torch sees no GPU here, in one line."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build; install a CUDA torch (docs/gpu.md)"
    return f"no CUDA device is visible{_visible_note()}"


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {field}")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe() -> dict:
    """What this host's torch can run on: the CUDA devices it sees, or why none."""
    if not torch.cuda.is_available():
        return {"cuda": False, "count": 0, "names": [], "reason": cuda_missing_reason()}
    count = torch.cuda.device_count()
    return {"cuda": True, "count": count, "names": [torch.cuda.get_device_name(i) for i in range(count)]}


if __name__ == "__main__":
    sys.stdout.write(json.dumps(probe()) + "\n")

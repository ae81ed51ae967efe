"""Reading Hugging Face safetensors checkpoints selectively, and writing deterministic random ones."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from amoe.device import torch_dtype
from amoe.errors import ModelLoadError
from amoe.model import weights as W
from amoe.model.config import ModelConfig, model_config_from_hf
from amoe.model.families import family

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointReader:
    """Knows which file holds each tensor; reads only the tensors (or expert slices) asked for, each copied once
    from the file's memory map into a tensor of its own on `device`. Never a view of the map, on the CPU either: a
    view would keep the whole file mapped after the reader closes, and with it every page any read touched."""

    def __init__(self, model_dir: str | Path, device: torch.device | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.device = device or torch.device("cpu")
        self._file_of = self._map_tensors()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()  # safe_open handles release their mmap when dropped

    def release(self) -> None:
        """Unmap the files now, and with them the pages the reads so far touched (they count as this process's
        resident memory while mapped); the next read maps its file again. Between layers, the copies made so far
        and one layer's pages are resident at once, not the copies and every page read."""
        self.close()

    def has(self, name: str) -> bool:
        return name in self._file_of

    def read(self, name: str, shape: W.Shape, dtype: torch.dtype, index: int | None = None) -> torch.Tensor:
        """Tensor `name` (or its row `index` along dim 0), checked against `shape` and cast to `dtype`."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        return out.copy_(self._mapped(name, shape, index))

    def read_rows(self, parts: list[tuple[str, W.Shape]], dtype: torch.dtype) -> torch.Tensor:
        """Tensors `parts` ((name, shape), ...) stacked along dim 0 in one tensor, each read straight into its rows:
        a fused projection (q|k|v, gate|up) without a copy of each part on the way."""
        out = torch.empty(
            (sum(shape[0] for _, shape in parts), *parts[0][1][1:]), dtype=dtype, device=self.device
        )
        at = 0
        for name, shape in parts:
            out[at : at + shape[0]].copy_(self._mapped(name, shape))
            at += shape[0]
        return out

    def _mapped(self, name: str, shape: W.Shape, index: int | None = None) -> torch.Tensor:
        """Tensor `name` (or its row `index`) as a view of the file's map, checked against `shape`."""
        path = self._file_of.get(name)
        if path is None:
            raise ModelLoadError(f"{self.model_dir}: tensor {name} is missing from the checkpoint")
        try:
            tensor_slice = self._handle(path).get_slice(name)
            got = tuple(tensor_slice.get_shape())
            if index is not None:
                if not got or index >= got[0]:
                    raise ModelLoadError(f"{path}: tensor {name} has shape {list(got)}, no row {index}")
                got = got[1:]
            if got != tuple(shape):
                raise ModelLoadError(
                    f"{path}: tensor {name} has shape {list(got)}, expected {list(shape)} from config.json"
                )
            return tensor_slice[index] if index is not None else tensor_slice[:]
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt data
            raise ModelLoadError(f"{path}: cannot read tensor {name}: {exc}") from None

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def _map_tensors(self) -> dict[str, Path]:
        if not self.model_dir.is_dir():
            raise ModelLoadError(f"model directory {self.model_dir} does not exist")
        index = self.model_dir / INDEX_FILE
        if index.exists():
            return self._map_from_index(index)
        single = self.model_dir / SINGLE_FILE
        if not single.exists():
            raise ModelLoadError(f"{self.model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        try:
            return dict.fromkeys(_open(single).keys(), single)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{single}: unreadable: {exc}") from None

    def _map_from_index(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: self.model_dir / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from None
        for path in set(files.values()):
            if not path.exists():
                raise ModelLoadError(f"{index}: lists shard {path.name}, which does not exist")
        return files


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:
        raise ModelLoadError(f"{path}: unreadable safetensors file: {exc}") from None


def load_attention_rank_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> W.AttentionRankWeights:
    """Embedding, every layer's attention side (norms, attention, router or dense MLP), final norm and lm_head;
    no expert tensor is read."""
    dtype = dtype or torch_dtype(cfg.dtype)
    with CheckpointReader(model_dir, device) as reader:
        embed = reader.read(W.EMBED, (cfg.vocab_size, cfg.hidden_size), dtype)
        layers = []
        for layer in range(cfg.num_layers):
            layers.append(_read_layer(reader, cfg, layer, dtype))
            reader.release()
        final_norm = reader.read(W.FINAL_NORM, (cfg.hidden_size,), dtype)
        if cfg.tie_word_embeddings:
            lm_head = embed
        else:
            lm_head = reader.read(W.LM_HEAD, (cfg.vocab_size, cfg.hidden_size), dtype)
    logger.info("[model] loaded attention weights of %d layers from %s", cfg.num_layers, model_dir)
    return W.AttentionRankWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def load_expert_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    experts: Iterable[int],
    blocks: Iterable[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> dict[tuple[int, int], W.ExpertWeights]:
    """The given experts of the given blocks (default: every block), keyed by (block, expert); expert id
    num_experts is the shared expert."""
    dtype = dtype or torch_dtype(cfg.dtype)
    experts = sorted(set(experts))
    bad = [e for e in experts if not 0 <= e < cfg.num_expert_ids]
    if bad:
        shared = f" + {cfg.num_shared_experts} shared" if cfg.num_shared_experts else ""
        raise ModelLoadError(
            f"{model_dir}: expert {bad[0]} does not exist (num_local_experts={cfg.num_experts}{shared})"
        )
    block_ids = range(cfg.num_blocks) if blocks is None else sorted(set(blocks))
    loaded = {}
    with CheckpointReader(model_dir, device) as reader:
        for b in block_ids:
            loaded.update({(b, e): _read_expert(reader, cfg, b, e, dtype) for e in experts})
            reader.release()
    logger.info("[model] loaded experts %s of %d blocks from %s", experts, len(block_ids), model_dir)
    return loaded


def _present(reader: CheckpointReader, name: str) -> str:
    """`name`, or its transformers-5 in-memory spelling (Mixtral's `block_sparse_moe` is `mlp` there)."""
    alias = name.replace(".block_sparse_moe.", ".mlp.")
    return alias if not reader.has(name) and reader.has(alias) else name


def _read_layer(reader: CheckpointReader, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> W.LayerWeights:
    fam, p = family(cfg.architecture), W.layer_prefix(layer)
    # DeepSeek keeps its router in float32 whatever the model dtype (transformers: _keep_in_fp32_modules).
    router_dtype = torch.float32 if cfg.router.method != "softmax" else dtype
    shapes = W.layer_shapes(cfg, layer)
    gate, up, down = (f"{p}mlp.{proj}.weight" for proj in fam.expert_projs)
    # What runs as one matmul is read as one tensor: grouped-query attention's q|k|v, a dense MLP's gate|up.
    fused = {
        f"{p}self_attn.{W.FUSED_QKV}.{kind}": [f"{p}self_attn.{proj}.{kind}" for proj in W.QKV]
        for kind in ("weight", "bias")
    }
    fused[gate_up := f"{p}mlp.gate_up"] = [gate, up]
    t: dict[str, torch.Tensor] = {}
    for name, parts in fused.items():
        if all(part in shapes for part in parts):
            t[name] = reader.read_rows([(_present(reader, n), shapes[n]) for n in parts], dtype)
            t.update(zip(parts, t[name].split([shapes[n][0] for n in parts])))  # views, by checkpoint name
    for name, shape in shapes.items():
        if name not in t:
            routing = name.startswith(p + fam.moe + ".gate.")
            t[name] = reader.read(_present(reader, name), shape, router_dtype if routing else dtype)
    attention = {
        name.removeprefix(p + "self_attn."): v for name, v in t.items() if name.startswith(p + "self_attn.")
    }
    mlp = W.ExpertWeights(gate_up=t[gate_up], down=t[down]) if layer in cfg.dense_layers else None
    return W.LayerWeights(
        input_norm=t[p + "input_layernorm.weight"],
        post_norm=t[p + "post_attention_layernorm.weight"],
        attention=attention,
        mlp=mlp,
        router=t.get(W.router_name(fam, layer)),
        router_bias=t.get(W.router_name(fam, layer, W.ROUTER_BIAS)),
        shared_gate=t.get(f"{p}{fam.shared_gate}.weight") if cfg.shared_gate else None,
    )


def _read_expert(reader: CheckpointReader, cfg: ModelConfig, block: int, expert: int, dtype: torch.dtype):
    shapes = W.expert_shapes(cfg, block, expert)
    (gate, gate_shape), (up, up_shape), (down, down_shape) = shapes.items()
    if expert < cfg.num_experts and not reader.has(_present(reader, gate)):
        packed_gate_up, packed_down = W.packed_expert_names(cfg, block)
        if reader.has(packed_gate_up):  # transformers' packed layout: one [E, ...] tensor per projection
            return W.ExpertWeights(
                gate_up=reader.read(packed_gate_up, (2 * gate_shape[0], gate_shape[1]), dtype, index=expert),
                down=reader.read(packed_down, down_shape, dtype, index=expert),
            )
    gate_up = [(_present(reader, gate), gate_shape), (_present(reader, up), up_shape)]
    return W.ExpertWeights(
        gate_up=reader.read_rows(gate_up, dtype), down=reader.read(_present(reader, down), down_shape, dtype)
    )


def write_random_checkpoint(
    hf_config: dict[str, Any], out_dir: str | Path, seed: int, shards: int = 1
) -> Path:
    """Deterministic random float32 weights of any supported family, named as transformers saves them (one
    tensor per expert), plus config.json; returns out_dir. A config without `architectures` is a Mixtral."""
    if not hf_config.get("architectures") and not hf_config.get("model_type"):
        hf_config = {**hf_config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    hf_config = {**hf_config, "dtype": "float32", "torch_dtype": "float32"}
    cfg = model_config_from_hf(hf_config)
    std = float(hf_config.get("initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _random_tensor(name, shape, std, gen) for name, shape in W.canonical_shapes(cfg).items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    _save_shards(tensors, out, shards)
    logger.info("[model] wrote random checkpoint (seed %d, %d shard(s)) to %s", seed, shards, out)
    return out


def _random_tensor(name: str, shape: W.Shape, std: float, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        # Norm weights near 1 but not exactly, so a wrong or missing norm changes the output.
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(W.ROUTER_BIAS):
        # Large enough against the sigmoid scores' spread to change which experts win.
        return 0.05 * torch.randn(shape, generator=gen)
    return std * torch.randn(shape, generator=gen)


def _save_shards(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    metadata = {"format": "pt"}
    if shards <= 1:
        save_file(tensors, str(out / SINGLE_FILE), metadata=metadata)
        return
    names = list(tensors)
    shards = min(shards, len(names))
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * len(names) // shards : (s + 1) * len(names) // shards]}
        save_file(part, str(out / file), metadata=metadata)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

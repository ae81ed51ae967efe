"""Model families, registered by config.json's `architectures`: each module reads its family's config into a
ModelConfig and says where its tensors live; the layers themselves are the shared base in amoe.model
(docs/engine.md "Families" says how to add one)."""

from __future__ import annotations

from typing import Any

from amoe.model.families.base import Family
from amoe.model.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from amoe.model.families.mixtral import MIXTRAL
from amoe.model.families.olmoe import OLMOE
from amoe.model.families.qwen2_moe import QWEN2_MOE
from amoe.model.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    f.architecture: f for f in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_V2, DEEPSEEK_V3)
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "Family", "family", "family_of"]


def family_of(hf: dict[str, Any]) -> Family:
    """The family of a config.json dict: by `architectures`, else by `model_type`; ValueError naming what is
    supported otherwise."""
    archs = hf.get("architectures") or []
    if archs:
        unsupported = [a for a in archs if a not in FAMILIES]
        if unsupported:
            raise ValueError(
                f"unsupported architecture {unsupported[0]!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return FAMILIES[archs[0]]
    model_type = hf.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(_BY_MODEL_TYPE)})")
    return _BY_MODEL_TYPE[model_type]


def family(architecture: str) -> Family:
    """The registered family of a ModelConfig's `architecture`."""
    return FAMILIES[architecture]

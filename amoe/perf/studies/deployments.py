"""Published deployments as data: the JSON-lines files `amoe bench frontier --deployments FILE` reads, one
deployment a line, and their validation (a bad line is one error naming the file, the line and the field).

A line (docs/deployments.md has the format with an example):

    name          unique id                                    phase      "decode" | "prefill"
    model         a profile name (amoe.perf.model.models) or a config.json path (relative: to the file)
    gpu, gpus     GPU type (amoe.perf.model.gpus) and how many the deployment's group uses
    layout        {"mode": "ep", "ep_size": N, "dp_attention": true, "gpus_per_node": 8}
                  {"mode": "aep" | "pingpong", "attention_gpus": A, "expert_gpus": E, "micro_batches": m}
    batch_per_gpu requests decoding per GPU (prefill: "tokens_per_gpu"), or "concurrency" for the whole group
    kv_length     mean KV tokens per decoded token, or "input_len" and "output_len" (a number or [lo, hi] uniform)
    prompt_len    (prefill) tokens per prompt
    two_batch_overlap, redundant_experts, eplb    EP as deployed
    precision     {"attention": "bf16" | "fp8" | "fp4", "experts": ...} (default: the profile's)
    mtp           {"draft_tokens": d, "acceptance": a} (optional)
    routing       a --routing spec (optional; default: the documented skew rescaled to the model's experts)
    published     {"value": x, "unit": UNIT, "source": URL, "where": "the table, figure or sentence"}
    in_sample     true where the deployment's own measurements fed the calibration
    ablation      {"of": NAME, "published_gain": g}: this line without a feature NAME's line has; the check is
                  predicted(NAME) / predicted(this) against g
    notes         free text (assumptions, what the source does not state)

UNITS: output or input tokens/s per GPU or per node (a node: the layout's gpus_per_node GPUs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from amoe.perf.model.gpus import GPUS
from amoe.perf.model.models import MODELS, PRECISIONS

DEFAULT_FILE = Path(__file__).resolve().parent / "data" / "deployments.jsonl"
UNITS = (
    "output_tokens_per_s_per_gpu", "output_tokens_per_s_per_node",
    "input_tokens_per_s_per_gpu", "input_tokens_per_s_per_node",
)  # fmt: skip
PHASES = ("decode", "prefill")
MODES = ("ep", "aep", "pingpong")
KNOWN = {
    "name", "phase", "model", "gpu", "gpus", "layout", "batch_per_gpu", "concurrency", "tokens_per_gpu",
    "kv_length", "input_len", "output_len", "prompt_len", "two_batch_overlap", "redundant_experts", "eplb",
    "precision", "mtp", "routing", "published", "in_sample", "ablation", "notes",
}  # fmt: skip


class DeploymentError(ValueError):
    """A line of a deployments file that cannot be used: its message names the file, the line and the field."""


@dataclass(frozen=True)
class Published:
    value: float
    unit: str
    source: str
    where: str


@dataclass(frozen=True)
class PublishedDeployment:
    """One validated line."""

    line: int
    name: str
    phase: str
    model: str
    gpu: str
    gpus: int
    mode: str
    ep_size: int
    attention_gpus: int
    expert_gpus: int
    micro_batches: int
    gpus_per_node: int
    batch_per_gpu: float
    kv_length: float
    prompt_len: int
    two_batch_overlap: bool
    redundant_experts: int
    precision: dict = field(default_factory=dict)
    draft_tokens: int = 0
    acceptance: float = 0.0
    routing: str | None = None
    published: Published | None = None
    in_sample: bool = False
    ablation_of: str | None = None
    published_gain: float | None = None
    notes: str = ""
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def per_node_gpus(self) -> int:
        return self.gpus_per_node


def load(path: str | Path) -> list[PublishedDeployment]:
    """Every line of a deployments file (blank lines and lines starting with # skipped), validated; names unique
    and every ablation's line present."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise DeploymentError(f"{p}: cannot read ({exc.strerror})") from None
    out: list[PublishedDeployment] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        out.append(parse_line(line, number, p))
    names = [d.name for d in out]
    for d in out:
        if names.count(d.name) > 1:
            raise DeploymentError(f"{p}:{d.line}: field 'name': {d.name!r} is used by another line")
        if d.ablation_of is not None and d.ablation_of not in names:
            raise DeploymentError(f"{p}:{d.line}: field 'ablation.of': no line named {d.ablation_of!r}")
    if not out:
        raise DeploymentError(f"{p}: no deployments")
    return out


def parse_line(line: str, number: int, path: Path) -> PublishedDeployment:
    """One line, or a DeploymentError naming the field."""
    where = f"{path}:{number}"
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DeploymentError(f"{where}: not a JSON object ({exc.msg} at column {exc.colno})") from None
    if not isinstance(raw, dict):
        raise DeploymentError(f"{where}: not a JSON object")
    unknown = sorted(set(raw) - KNOWN)
    if unknown:
        raise DeploymentError(f"{where}: field {unknown[0]!r}: unknown (fields: {', '.join(sorted(KNOWN))})")
    f = _Fields(raw, where, path)
    parts = {**f.identity(), **f.layout(), **f.workload(), **f.serving(), **f.reference()}
    return PublishedDeployment(line=number, **parts, raw=raw)


class _Fields:
    """A line's fields, read with one-line errors."""

    def __init__(self, raw: dict, where: str, path: Path) -> None:
        self.raw, self.where, self.path = raw, where, path

    def fail(self, name: str, message: str) -> DeploymentError:
        return DeploymentError(f"{self.where}: field {name!r}: {message}")

    def get(self, name: str, kind, default=None, required: bool = False):
        if name not in self.raw:
            if required:
                raise self.fail(name, "missing")
            return default
        value = self.raw[name]
        ok = isinstance(value, kind) and not (kind in (int, float, (int, float)) and isinstance(value, bool))
        if not ok:
            raise self.fail(name, f"must be {getattr(kind, '__name__', 'a number')}; got {value!r}")
        return value

    def number(self, name: str, lo: float, default=None, required: bool = False, whole: bool = False):
        value = self.get(name, int if whole else (int, float), default, required)
        if value is not None and value < lo:
            raise self.fail(name, f"must be at least {lo}; got {value!r}")
        return value

    def identity(self) -> dict:
        name = self.get("name", str, required=True)
        phase = self.get("phase", str, required=True)
        if phase not in PHASES:
            raise self.fail("phase", f"{phase!r}; choose from {', '.join(PHASES)}")
        model = self.get("model", str, required=True)
        if model not in MODELS:
            cfg = (self.path.parent / model) if not Path(model).is_absolute() else Path(model)
            if not cfg.is_file():
                raise self.fail(
                    "model", f"{model!r} is neither a profile ({', '.join(MODELS)}) nor a config.json"
                )
            model = str(cfg)
        gpu = self.get("gpu", str, required=True)
        if gpu not in GPUS:
            raise self.fail("gpu", f"unknown GPU {gpu!r}; choose from {', '.join(GPUS)}")
        gpus = self.number("gpus", 1, required=True, whole=True)
        return {"name": name, "phase": phase, "model": model, "gpu": gpu, "gpus": gpus}

    def layout(self) -> dict:
        lay = self.get("layout", dict, required=True)
        mode = lay.get("mode")
        if mode not in MODES:
            raise self.fail("layout.mode", f"{mode!r}; choose from {', '.join(MODES)}")
        per_node = lay.get("gpus_per_node", GPUS[self.raw["gpu"]].nvlink_domain)
        if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 1:
            raise self.fail("layout.gpus_per_node", f"must be a whole number >= 1; got {per_node!r}")
        out = {"mode": mode, "gpus_per_node": per_node, "ep_size": 0, "attention_gpus": 0, "expert_gpus": 0,
               "micro_batches": 1}  # fmt: skip
        if mode == "ep":
            out["ep_size"] = self._whole(lay, "ep_size", 1)
            if lay.get("dp_attention", True) is not True:
                raise self.fail("layout.dp_attention", "false (tensor-parallel attention) is not modelled")
            if out["ep_size"] > self.raw["gpus"]:
                raise self.fail("layout.ep_size", f"{out['ep_size']} exceeds gpus {self.raw['gpus']}")
            return out
        if self.raw["phase"] != "decode":
            raise self.fail("layout.mode", f"{mode} is modelled for decode only")
        out["attention_gpus"] = self._whole(lay, "attention_gpus", 1)
        out["expert_gpus"] = self._whole(lay, "expert_gpus", 1)
        out["micro_batches"] = self._whole(lay, "micro_batches", 1) if mode == "pingpong" else 1
        if out["attention_gpus"] + out["expert_gpus"] > self.raw["gpus"]:
            raise self.fail("layout", "attention_gpus + expert_gpus exceed gpus")
        return out

    def _whole(self, lay: dict, key: str, lo: int) -> int:
        value = lay.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise self.fail(f"layout.{key}", f"must be a whole number >= {lo}; got {value!r}")
        return value

    def workload(self) -> dict:
        if self.raw["phase"] == "prefill":
            tokens = self.number("tokens_per_gpu", 1, required=True)
            prompt = self.number("prompt_len", 1, required=True, whole=True)
            return {"batch_per_gpu": float(tokens), "kv_length": float(prompt), "prompt_len": prompt}
        group = self.raw["layout"].get("ep_size") or self.raw["layout"].get("attention_gpus")
        if ("batch_per_gpu" in self.raw) == ("concurrency" in self.raw):
            raise self.fail("batch_per_gpu", "give batch_per_gpu or concurrency (one of them)")
        batch = self.number("batch_per_gpu", 1)
        if batch is None:
            batch = self.number("concurrency", 1, whole=True) / group
        return {"batch_per_gpu": float(batch), "kv_length": self._kv(), "prompt_len": 0}

    def _kv(self) -> float:
        from amoe.perf.model.cost_model import mean_decode_context

        if "kv_length" in self.raw:
            if "input_len" in self.raw or "output_len" in self.raw:
                raise self.fail("kv_length", "give kv_length or input_len and output_len, not both")
            return float(self.number("kv_length", 1))
        lengths = []
        for name in ("input_len", "output_len"):
            value = self.raw.get(name)
            if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
                if not 0 <= value[0] <= value[1]:
                    raise self.fail(name, f"a range must be [lo, hi] with 0 <= lo <= hi; got {value!r}")
                lengths.append(tuple(value))
            else:
                n = self.number(name, 0, required=True)
                lengths.append((n, n))
        if lengths[0][0] == lengths[0][1] and lengths[1][0] == lengths[1][1]:
            return lengths[0][0] + lengths[1][0] / 2  # a decoded token's KV: the prompt and half the output
        return mean_decode_context(lengths[0], lengths[1])

    def serving(self) -> dict:
        tbo = self.get("two_batch_overlap", bool, False)
        redundant = self.number("redundant_experts", 0, 0, whole=True)
        eplb = self.get("eplb", bool, redundant > 0)
        if eplb != (redundant > 0):
            raise self.fail("eplb", "EPLB is modelled with redundant experts (eplb true with redundant_experts > 0, "
                                    "false with 0)")  # fmt: skip
        if (tbo or redundant) and self.raw["layout"]["mode"] != "ep":
            raise self.fail("two_batch_overlap", "two-batch overlap and redundant experts are EP's")
        precision = self.get("precision", dict, {})
        for key, value in precision.items():
            if key not in ("attention", "experts") or value not in PRECISIONS:
                raise self.fail(
                    f"precision.{key}", f"{value!r}; keys attention, experts of {', '.join(PRECISIONS)}"
                )
        mtp = self.get("mtp", dict, {})
        draft, acceptance = mtp.get("draft_tokens", 0), mtp.get("acceptance", 0.0)
        if not isinstance(draft, int) or isinstance(draft, bool) or draft < 0:
            raise self.fail("mtp.draft_tokens", f"must be a whole number >= 0; got {draft!r}")
        if not isinstance(acceptance, (int, float)) or not 0 <= acceptance <= 1:
            raise self.fail("mtp.acceptance", f"must be in [0, 1]; got {acceptance!r}")
        if draft and (self.raw["phase"] != "decode" or self.raw["layout"]["mode"] != "ep"):
            raise self.fail("mtp", "multi-token prediction is modelled for EP decode")
        routing = self.get("routing", str)
        if routing is not None:
            from amoe.errors import ConfigError
            from amoe.perf.model.routing import RoutingSpec

            try:
                RoutingSpec.parse(routing)
            except (ConfigError, ValueError) as exc:
                raise self.fail("routing", str(exc)) from None
        return {"two_batch_overlap": tbo, "redundant_experts": redundant, "precision": precision,
                "draft_tokens": draft, "acceptance": float(acceptance), "routing": routing}  # fmt: skip

    def reference(self) -> dict:
        pub = self.get("published", dict, required=True)
        value = pub.get("value")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise self.fail("published.value", f"must be a positive number; got {value!r}")
        if pub.get("unit") not in UNITS:
            raise self.fail("published.unit", f"{pub.get('unit')!r}; choose from {', '.join(UNITS)}")
        if pub["unit"].startswith("output") != (self.raw["phase"] == "decode"):
            raise self.fail("published.unit", f"{pub['unit']} does not fit phase {self.raw['phase']}")
        for key in ("source", "where"):
            if not isinstance(pub.get(key), str) or not pub[key]:
                raise self.fail(f"published.{key}", "must name where the figure was read")
        ablation = self.get("ablation", dict, {})
        of, gain = ablation.get("of"), ablation.get("published_gain")
        if ablation and (not isinstance(of, str) or not isinstance(gain, (int, float)) or gain <= 0):
            raise self.fail("ablation", "needs 'of' (a line's name) and a positive 'published_gain'")
        return {
            "published": Published(float(value), pub["unit"], pub["source"], pub["where"]),
            "in_sample": self.get("in_sample", bool, False), "ablation_of": of,
            "published_gain": float(gain) if gain is not None else None, "notes": self.get("notes", str, ""),
        }  # fmt: skip

"""`amoe bench frontier --breakdown [--trace FILE]`: the model's decode layer against the published per-kernel
breakdowns, per component (docs/cost-model.md "Calibration").

Three things side by side, per layer of one decode step (both micro-batches, ms):

* **published**: the decode time breakdown SGLang's blog (LMSYS, 2025-05-05, "Profile Results") measured on
  DeepSeek's own profile (github.com/deepseek-ai/profile-data decode.json: EP128, 128 requests a GPU, 4K context,
  two micro-batches, balanced routing) and on SGLang's 96-H100 deployment, read off its figure (PUBLISHED below).
  DeepSeek's bars are the calibration's source (in-sample); SGLang's stay out of it and serve only to explain a
  prediction's miss afterwards;
* **the model**: the same categories from the cost model (cost_model.attention_parts, ep_scale.slowest_device,
  bound_ep.ep_micro_batch: the exchange kernels' waits on the stream included) for the workload each system ran, and
  for the ones `amoe bench frontier` predicted before the calibration (its step reproduces bounds.predict's exactly:
  tests/test_frontier_trace.py);
* **a trace** (`--trace FILE`, optional): a Chrome trace as the PyTorch profiler writes it, its GPU kernels summed
  by category (KERNEL_CATEGORIES) per MoE block. Nothing is downloaded: decode.json is not in this repository.

Nothing here changes or fits the model.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_scale as scale
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.links import all_to_all_time
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.plan.bound_ep import ep_micro_batch, ep_placements
from amoe.perf.plan.deployment import Deployment
from amoe.perf.studies.chrome_trace import CATEGORIES, read_trace, trace_breakdown
from amoe.perf.studies.frontier import ROUTING

# SGLang's blog figure "Decode Time Breakdown" (lmsys.org/blog/2025-05-05-large-scale-ep, image
# public/images/blog/large_scale_ep/profile-decode.png of lm-sys/lm-sys.github.io; read from the copy in
# ch-wan/lm-sys.github.io at 01f4540779dff34abe540d735eba43e014fb16a6, git blob 34607b9a394a99b747f81c407199e3827fa52f6d,
# sha256 2b64a475a4e451d0f0d23fae5a99de58bd70684fdd0cdbfb5dbd03aca0a888ab): "Scaled Mean Time (ms) per Layer", bar ends
# read in pixels against the 0.2 ms gridlines (483 px per ms: ±0.003 ms). Each system's categories add up to its
# "Overall" bar (1.421 vs 1.422, 1.487 vs 1.488): the compute stream is never idle, so a layer is the sum of its
# kernels, the communication kernels' time on the stream included.
PUBLISHED = {
    "deepseek-profile": {
        "overall": 1.422, "dispatch": 0.174, "combine": 0.075, "moe": 0.244, "attention_core": 0.503,
        "gemm": 0.292, "other": 0.085, "launch": 0.048,
    },
    "sglang-96xh100": {
        "overall": 1.488, "dispatch": 0.170, "combine": 0.176, "moe": 0.302, "attention_core": 0.360,
        "gemm": 0.288, "other": 0.137, "launch": 0.054,
    },
    # DeepEP's low-latency kernels alone (the figure's "Unit Test" bars): what the two exchanges cost on the stream
    # when nothing else waits on them.
    "unit-test": {"dispatch": 0.062, "combine": 0.079, "moe": 0.195},
}  # fmt: skip

# SGLang's "TBO Ablation (Decode)" figure in the same post (tbo-breakdown-decode.png, git blob
# 9ce630377c4a0c20615d0609406c8e1ff832031d, sha256 1106506a7d9b2a27272043e91163ba14fea5364b0f0c7ecd5cba3bd3576afe08;
# 340.5 px per ms, ±0.003): its 96-H100 decode at 256 tokens a GPU with and without two-batch overlap, ms per layer.
# Without TBO the whole exchange is on the stream; with it, what the overlap leaves there.
PUBLISHED_TBO_ABLATION = {
    "tbo": {"overall": 1.495, "dispatch": 0.179, "combine": 0.197},
    "no_tbo": {"overall": 1.932, "dispatch": 0.399, "combine": 0.711},
}

# How SGLang's table turns DeepSeek's profile into 18,598 tokens/s per node: 128 requests a GPU, each verifying one
# MTP draft token at an assumed 60 % acceptance ("we conservatively assume a 60% acceptance rate under MTP"), over
# a step of 62 layers (61 + the MTP module) at the Overall bar: 8 · 128 · 1.6 / (62 · 1.422 ms) = 18,583 (0.1 % off).
PROFILE_MTP_ACCEPTED = 0.6
PROFILE_LAYERS = 62
MODEL_LAYERS = 61  # the model's 58 blocks carry the 61 layers' attention (profiles._deepseek_v3)

# Day 6's own statistics (github.com/deepseek-ai/open-infra-index, 202502OpenSourceWeek/day_6_..._overview.md):
# ~14.8k output tokens/s per H800 node at an "average output speed" of 20-22 tokens/s a request, i.e. 14,800 / 8 /
# 21 = 88 (84-93) requests decoding per GPU on the day's average, not the 128 of the prediction (a batch Day 6 does
# not state; SGLang's table lists it).
DAY6_PER_NODE, DAY6_REQUEST_SPEED = 14800.0, 21.0

# DeepGEMM's README (github.com/deepseek-ai/DeepGEMM, 2025; H800, FP8, TFLOPS per shape) at DeepSeek-V3's decode
# shapes with M = 128 rows, one micro-batch of the profile: (N, K, TFLOPS) of the normal GEMMs (q_a + kv_a, q_b,
# kv_b, o_proj, shared expert gate_up and down) and of the masked grouped GEMMs with 2 groups of 512 rows (EP128's
# 2 experts a GPU under balanced routing: 128 rows x 8 x 128 GPUs / 256 experts).
DEEPGEMM_M128 = ((2112, 7168, 352), (24576, 1536, 535), (32768, 512, 358), (7168, 16384, 645))
DEEPGEMM_SHARED_M128 = ((4096, 7168, 533), (7168, 2048, 510))
DEEPGEMM_MASKED_2X512 = ((4096, 7168, 1040), (7168, 2048, 916))


@dataclass(frozen=True)
class TraceWorkload:
    """What one GPU runs per decode step: `requests` in flight, `queries` rows each (2 with one MTP draft)."""

    name: str
    gpu: str
    devices: int
    requests: int
    queries: int
    kv_length: int
    redundant_experts: int
    routing: str  # "uniform": DeepSeek's profile ("we simulate an absolutely balanced MoE routing")

    @property
    def rows(self) -> int:
        return self.requests * self.queries


def workloads() -> dict[str, TraceWorkload]:
    """The workloads `amoe bench frontier` predicted before the kernel calibration (the built-in deployments file's
    decode lines at one row a request) and the ones the published systems ran."""
    out = {
        "deepseek-day6 (as predicted)": TraceWorkload(
            "deepseek-day6", "h800", 144, 128, 1, 4989, 32, ROUTING
        ),
        "deepseek-profile (as predicted)": TraceWorkload(
            "deepseek-profile", "h800", 128, 128, 1, 4096, 0, ROUTING
        ),
        "sglang-96xh100 (as predicted)": TraceWorkload(
            "sglang-96xh100", "h100", 72, 256, 1, 2000, 32, ROUTING
        ),
    }
    # The profile as DeepSeek ran it: 2 routed experts a GPU (EP128, no redundancy), balanced routing, 2 rows per
    # request (one MTP draft: what SGLang's 18,598 credits, PROFILE_MTP_ACCEPTED, and what its MLA core time fits).
    out["deepseek-profile (as run: MTP)"] = TraceWorkload(
        "deepseek-profile", "h800", 128, 128, 2, 4096, 0, "uniform"
    )
    load = round(DAY6_PER_NODE / 8 / DAY6_REQUEST_SPEED)
    out["deepseek-day6 (at the day's mean load)"] = TraceWorkload(
        "deepseek-day6", "h800", 144, load, 1, 4989, 32, ROUTING
    )
    return out


@functools.lru_cache(maxsize=4)
def inclusion(routing: str) -> np.ndarray:
    """routing.routing_inclusion for DeepSeek-V3, seed 0 (as `amoe bench frontier`), once per routing: sampling
    256 experts' inclusion is most of a breakdown's time."""
    return routing_inclusion(model_profile("deepseek-v3"), routing, 0)


def model_breakdown(w: TraceWorkload) -> dict:
    """The model's decode step for `w`, per category: ms per layer (both micro-batches, the step's total over the
    61 layers), the exchange's wire time, the block (max of the two streams) and the step."""
    model, gpu, host = model_profile("deepseek-v3"), gpu_profile(w.gpu), host_overhead("none")
    dep = Deployment(
        "ep", w.gpu, w.devices, attn_cap=w.rows, gpus_per_node=8, redundant_experts=w.redundant_experts,
        two_batch_overlap=True,
    )  # fmt: skip
    q = inclusion(w.routing)
    mb_requests, rows = w.requests // 2, w.rows / 2  # one micro-batch
    parts = cm.attention_parts(
        model, gpu, np.full(mb_requests, w.queries), np.full(mb_requests, w.kv_length), host
    )
    mb = ep_micro_batch(model, gpu, rows, w.kv_length, dep, host, w.queries)
    attn_s, dispatch, combine = mb.stage_in + mb.stage_out, mb.dispatch, mb.combine
    experts, blocks = [], []
    for blk, placement in enumerate(ep_placements(model, dep, q)):
        slowest, _ = scale.slowest_device(
            model, gpu, scale.device_rows(placement, w.devices * rows * q[blk]), host
        )
        experts.append(slowest)
        blocks.append(scale.block_time(replace(mb, experts=slowest), True))
    expert_launch = cm.EXPERT_KERNELS * gpu.launch_s
    per_block = {
        "gemm": parts["gemm_in"] + parts["gemm_out"], "attention_core": parts["core"],
        "other": parts["elementwise"], "launch": parts["launches"] + expert_launch,
        "moe": float(np.mean(experts)) - expert_launch,
        # on the compute stream: the receive kernels' wait for the wire beyond the stage they hide behind
        "dispatch": max(0.0, dispatch - mb.stage_in), "combine": max(0.0, combine - mb.stage_out),
    }  # fmt: skip
    to_layer = 2 * model.num_blocks / MODEL_LAYERS * 1e3  # both micro-batches, over the 61 layers, in ms
    head = cm.head_time(model, gpu, w.rows, host=host)
    step = head + sum(blocks)
    compute = 2 * (attn_s + float(np.mean(experts)))
    return {
        "workload": w.name,
        "rows_per_gpu": w.rows,
        "layer_ms": {k: per_block[k] * to_layer for k in CATEGORIES},
        "compute_ms": compute * model.num_blocks / MODEL_LAYERS * 1e3,
        "wire_ms": {"dispatch": dispatch * to_layer, "combine": combine * to_layer},
        "exchange_ms": 2 * (dispatch + combine) * model.num_blocks / MODEL_LAYERS * 1e3,
        # The whole batch's exchange in one go (no overlap): what SGLang's TBO ablation exposes.
        "exchange_no_tbo_ms": (
            all_to_all_time(model, gpu, 2 * rows, w.devices, 8, "dispatch")
            + all_to_all_time(model, gpu, 2 * rows, w.devices, 8, "combine")
        ) * model.num_blocks / MODEL_LAYERS * 1e3,
        "block_us": {"attention": attn_s * 1e6, "mla_core": parts["core"] * 1e6,
                     "experts": float(np.mean(experts)) * 1e6, "dispatch": dispatch * 1e6, "combine": combine * 1e6,
                     "block": float(np.mean(blocks)) * 1e6},
        "bound": "exchange" if per_block["dispatch"] + per_block["combine"] > 0 else "compute",
        "step_ms": step * 1e3,
        # With an MTP draft, SGLang's credit for DeepSeek's profile: 1.6 tokens a request a step.
        "tokens_per_s_per_node": 8 * w.requests * (1 + PROFILE_MTP_ACCEPTED * (w.queries - 1)) / step,
    }  # fmt: skip


def kernel_benchmarks() -> dict:
    """The profile's GEMM and expert categories had each kernel run at its own published micro-benchmark speed
    (DeepGEMM), and the exchange kernels' stream time of DeepEP's unit test: ms per layer as `model_breakdown`
    counts them (both micro-batches, 58 MoE blocks over 61 layers)."""
    moe_share = 58 / MODEL_LAYERS
    attn = sum(2 * 128 * n * k / (tf * 1e12) for n, k, tf in DEEPGEMM_M128)
    shared = sum(2 * 128 * n * k / (tf * 1e12) for n, k, tf in DEEPGEMM_SHARED_M128)
    moe = sum(2 * 2 * 512 * n * k / (tf * 1e12) for n, k, tf in DEEPGEMM_MASKED_2X512)
    return {
        "gemm": 2 * (attn + shared * moe_share) * 1e3, "moe": 2 * moe * moe_share * 1e3,
        "dispatch": PUBLISHED["unit-test"]["dispatch"], "combine": PUBLISHED["unit-test"]["combine"],
    }  # fmt: skip


def sglang_decomposition(model: dict) -> dict:
    """SGLang ran the workload `amoe bench frontier` priced (no MTP, 256 requests, 2,000 tokens): its ratio is the
    per-layer factor alone (its step is 22,282 tokens/s per node at 256 requests a GPU: 61.8 layers at 1.488 ms)."""
    published_step = 8 * 256 / 22282.0 * 1e3
    return {"published_step_ms": published_step, "model_step_ms": model["step_ms"],
            "layers_at_overall": published_step / PUBLISHED["sglang-96xh100"]["overall"],
            "ratio": published_step / model["step_ms"]}  # fmt: skip


def tbo_hiding(sgl: dict) -> dict:
    """How much of the exchange two-batch overlap leaves on the compute stream at SGLang (its ablation) and in the
    model (the receive kernels' waits where the wire outlasts the stage it hides behind)."""
    no, on = PUBLISHED_TBO_ABLATION["no_tbo"], PUBLISHED_TBO_ABLATION["tbo"]
    exposed, left = no["dispatch"] + no["combine"], on["dispatch"] + on["combine"]
    model_left = sgl["layer_ms"]["dispatch"] + sgl["layer_ms"]["combine"]
    return {"published_exchange_no_tbo_ms": exposed, "model_exchange_no_tbo_ms": sgl["exchange_no_tbo_ms"],
            "published_left_on_stream_ms": left, "published_hidden": 1 - left / exposed,
            "model_left_on_stream_ms": model_left, "model_hidden": 1 - model_left / sgl["exchange_ms"],
            "published_tbo_gain": no["overall"] / on["overall"]}  # fmt: skip


def day6_decomposition(as_predicted: dict, at_load: dict) -> dict:
    """Day 6's ratio at 128 requests a GPU as the day's mean load (the model at 88 instead) times what remains."""
    ratio = as_predicted["tokens_per_s_per_node"] / DAY6_PER_NODE
    load = as_predicted["tokens_per_s_per_node"] / at_load["tokens_per_s_per_node"]
    return {"requests_per_gpu": DAY6_PER_NODE / 8 / DAY6_REQUEST_SPEED, "ratio": ratio, "load_factor": load,
            "remaining": ratio / load}  # fmt: skip


def profile_decomposition(as_predicted: dict, as_run: dict) -> dict:
    """The profile's ratio at one row a request, as a product of two factors: the workload (the prediction
    priced 128 single-row requests; DeepSeek ran 128 requests of 2 rows and SGLang credits 1.6 tokens) and the
    model's step against the profile's at the workload DeepSeek ran."""
    published_step = PROFILE_LAYERS * PUBLISHED["deepseek-profile"]["overall"]  # ms
    published = 8 * 128 * (1 + PROFILE_MTP_ACCEPTED) / published_step * 1e3
    model_step = as_run["step_ms"] * PROFILE_LAYERS / MODEL_LAYERS  # + the MTP module's layer
    workload = model_step / ((1 + PROFILE_MTP_ACCEPTED) * as_predicted["step_ms"])
    per_layer = published_step / model_step
    return {
        "published_step_ms": published_step, "published_per_node": published,
        "model_step_as_run_ms": model_step, "workload_factor": workload, "per_layer_factor": per_layer,
        "ratio": workload * per_layer,
    }  # fmt: skip


# ---- the report


def _row(label: str, values: list) -> str:
    cells = "".join(f"{v:>10.3f}" if isinstance(v, float) else f"{v:>10}" for v in values)
    return f"{label:<15}{cells}"


def report(model: dict) -> dict:
    """The numbers the docs quote, from `model` (model_breakdown of every workload)."""
    pub, bench = PUBLISHED, kernel_benchmarks()
    run, sgl = model["deepseek-profile (as run: MTP)"], model["sglang-96xh100 (as predicted)"]
    rows = {}
    for cat in CATEGORIES:
        rows[cat] = [pub["deepseek-profile"][cat], run["layer_ms"][cat], bench.get(cat, ""),
                     pub["sglang-96xh100"][cat], sgl["layer_ms"][cat]]  # fmt: skip
    stream = sum(pub["deepseek-profile"][c] for c in CATEGORIES)
    # The model's stream is never idle: its layer is the sum of its categories (its waits included).
    run_s, sgl_s = (sum(m["layer_ms"][c] for c in CATEGORIES) for m in (run, sgl))
    # The model at the profile's workload with its GEMMs at DeepGEMM's micro-benchmark speeds and DeepEP's unit-test
    # stream time: what the calibration's serving slowdowns and waits add to the kernels' own tables.
    benched = sum(bench.get(c, run["layer_ms"][c]) for c in CATEGORIES)
    rows["compute stream"] = [
        stream,
        run_s,
        benched,
        sum(pub["sglang-96xh100"][c] for c in CATEGORIES),
        sgl_s,
    ]
    rows["exchange wire"] = ["hidden", run["exchange_ms"], run["exchange_ms"], "hidden", sgl["exchange_ms"]]
    rows["layer"] = [
        pub["deepseek-profile"]["overall"],
        run_s,
        benched,
        pub["sglang-96xh100"]["overall"],
        sgl_s,
    ]
    return {
        "per_layer_ms": rows,
        "profile": profile_decomposition(model["deepseek-profile (as predicted)"], run),
        "sglang": sglang_decomposition(sgl),
        "tbo": tbo_hiding(sgl),
        "day6": day6_decomposition(model["deepseek-day6 (as predicted)"], model["deepseek-day6 (at the day's mean load)"]),
    }  # fmt: skip


def main(args) -> int:
    trace = (
        read_trace(args.trace) if getattr(args, "trace", None) else None
    )  # a bad file fails before the model
    model = {name: model_breakdown(w) for name, w in workloads().items()}
    rep = report(model)
    print_report(model, rep)
    result = {
        "published": PUBLISHED,
        "published_tbo_ablation": PUBLISHED_TBO_ABLATION,
        "kernel_benchmarks": kernel_benchmarks(),
        "model": model,
        "report": rep,
    }
    if trace is not None:
        result["trace"] = trace_breakdown(trace)
        print_trace(args.trace, result["trace"], model)
    if getattr(args, "out", None):
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "breakdown.json").write_text(json.dumps(result, indent=1))
    summary = {
        part: {k: round(v, 4) for k, v in rep[part].items()} for part in ("profile", "sglang", "day6", "tbo")
    }
    print(json.dumps({"frontier_breakdown": summary}))
    return 0


def print_report(model: dict, rep: dict) -> None:
    """The per-layer table, the model's block of each deployment, and the report against the published figures."""
    print(
        "ms per decode layer, both micro-batches (published: SGLang's figure; model: the step's total over 61 layers)"
    )
    print(_row("", ["DeepSeek", "model", "kernel", "SGLang", "model"]))
    print(_row("", ["profile", "@profile", "benchmks", "96xH100", "@SGLang"]))
    for label, values in rep["per_layer_ms"].items():
        print(_row(label, values))
    print()
    print(
        "the model's block, µs (one micro-batch's terms; block = 2 (max(stage in, dispatch) + experts + max(stage out, combine)))"
    )
    for name, r in model.items():
        b = r["block_us"]
        print(f"  {name:<39} {r['rows_per_gpu']:>3} rows/GPU: attention {b['attention']:.0f} (MLA core "
              f"{b['mla_core']:.0f}), experts {b['experts']:.0f}, dispatch {b['dispatch']:.0f}, combine "
              f"{b['combine']:.0f} -> {b['block']:.0f}, {r['bound']}-bound; step {r['step_ms']:.1f} ms, "
              f"{r['tokens_per_s_per_node']:.0f} tok/s/node")  # fmt: skip
    p, s, d = rep["profile"], rep["sglang"], rep["day6"]
    print()
    print(f"profile (in-sample): published step {p['published_step_ms']:.1f} ms ({p['published_per_node']:.0f} tok/s/node "
          f"at {1 + PROFILE_MTP_ACCEPTED:.1f} tokens a request-step), the model at that workload "
          f"{p['model_step_as_run_ms']:.1f} ms: workload {p['workload_factor']:.3f} x per layer "
          f"{p['per_layer_factor']:.3f} = {p['ratio']:.3f}")  # fmt: skip
    print(f"SGLang decode: published step {s['published_step_ms']:.1f} ms ({s['layers_at_overall']:.1f} layers at its "
          f"Overall bar), the model {s['model_step_ms']:.1f} ms: per layer {s['ratio']:.3f}")  # fmt: skip
    o = rep["tbo"]
    print(f"SGLang's TBO ablation: the exchange without TBO {o['published_exchange_no_tbo_ms']:.3f} ms a layer (the "
          f"model's wire: {o['model_exchange_no_tbo_ms']:.3f}); with TBO {o['published_left_on_stream_ms']:.3f} stays "
          f"on the stream, {o['published_hidden']:.0%} hidden (the model: {o['model_left_on_stream_ms']:.3f}, "
          f"{o['model_hidden']:.0%}); the published gain {o['published_tbo_gain']:.2f}x a layer")  # fmt: skip
    print(f"Day 6: {d['requests_per_gpu']:.0f} requests a GPU on the day's mean: load {d['load_factor']:.3f} x "
          f"remaining {d['remaining']:.3f} = {d['ratio']:.3f}")  # fmt: skip


def print_trace(path: str, t: dict, model: dict) -> None:
    """A trace's kernels per MoE block by category, beside the model's at the profile's workload."""
    print()
    print(f"trace {path}: device {t['device']}, {t['kernels']} kernels, {t['blocks']:g} MoE blocks, wall "
          f"{t['wall_us'] / 1e3:.1f} ms. µs per MoE block (both micro-batches), beside the model at the "
          "profile's workload:")  # fmt: skip
    for cat in CATEGORIES:
        print(f"  {cat:<16}{t['per_block_us'][cat]:>10.1f}{run_block_us(model, cat):>10.1f}")
    print(f"  {'idle (gaps)':<16}{t['idle_per_block_us']:>10.1f}")
    for cat, names in t["top_kernels"].items():
        if names:
            print(f"  {cat}: {'; '.join(n[:60] for n in names)}")


def run_block_us(model: dict, cat: str) -> float:
    """The model's µs per MoE block (both micro-batches) of `cat` at the profile's workload."""
    return model["deepseek-profile (as run: MTP)"]["layer_ms"][cat] * 1e3 * MODEL_LAYERS / 58

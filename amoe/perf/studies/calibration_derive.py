"""How each derived constant of a calibration follows from the measurements its file quotes (`sources`), and the
in-sample check of the model against DeepSeek's profile with them: `amoe bench calibration [--name NAME]`.

Hopper's constants, in order (each step uses only the ones before it):

1. the GEMM curve (compute fraction, half rows, memory fraction, fixed cost per kernel): least squares on the log
   of the kernel time over every row of DeepGEMM's three tables (normal, grouped contiguous, grouped masked; H800);
2. attention's decode core: FlashMLA's compute- and memory-bound figures over the H800's datasheet peaks;
3. the launch gap per kernel: the decode profile's launch bar over the kernels the model counts a layer;
4. decode's dense and grouped GEMM slowdowns: the profile's GEMM and MoE bars over the model's kernels (curve
   only) at the profile's workload;
5. prefill's attention fraction and GEMM slowdowns: the prefill profile's bars over the model's kernels at its
   workload, compute on the SMs its schedule leaves them (108 of 132);
6. the elementwise passes per token: both profiles' "other" bars less the model's SiLU·mul and head merge, over
   the time one pass of hidden rows takes, summed over the two;
7. prefill's exchange slowdown (its dispatch and combine cores over DeepEP's normal-kernel unit-test time) and
   compute-stream bubble (over the stream's busy time);
8. the low-latency kernels' fixed cost: their table's latency less its bytes over its bandwidth, averaged.

The derivation runs the cost model's own functions, so it is exact for the code it ships with; a change there that
moves a derived value needs a new dated calibration (tests/test_calibration.py re-derives the active one).
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from amoe.perf.model import calibrations
from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_prefill as pf
from amoe.perf.model.calibrations import Calibration, KernelConstants
from amoe.perf.model.gpus import SHEETS, GpuProfile, _gpu
from amoe.perf.model.links import normal_exchange_time
from amoe.perf.model.models import ModelProfile, model_profile

# ---- 1. the GEMM curve


def gemm_rows(src: dict) -> list[tuple[int, int, int, int, float]]:
    """(groups, rows per group, N, K, measured seconds) of every row of DeepGEMM's tables."""
    out = [(1, m, n, k, 2 * m * n * k / (tf * 1e12)) for m, n, k, tf in src["normal"]]
    for g, m, n, k, tf in src["grouped_contiguous"] + src["grouped_masked"]:
        out.append((g, m, n, k, 2 * g * m * n * k / (tf * 1e12)))
    return out


def curve_time(p: np.ndarray, rows: list, peak: float, hbm: float) -> np.ndarray:
    """The curve's time of each row: fixed + max(FLOPs / (peak · c · m / (m + h)), bytes / (hbm · e)), FP8 operands
    (a byte each), BF16 output."""
    fixed, mem, comp, half = p
    out = []
    for g, m, n, k, _ in rows:
        flops, num_bytes = 2 * g * m * n * k, g * (n * k + m * k + 2 * m * n)
        out.append(fixed + max(flops / (peak * comp * m / (m + half)), num_bytes / (hbm * mem)))
    return np.array(out)


def fit_gemm_curve(src: dict, sheet: dict) -> dict[str, float]:
    """Levenberg-Marquardt on the log times (numpy only), from a start the fit does not depend on."""
    rows = gemm_rows(src)
    peak, hbm = sheet["fp8_tflops"] * 1e12, sheet["hbm_gbps"] * 1e9
    measured = np.log([r[-1] for r in rows])
    scale = np.array([1e-6, 1.0, 1.0, 100.0])
    p, lam = np.array([1.0, 0.8, 0.7, 1.0]), 1e-2  # in units of `scale`

    def resid(x: np.ndarray) -> np.ndarray:
        return np.log(curve_time(x * scale, rows, peak, hbm)) - measured

    for _ in range(400):
        r = resid(p)
        jac = np.stack([(resid(p + d) - r) / 1e-7 for d in np.eye(4) * 1e-7], axis=1)
        step = np.linalg.solve(jac.T @ jac + lam * np.diag(np.diag(jac.T @ jac)), -jac.T @ r)
        trial = np.maximum(p + step, 1e-9)
        if (resid(trial) ** 2).sum() < (r**2).sum():
            p, lam = trial, lam / 3
        else:
            lam *= 4
    fixed, mem, comp, half = p * scale
    rms = float(np.sqrt((resid(p) ** 2).mean()))
    return {
        "gemm_fixed_s": fixed,
        "memory_fraction": mem,
        "compute_fraction": comp,
        "half_rows": half,
        "rms": rms,
    }


# ---- evaluating the model at a profile's workload


def hopper_gpu(k: KernelConstants, cal: Calibration) -> GpuProfile:
    """The H800 priced with constants `k` (the derivation's partial constants)."""
    return _gpu("h800", SHEETS["h800"], replace(cal, kernels=(("hopper", k),)))


def decode_categories(model: ModelProfile, gpu: GpuProfile, w: dict, ex) -> dict[str, float]:
    """The model's decode step at workload `w` per profile category, ms per layer (both micro-batches; the blocks'
    time over the layers, the head's once a step). `ex`: the TBO exchange wire times (dispatch, combine), seconds."""
    per_mb = w["requests_per_gpu"] // w["micro_batches"]
    parts = cm.attention_parts(model, gpu, np.full(per_mb, w["queries"]), np.full(per_mb, w["kv"]))
    rows = per_mb * w["queries"] * w["ep"] * model.top_k / model.num_experts  # per expert, balanced
    local = model.num_experts // w["ep"]
    phases = np.asarray(cm._swiglu_phases(model, gpu, round(rows), model.expert_intermediate)) * local
    act = phases[1][1] / gpu.usable_bandwidth
    moe = (
        float(
            cm.swiglu_gemms_time(
                gpu, model.expert_precision, phases, rows, True, gpu.kernels.decode_grouped_slowdown
            )
        )
        - act
    )
    head_rows = w["requests_per_gpu"] * w["queries"]
    lm_head = cm.gemm_time(gpu, head_rows, 2 * head_rows * model.hidden_size * model.vocab_size,
                           model.hidden_size * model.vocab_size * model.head_bytes, "bf16",
                           gpu.kernels.decode_dense_slowdown)  # fmt: skip
    merge = (model.experts_per_token + 2) * head_rows * model.hidden_size * 2 / gpu.usable_bandwidth
    stage_in = parts["gemm_in"] + (parts["elementwise"] + parts["launches"]) / 2
    stage_out = parts["core"] + parts["gemm_out"] + (parts["elementwise"] + parts["launches"]) / 2
    b, mbs, layers = model.num_blocks, w["micro_batches"], model.layers
    launches = parts["launches"] + cm.EXPERT_KERNELS * gpu.launch_s
    per_block = {
        "gemm": mbs * (parts["gemm_in"] + parts["gemm_out"]), "moe": mbs * moe, "attention_core": mbs * parts["core"],
        "other": mbs * (parts["elementwise"] + act), "launch": mbs * launches,
        "dispatch": mbs * max(0.0, ex[0] - stage_in), "combine": mbs * max(0.0, ex[1] - stage_out),
    }  # fmt: skip
    out = {k: v * b / layers * 1e3 for k, v in per_block.items()}
    out["gemm"] += lm_head / layers * 1e3
    out["other"] += merge / layers * 1e3
    out["overall"] = sum(out.values())
    return out


def prefill_categories(model: ModelProfile, gpu: GpuProfile, w: dict) -> dict[str, float]:
    """The model's prefill step at workload `w` (balanced routing, no redundant experts) per profile category, ms
    per layer (both micro-batches), with its schedule's SM share."""
    share = pf.sm_share(gpu, True)
    tokens = w["tokens_per_gpu"] / w["micro_batches"]
    attn = pf.attention_compute(model, gpu, tokens, w["prompt"], share)
    rows = tokens * w["ep"] * model.top_k / model.num_experts
    local = model.num_experts // w["ep"]
    gemms, act = pf.experts_compute(model, gpu, [rows] * local, list(range(local)), share)
    scale = w["micro_batches"] * model.num_blocks / model.layers * 1e3
    return {"moe": gemms * scale, "attention_core": attn["core"] * scale, "gemm": attn["gemm"] * scale,
            "other": (attn["elementwise"] + act) * scale}  # fmt: skip


def decode_exchange(model: ModelProfile, gpu: GpuProfile, w: dict) -> tuple[float, float]:
    from amoe.perf.model.links import all_to_all_time

    rows = w["requests_per_gpu"] * w["queries"] / w["micro_batches"]
    return tuple(all_to_all_time(model, gpu, rows, w["ep"], 8, kind) for kind in ("dispatch", "combine"))


# ---- the derivation, step by step


def base_hopper(fit: dict, flashmla: dict, sheet: dict) -> KernelConstants:
    """Hopper's constants from steps 1-2, every measured-in-serving one neutral (slowdowns 1, no passes)."""
    return KernelConstants(
        compute_fraction=fit["compute_fraction"], half_rows=fit["half_rows"],
        memory_fraction=fit["memory_fraction"], gemm_fixed_s=fit["gemm_fixed_s"], launch_s=0.0,
        decode_dense_slowdown=1.0, decode_grouped_slowdown=1.0, prefill_dense_slowdown=1.0,
        prefill_grouped_slowdown=1.0,
        attention_decode_compute_fraction=flashmla["compute_tflops"] / sheet["bf16_tflops"],
        attention_decode_memory_fraction=flashmla["memory_gbps"] / sheet["hbm_gbps"],
        attention_prefill_compute_fraction=1.0, elementwise_passes=0.0, elementwise_passes_per_expert=0.0,
        prefill_comm_sms=0, prefill_comm_slowdown=1.0, prefill_stream_bubble=0.0,
    )  # fmt: skip


def derive_decode(k: KernelConstants, cal: Calibration, src: dict, model: ModelProfile) -> KernelConstants:
    """Steps 3-4: the launch gap and decode's GEMM slowdowns from the decode profile's bars."""
    prof, w = src["decode_profile"]["bars_ms"], src["decode_profile"]["workload"]
    kernels = (
        w["micro_batches"] * (cm.ATTENTION_KERNELS + cm.EXPERT_KERNELS) * model.num_blocks / model.layers
    )
    k = replace(k, launch_s=prof["launch"] * 1e-3 / kernels)
    gpu = hopper_gpu(k, cal)
    cats = decode_categories(model, gpu, w, (0.0, 0.0))
    return replace(k, decode_dense_slowdown=prof["gemm"] / cats["gemm"],
                   decode_grouped_slowdown=prof["moe"] / cats["moe"])  # fmt: skip


def derive_prefill(k: KernelConstants, cal: Calibration, src: dict, model: ModelProfile) -> KernelConstants:
    """Step 5: the prefill profile's attention fraction and GEMM slowdowns, on its schedule's SM share."""
    prof, w = src["prefill_profile"]["bars_ms"], src["prefill_profile"]["workload"]
    sched = src["prefill_profile"]["schedule"]
    k = replace(k, prefill_comm_sms=sched["communication_sms"], attention_prefill_compute_fraction=1.0)
    cats = prefill_categories(model, hopper_gpu(k, cal), w)
    return replace(
        k, attention_prefill_compute_fraction=cats["attention_core"] / prof["attention_core"],
        prefill_dense_slowdown=prof["gemm"] / cats["gemm"], prefill_grouped_slowdown=prof["moe"] / cats["moe"],
    )  # fmt: skip


def derive_passes(k: KernelConstants, cal: Calibration, src: dict, model: ModelProfile) -> KernelConstants:
    """Step 6: the elementwise passes per token, from both profiles' "other" bars together."""
    dec, pre = src["decode_profile"], src["prefill_profile"]
    without = (
        decode_categories(model, hopper_gpu(k, cal), dec["workload"], (0.0, 0.0))["other"]
        + prefill_categories(model, hopper_gpu(k, cal), pre["workload"])["other"]
    )
    one = replace(k, elementwise_passes=1.0)
    per_pass = (
        decode_categories(model, hopper_gpu(one, cal), dec["workload"], (0.0, 0.0))["other"]
        + prefill_categories(model, hopper_gpu(one, cal), pre["workload"])["other"]
        - without
    )
    measured = dec["bars_ms"]["other"] + pre["bars_ms"]["other"]
    return replace(k, elementwise_passes=(measured - without) / per_pass)


def derive_prefill_streams(
    k: KernelConstants, cal: Calibration, src: dict, model: ModelProfile
) -> KernelConstants:
    """Step 7: prefill's exchange slowdown and compute-stream bubble."""
    prof, w = src["prefill_profile"]["bars_ms"], src["prefill_profile"]["workload"]
    gpu = hopper_gpu(k, cal)
    tokens = w["tokens_per_gpu"] / w["micro_batches"]
    unit = sum(normal_exchange_time(model, gpu, tokens, w["ep"], 8, kind) for kind in ("dispatch", "combine"))
    measured = (prof["dispatch_core"] + prof["combine_core"]) * 1e-3 / w["micro_batches"] * model.layers
    busy = prof["moe"] + prof["attention_core"] + prof["gemm"] + prof["other"]
    return replace(
        k, prefill_comm_slowdown=measured / (unit * model.num_blocks),
        prefill_stream_bubble=prof["compute_stream_bubble"] / busy,
    )  # fmt: skip


def ll_fixed_s(src: dict) -> float:
    """Step 8: DeepEP's low-latency latencies less their bytes over their bandwidth (FP8 + scales out, BF16 back),
    averaged over both kernels and every EP size; never below 0."""
    tokens, hidden, top_k = src["ll_tokens"], src["hidden"], src["top_k"]
    left = []
    for _, d_us, d_gbps, c_us, c_gbps in src["ll"]:
        left.append(d_us * 1e-6 - tokens * top_k * hidden * (1 + 4 / 128) / (d_gbps * 1e9))
        left.append(c_us * 1e-6 - tokens * top_k * hidden * 2 / (c_gbps * 1e9))
    return max(0.0, float(np.mean(left)))


def derive(raw: dict) -> dict[str, float]:
    """Every derived Hopper constant and the exchange's fixed cost, from the file's sources (module docstring)."""
    src = raw["sources"]
    cal = calibrations.load(raw["name"]) if raw["name"] in calibrations.names() else None
    cal = cal or _placeholder(raw)
    model = model_profile("deepseek-v3")
    fit = fit_gemm_curve(src["deepgemm"], src["h800"])
    k = base_hopper(fit, src["flashmla"], src["h800"])
    for step in (derive_decode, derive_prefill, derive_passes, derive_prefill_streams):
        k = step(k, cal, src, model)
    out = {f: getattr(k, f) for f in KernelConstants.__dataclass_fields__}
    out["ll_fixed_s"] = ll_fixed_s(src["deepep"])
    out["gemm_fit_rms"] = fit["rms"]
    return out


def _placeholder(raw: dict) -> Calibration:
    """A Calibration from a file being written (its exchange constants as they stand), for the derivation."""
    from amoe.perf.model.calibrations import ExchangeConstants, _constants

    exchange = _constants(raw["name"], "exchange", raw["exchange"], ExchangeConstants)
    return Calibration(raw["name"], (), exchange)


# ---- the in-sample check and the command


def in_sample(name: str = calibrations.ACTIVE) -> dict:
    """The model with calibration `name` against the two DeepSeek profiles its constants came from: ms per layer
    per category, the model's beside the profile's (in-sample by construction except the overall and the waits)."""
    raw = calibrations.load_raw(name)
    cal, src = calibrations.load(name), raw["sources"]
    model = model_profile("deepseek-v3")
    gpu = hopper_gpu(cal.for_arch("hopper"), cal)
    dec = src["decode_profile"]
    decode = decode_categories(model, gpu, dec["workload"], decode_exchange(model, gpu, dec["workload"]))
    pre = src["prefill_profile"]
    prefill = prefill_categories(model, gpu, pre["workload"])
    return {
        "decode": {k: {"model": v, "profile": dec["bars_ms"].get(k)} for k, v in decode.items()},
        "prefill": {k: {"model": v, "profile": pre["bars_ms"].get(k)} for k, v in prefill.items()},
    }


def main(args) -> int:
    name = getattr(args, "name", None) or calibrations.ACTIVE
    raw = calibrations.load_raw(name)
    derived = derive(raw)
    stored = {**raw["architectures"]["hopper"]["constants"], **raw["exchange"]}
    print(f"calibration {name}: derived from its sources vs stored")
    worst = 0.0
    for key, value in derived.items():
        if key in stored:
            kept = float(stored[key]["value"])
            off = abs(value - kept) / max(abs(kept), 1e-30) if kept or value else 0.0
            worst = max(worst, off)
            print(f"  {key:<36} derived {value:<14.6g} stored {kept:<14.6g} {stored[key]['unit']}")
    check = in_sample(name)
    for phase, cats in check.items():
        print(f"{phase}, ms per layer: " + ", ".join(
            f"{k} {c['model']:.3f}" + (f"/{c['profile']:.3f}" if c["profile"] is not None else "")
            for k, c in cats.items()))  # fmt: skip
    print(json.dumps({"calibration": name, "max_relative_difference": worst, "in_sample": check}))
    return 0 if worst <= 1e-6 else 1

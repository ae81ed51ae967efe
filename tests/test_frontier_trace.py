"""`amoe bench frontier --breakdown [--trace FILE]` (amoe.perf.studies.frontier_trace, chrome_trace): the per-layer
breakdown is the model's own (its step equals bounds.predict's), the published figures add up, and a Chrome trace's
kernels are summed by category per MoE block."""

import argparse
import functools
import gzip
import json
import tempfile
from pathlib import Path

import golden
import pytest

from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.plan import bounds
from amoe.perf.plan.deployment import Deployment
from amoe.perf.studies import chrome_trace
from amoe.perf.studies import frontier_trace as ft

# One step of a toy decode trace on device 0: 2 MoE blocks x 2 micro-batches, µs. Device 1's kernels and the CPU
# ops must be ignored.
BLOCK = [
    ("flash_fwd_splitkv_mla_kernel", 100),
    ("flash_fwd_mla_combine_kernel", 10),  # FlashMLA's own combine: attention, not DeepEP's
    ("deep_gemm::fp8_gemm_kernel<GemmType::Normal>", 40),
    ("deep_ep::internode_ll::dispatch<7168>", 30),
    ("deep_gemm::fp8_gemm_kernel<GemmType::GroupedMasked>", 50),
    ("deep_ep::internode_ll::combine<7168>", 20),
    ("flashinfer::norm::FusedAddRMSNormKernel", 5),  # "flash", yet not attention
]


def toy_trace() -> dict:
    events, ts = [], 1000.0
    for _ in range(2 * 2):
        for name, dur in BLOCK:
            events.append(
                {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur}
            )
            ts += dur + 1.0  # a 1 µs gap after every kernel
    events.append(
        {"ph": "X", "cat": "kernel", "name": "deep_ep::x::dispatch", "pid": 1, "tid": 7, "ts": 0, "dur": 9}
    )
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 0, "tid": 1, "ts": 0, "dur": 99999})
    return {"traceEvents": events}


_RUN_DIR: list[
    tempfile.TemporaryDirectory
] = []  # kept for the process: the run is shared by tests and golden


@functools.cache
def breakdown_run() -> tuple[Path, int]:
    """One `--breakdown --trace` run over the toy trace (gzipped): its out directory (breakdown.json) and exit code."""
    _RUN_DIR.append(tempfile.TemporaryDirectory(prefix="breakdown"))
    out = Path(_RUN_DIR[-1].name)
    path = out / "decode.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(toy_trace(), f)
    return out, ft.main(argparse.Namespace(trace=str(path), out=str(out)))


@pytest.fixture(scope="module")
def run():
    return breakdown_run()


@golden.case("frontier")
def decode_breakdown() -> golden.Figures:
    """The model's per-layer breakdown of each DeepSeek-V3 deployment of `amoe bench frontier --breakdown`, and its
    report against the published figures (breakdown.json's "model" and "report")."""
    out, _ = breakdown_run()
    result = json.loads((out / "breakdown.json").read_text())
    return {"model": result["model"], "report": result["report"]}


def test_trace_categories_per_block(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(toy_trace()))
    t = chrome_trace.trace_breakdown(chrome_trace.read_trace(path))
    assert (t["device"], t["kernels"], t["blocks"]) == ("0", 28, 2)
    per = t["per_block_us"]
    assert per == {
        "attention_core": 2 * 110, "gemm": 2 * 40, "moe": 2 * 50, "other": 2 * 5, "launch": 0.0,
        "dispatch": 2 * 30, "combine": 2 * 20,
    }  # fmt: skip
    busy = 4 * sum(d for _, d in BLOCK)
    assert t["wall_us"] == pytest.approx(busy + 27)  # 28 kernels, 27 gaps between them
    assert t["idle_per_block_us"] == pytest.approx(27 / 2)
    assert t["top_kernels"]["attention_core"] == [
        "flash_fwd_splitkv_mla_kernel",
        "flash_fwd_mla_combine_kernel",
    ]
    assert t["top_kernels"]["other"] == ["flashinfer::norm::FusedAddRMSNormKernel"]
    assert chrome_trace.trace_breakdown(chrome_trace.read_trace(path), device=1)["blocks"] == 0.5


def test_trace_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable Chrome trace"):
        chrome_trace.read_trace(bad)
    with pytest.raises(ValueError, match="no GPU kernel events"):
        chrome_trace.trace_breakdown([{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}])
    no_dispatch = [{"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 0, "ts": 0, "dur": 1}]
    with pytest.raises(ValueError, match="no dispatch kernel"):
        chrome_trace.trace_breakdown(no_dispatch)
    with pytest.raises(ValueError, match="device 3 not in the trace"):
        chrome_trace.trace_breakdown(no_dispatch, device=3)


def test_cli_bad_trace_is_one_line(tmp_path):
    from amoe.perf.studies.commands import run_frontier

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    args = argparse.Namespace(breakdown=True, trace=str(bad), out=str(tmp_path))
    with pytest.raises(
        SystemExit, match="amoe bench frontier: --trace .*bad.json: not a readable Chrome trace"
    ):
        run_frontier(args)


def test_published_figures_add_up():
    for system in ("deepseek-profile", "sglang-96xh100"):
        pub = ft.PUBLISHED[system]
        assert sum(pub[c] for c in ft.CATEGORIES) == pytest.approx(pub["overall"], abs=0.003)
    d = ft.profile_decomposition({"step_ms": 40.0}, {"step_ms": 69.0})
    assert d["published_per_node"] == pytest.approx(18598, rel=0.005)  # SGLang's derivation, reproduced
    assert 61 <= ft.sglang_decomposition({"step_ms": 66.0})["layers_at_overall"] <= 62.5


def test_attention_parts_are_the_cost_models():
    model, gpu = model_profile("deepseek-v3"), gpu_profile("h800")
    for requests, queries, ctx in ((64, 1, 4989), (64, 2, 4096)):
        parts = cm.attention_parts(model, gpu, [queries] * requests, [ctx] * requests)
        whole = cm.attention_layer_time(model, gpu, [queries] * requests, [ctx] * requests)
        assert set(parts) == set(cm.ATTENTION_PARTS)
        assert sum(parts.values()) == pytest.approx(whole, rel=1e-12)


def test_breakdown_step_is_the_bounds(run):
    out, rc = run
    assert rc == 0
    decode_breakdown.check()
    result = json.loads((out / "breakdown.json").read_text())
    model = model_profile("deepseek-v3")
    for name, w in ft.workloads().items():
        if not name.endswith("(as predicted)") or w.name == "deepseek-day6":
            continue  # the same code path as the profile's; one compute-bound and one exchange-bound case suffice
        dep = Deployment(
            "ep", w.gpu, w.devices, attn_cap=w.requests, gpus_per_node=8,
            redundant_experts=w.redundant_experts, two_batch_overlap=True,
        )  # fmt: skip
        q = ft.inclusion(w.routing)  # routing.routing_inclusion, cached: the sampling is the test's cost
        bound = bounds.predict(model, dep, q, w.kv_length, host_overhead("none"))
        got = result["model"][name]
        assert got["step_ms"] == pytest.approx(bound.itl_s * 1e3, rel=1e-9)
    rep = result["report"]
    assert rep["profile"]["ratio"] == pytest.approx(
        rep["profile"]["workload_factor"] * rep["profile"]["per_layer_factor"]
    )
    assert set(result["trace"]["per_block_us"]) == set(ft.CATEGORIES)
    # The exchange kernels hold the compute stream while the wire outlasts the stage they hide behind: at the
    # profile's workload the dispatch's wire (DeepEP's 192 µs at EP128) is longer than its stage.
    run_ = result["model"]["deepseek-profile (as run: MTP)"]
    assert run_["layer_ms"]["dispatch"] > 0 and run_["exchange_ms"] > 0


def test_cli_flags_parse():
    from amoe.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "frontier", "--breakdown", "--trace", "decode.json", "--out", "d"]
    )
    assert (args.breakdown, args.trace, args.out, args.table) == (True, "decode.json", "d", False)
    args = build_parser().parse_args(["bench", "frontier"])
    assert (args.breakdown, args.trace) == (False, None)

"""A planned deployment is the serving config: `to_config` and `from_config` round-trip every servable deployment,
`amoe plan --out` writes the best plan as a config file, and `amoe serve --config` of that file serves the plan
(end to end, on the emulated executor)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import replace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amoe.config import DEFAULT_POLICY, AmoeConfig
from amoe.errors import ConfigError
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.prediction import Prediction
from amoe.perf.plan.report import serve_command
from amoe.perf.plan.request import Plan, PlanRequest
from amoe.perf.plan.serving import from_config, plan_config, plan_file, to_config

GPUS = ("a100-40g", "a100-80g", "h100", "h200")
EMULATION = {"profile": "mixtral-8x7b-mqa", "routing": "skew-exp:0.08", "decode_only": True}


@st.composite
def deployments(draw) -> Deployment:
    """Any deployment the server can run: AEP, EP (with or without EPS-MoE's pipeline) or ping-pong, any copies."""
    mode = draw(st.sampled_from(("aep", "ep", "pingpong")))
    gpu = draw(st.sampled_from(GPUS))
    num_attn = draw(st.integers(1, 16))
    caps = {"attn_cap": draw(st.integers(1, 4096)), "expert_cap": draw(st.integers(1, 4096))}
    common = {"replicas": draw(st.integers(1, 4)), "gpus_per_node": draw(st.integers(1, 16)), **caps}
    if mode == "ep":
        pipelines = draw(st.integers(0, 8))
        kernel = draw(st.sampled_from(("", "grouped", "dense", "auto")))
        return Deployment("ep", gpu, num_attn, ep_pipelines=pipelines, ep_kernel=kernel, **common)
    num_expert = draw(st.integers(1, 16))
    placed = st.lists(st.integers(0, num_expert - 1), min_size=8, max_size=8).map(tuple)
    return Deployment(
        mode, gpu, num_attn, draw(st.sampled_from(GPUS)), num_expert,
        micro_batches=draw(st.integers(1, 4)) if mode == "pingpong" else 1,
        expert_map=draw(st.none() | placed), **common,
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(d=deployments(), seqs=st.none() | st.integers(1, 10_000), policy=st.sampled_from(("waves", "defrag")))
def test_an_emulated_config_round_trips_to_one_copy_of_its_deployment(d, seqs, policy):
    config = to_config(d, max_num_seqs=seqs, policy=policy, wave_group=2, emulation=EMULATION)
    assert from_config(config) == replace(d, replicas=1)
    assert (config.scheduler.policy, config.scheduler.wave_group) == (policy, 2)
    assert config.cache.max_num_seqs == (seqs or AmoeConfig().cache.max_num_seqs)
    assert config.executor.kind == "emulated" and config.emulation.profile == "mixtral-8x7b-mqa"
    # ... and so does the file that carries it
    assert AmoeConfig.from_dict(json.loads(json.dumps(config.changes()))) == config


@settings(max_examples=150, deadline=None)
@given(d=deployments())
def test_a_real_config_round_trips_all_but_the_gpu_names_a_server_does_not_know(d):
    """A torch server runs on the GPUs it has: the config names none, and the deployment read back has the
    emulation section's (defaults) where `d` had its types."""
    config = to_config(d)
    assert config.executor.kind == "torch" and config.emulation == AmoeConfig().emulation
    back = from_config(config)
    assert replace(
        back, attn_gpu=d.attn_gpu, expert_gpu=d.expert_gpu, gpus_per_node=d.gpus_per_node
    ) == replace(d, replicas=1)


def test_what_is_modelled_but_not_served_is_refused():
    with pytest.raises(ConfigError, match="modelled, not served"):
        to_config(Deployment("ep", "h800", 16, redundant_experts=32))
    with pytest.raises(ConfigError, match="no deployment of runtimes"):
        from_config(AmoeConfig().replace(parallel={"mode": "local"}))


def test_a_hand_written_config_reads_as_its_deployment():
    config = AmoeConfig.from_dict(
        {
            "parallel": {"mode": "ep", "attn_ranks": 4, "ep_pipelines": "auto", "ep_kernel": "dense"},
            "scheduler": {"attn_batch_cap": 128},
            "executor": {"kind": "emulated"},
            "emulation": {"gpu": "h100", "routing": "uniform"},
        }
    )
    d = from_config(config)
    assert d == Deployment("ep", "h100", 4, attn_cap=128, gpus_per_node=4, ep_pipelines=0, ep_kernel="dense")


def _plan(d: Deployment, concurrency: int = 1000, **extra) -> Plan:
    return Plan(d, Prediction(50_000.0, 0.02, concurrency, "attention", extra=extra), None)


def test_a_plans_config_holds_its_operating_point_policy_and_wave_group():
    req = PlanRequest("mixtral-8x7b-mqa", {"h100": 8}, top_k=1, routing="skew-exp:0.08")
    aep = _plan(Deployment("aep", "h100", 3, "h100", 5, 512, 1024, replicas=2), 1000, wave_group=3)
    config = plan_config(aep, req)
    assert config.cache.max_num_seqs == 167  # ceil(1000 requests / 2 copies / 3 attention ranks)
    assert (config.scheduler.policy, config.scheduler.wave_group) == (DEFAULT_POLICY, 3) == ("waves", 3)
    assert config.executor.kind == "torch" and config.model.path is None
    simulated_defrag = _plan(aep.deployment, 1000, aep_policy="defrag", wave_group=3)
    assert (
        plan_config(simulated_defrag, req).scheduler.policy,
        plan_config(simulated_defrag, req).scheduler.wave_group,
    ) == ("defrag", 0)
    emulated = plan_config(aep, req, emulated=True)
    assert emulated.executor.kind == "emulated" and emulated.emulation.decode_only
    assert (emulated.emulation.profile, emulated.emulation.routing, emulated.emulation.top_k) == (
        "mixtral-8x7b-mqa", "skew-exp:0.08", 1,
    )  # fmt: skip
    assert from_config(emulated) == replace(aep.deployment, replicas=1)
    from_checkpoint = plan_config(aep, replace(req, model_dir="/models/mixtral"), emulated=True)
    assert from_checkpoint.model.path == "/models/mixtral" and from_checkpoint.emulation.profile is None


def test_the_printed_command_is_the_config_for_people():
    """serve_command formats the plan's config as flags (nothing parses it back but this check of the printer)."""
    from amoe.cli import build_parser
    from amoe.config import config_from_args

    req = PlanRequest("mixtral-8x7b-mqa", {"h100": 8}, top_k=2)
    plan = _plan(
        Deployment("pingpong", "h100", 2, "a100-80g", 4, micro_batches=3, expert_map=(0, 1, 2, 3, 0, 1, 2, 3))
    )
    for emulated in (False, True):
        line = serve_command(plan, req, emulated=emulated)
        config = config_from_args(build_parser().parse_args(line.split()[1:]))
        want = plan_config(plan, req, emulated)
        assert config == (want if emulated else want.replace(model={"path": "MODEL_DIR"}))
        assert (
            "--parallel pingpong --attn-ranks 2 --expert-ranks 4" in line
        )  # the shape, even at its defaults


def test_the_plan_file_is_a_config_with_the_plans_record():
    req = PlanRequest("mixtral-8x7b-mqa", {"h100": 8}, top_k=1)
    plan = _plan(Deployment("aep", "h100", 6, "h100", 2, 512, 1024), 6000, wave_group=1)
    written = plan_file(plan, req, emulated=True)
    assert list(written)[0] == "plan" and "aep 6xh100 attn + 2xh100 experts" in written["plan"]["summary"]
    assert (
        written["plan"]["deployment"]["num_attn"] == 6
        and written["plan"]["prediction"]["concurrency"] == 6000
    )
    # the sections the plan decides are written whole: the file does not lean on today's defaults
    assert written["scheduler"]["policy"] == "waves" and written["scheduler"]["lookahead"] == 4
    assert AmoeConfig.from_dict(written) == plan_config(plan, req, emulated=True)
    assert "emulation" not in plan_file(plan, req)


@pytest.mark.timeout(300)
def test_amoe_plan_out_then_amoe_serve_config_serves_the_plan(tmp_path):
    """End to end on the emulated executor: `amoe plan --out plan.json --emulated` of a small case, then
    `amoe serve --config plan.json` (port 0 on the command line) serves requests with the plan's runtimes, policy
    and GPUs, and its log says which plan it serves."""
    out = tmp_path / "plan.json"
    plan = subprocess.run(
        [sys.executable, "-m", "amoe", "plan", "--model-profile", "mixtral-8x7b-mqa:2", "--gpus", "a100-80g:3",
         "--top-k", "1", "--modes", "aep", "--simulate-top", "0", "--simulate-per-mode", "0",
         "--out", str(out), "--emulated"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert f"amoe serve --config {out}" in plan.stdout
    written = json.loads(out.read_text())
    d = written["plan"]["deployment"]
    assert (d["mode"], d["attn_gpu"]) == ("aep", "a100-80g") and d["num_attn"] + d["num_expert"] <= 3
    assert written["executor"]["kind"] == "emulated" and written["scheduler"]["policy"] == "waves"
    # The command a user types (a flag still overlays the file), as a child process.
    cmd = [sys.executable, "-m", "amoe", "serve", "--config", str(out), "--port", "0", "--time-scale", "4"]
    server = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AMOE_LOG_LEVEL": "INFO"},
    )  # fmt: skip
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:
        for line in server.stderr:
            lines.append(line.rstrip("\n"))
            if re.search(r"amoe serve: listening on http://\S+$", line):
                listening.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert listening.wait(120) and server.poll() is None, "\n".join(lines)
        url = re.search(r"listening on (http://\S+)$", next(x for x in lines if "listening on" in x)).group(1)
        body = {"model": "mixtral-8x7b-mqa:2", "prompt": [11, 12, 13], "max_tokens": 4, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        health = httpx.get(f"{url}/health", timeout=10).json()
    finally:
        server.send_signal(2)
        try:
            server.wait(60)
        finally:
            if server.poll() is None:
                server.kill()
    assert server.returncode == 0, "\n".join(lines)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    runtimes = health["runtimes"]
    assert sum(r["role"] == "attention" for r in runtimes) == d["num_attn"]
    assert sum(r["role"] == "expert" for r in runtimes) == d["num_expert"]
    assert (health["mode"], health["executor"]["gpu"], health["executor"]["time_scale"]) == (
        "aep",
        "a100-80g",
        4.0,
    )
    log = "\n".join(lines)
    assert f"[config] planned by amoe plan: {written['plan']['summary']}" in log
    layout = f"{d['num_attn']} attention + {d['num_expert']} expert runtimes (aep, emulated a100-80g"
    assert layout in log and "waves scheduler" in log


def test_plan_file_mistakes_are_one_line(tmp_path, capsys, monkeypatch):
    from amoe import cli

    monkeypatch.setattr(cli, "setup_logging", lambda verbose: None)  # leave this process's logging alone
    base = ["plan", "--model-profile", "mixtral-8x7b-mqa:2", "--gpus", "a100-80g:3", "--top-k", "1", "--modes", "aep",
            "--simulate-top", "0", "--simulate-per-mode", "0"]  # fmt: skip
    assert cli.main([*base, "--emulated"]) != 0
    assert (
        capsys.readouterr().err.strip()
        == "amoe: error: --emulated chooses what --out FILE writes: give --out too"
    )
    assert cli.main([*base, "--out", str(tmp_path / "missing" / "plan.json")]) != 0
    assert "amoe: error: --out: cannot write" in capsys.readouterr().err
    assert cli.main([*base, "--out", str(tmp_path / "plan.json")]) == 0
    assert AmoeConfig.from_file(tmp_path / "plan.json").executor.kind == "torch"

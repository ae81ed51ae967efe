"""vLLM's command line starts `amoe serve`: the model as a positional argument and vLLM's spellings of the same
settings (--max-model-len, --dtype, --served-model-name, --max-num-seqs, --seed, --host, --port, --api-key,
--gpu-memory-utilization, --tensor-parallel-size 1, --enable-eplb, --num-redundant-experts, --eplb-config),
grouped in --help; what has no counterpart is refused in one
line naming why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from amoe.cli import EXIT_USER_ERROR, _vllm_positionals, build_parser, main
from amoe.config import config_from_args
from amoe.errors import ConfigError
from amoe.model.make import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("vllm-flags") / "tiny", seed=0)


def parse(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    _vllm_positionals(args)
    return config_from_args(args)


def test_vllm_spellings_set_the_same_settings():
    config = parse(
        "/models/m", "--max-model-len", "4096", "--dtype", "bfloat16", "--served-model-name", "m",
        "--max-num-seqs", "64", "--seed", "7", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
        "--gpu-memory-utilization", "0.8", "--tensor-parallel-size", "1",
    )  # fmt: skip
    assert config.model.path == "/models/m" and config.model.max_model_len == 4096
    assert config.model.dtype == "bfloat16" and config.cache.max_num_seqs == 64
    assert config.server.served_model_name == "m" and config.server.seed == 7
    assert (config.server.host, config.server.port, config.server.api_key) == ("0.0.0.0", 9000, "k")
    assert config.device.memory_utilization == 0.8


def test_vllm_dtype_synonyms():
    assert parse("--dtype", "half").model.dtype == "float16"
    assert parse("--dtype", "float").model.dtype == "float32"


def test_the_model_positional_or_flag_but_not_two_different_ones():
    assert parse("--model", "/a", "/a").model.path == "/a"
    with pytest.raises(ConfigError, match="given twice"):
        parse("--model", "/a", "/b")


@pytest.mark.parametrize("argv, named", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2"),
    (["-tp", "4"], "--tensor-parallel-size 4"),
    (["--dtype", "fp8"], "model.dtype"),
])  # fmt: skip
def test_what_has_no_counterpart_is_refused_in_one_line(capsys, argv, named):
    assert main(["serve", *argv]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("amoe: error:") and named in err and "\n" not in err, err


def test_vllms_eplb_flags_set_the_eplb_section():
    config = parse(
        "--enable-eplb", "--eplb-config", '{"window_size": 10, "step_interval": 20, "log_balancedness": true, '
        '"num_redundant_experts": 1}', "--eplb-step-interval", "30",
    )  # fmt: skip
    eplb = config.eplb
    assert eplb.enable and eplb.log_balancedness and (eplb.window_size, eplb.num_redundant_experts) == (10, 1)
    assert eplb.step_interval == 30  # a --eplb-* flag wins over the JSON
    assert parse("--num-redundant-experts", "2").eplb.num_redundant_experts == 2
    assert not parse("--eplb-enable", "false").eplb.enable


@pytest.mark.parametrize("argv, named", [
    (["--eplb-config", '{"window": 3}'], "eplb.window"),
    (["--eplb-config", "[1]"], "--eplb-config"),
    (["--eplb-config", "{bad"], "not valid JSON"),
    (["--num-redundant-experts", "1", "--parallel", "local"], "--parallel aep"),
    (["--num-redundant-experts", "1", "--parallel", "ep", "--attn-ranks", "1"], "--attn-ranks 2"),
    (["--enable-eplb", "--expert-ranks", "1"], "--expert-ranks 2"),
    (["--num-redundant-experts", "-1"], "eplb.num_redundant_experts"),
])  # fmt: skip
def test_bad_eplb_settings_are_refused_in_one_line(capsys, argv, named):
    try:
        code = main(["serve", *argv])
    except SystemExit as exc:  # a value argparse itself refuses (its type check)
        code = exc.code
    assert code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("amoe: error:") and named in err and "\n" not in err, err


def test_help_groups_vllms_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    group = text[text.index("vLLM's flags:") :].split("\n\n", 2)[:2]
    block = "\n".join(group)
    for flag in ("MODEL", "--model", "--dtype", "--max-model-len", "--max-num-seqs", "--served-model-name", "--seed",
                 "--host", "--port", "--api-key", "--gpu-memory-utilization", "--tensor-parallel-size", "--headless",
                 "--generation-config", "--enable-auto-tool-choice", "--tool-call-parser", "--enable-eplb",
                 "--num-redundant-experts", "--eplb-config"):  # fmt: skip
        assert flag in block, flag


def test_vllms_quickstart_command_line_serves(model_dir, tmp_path):
    """vLLM's quickstart (`vllm serve MODEL --dtype auto --api-key token-abc123`) with `amoe` in place of `vllm`
    and the port left to the OS; plus the model-length, name, batch, seed and generation-config flags of its
    serving docs."""
    creator = tmp_path / "creator"
    creator.mkdir()
    (creator / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 12}')
    cmd = [
        sys.executable, "-m", "amoe", "serve", str(model_dir), "--dtype", "auto", "--api-key", "token-abc123",
        "--port", "0", "--served-model-name", "tiny-chat", "--max-model-len", "64", "--max-num-seqs", "4",
        "--seed", "3", "--generation-config", str(creator),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "AMOE_LOG_LEVEL": "INFO"},
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stderr), daemon=True).start()
    try:
        url = _listening(proc, lines)
        headers = {"Authorization": "Bearer token-abc123"}
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key is asked for
        card = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]
        assert card["id"] == "tiny-chat" and card["max_model_len"] == 64
        body = {
            "model": "tiny-chat",
            "prompt": [5, 6, 7],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text
        too_long = httpx.post(
            f"{url}/v1/completions", json={**body, "prompt": [5] * 65}, headers=headers, timeout=60
        )
        assert too_long.status_code == 400 and "64" in too_long.json()["error"]["message"]
        # --seed: the first unseeded sampled arrival samples with the first seed of the stream --seed 3 starts,
        # as a local engine given seed 3 does (and not as one given seed 4).
        sampled = {**body, "temperature": 1.0, "max_tokens": 12}
        text = httpx.post(f"{url}/v1/completions", json=sampled, headers=headers, timeout=60).json()
        assert text["choices"][0]["text"] == _first_sampled(model_dir, seed=3)
        assert text["choices"][0]["text"] != _first_sampled(model_dir, seed=4)
        # --generation-config: what a request leaves unset comes from the file (greedy, 12 tokens), with a warning
        unset = {"model": "tiny-chat", "prompt": [5, 6, 7], "ignore_eos": True}
        defaulted = httpx.post(f"{url}/v1/completions", json=unset, headers=headers, timeout=60).json()
        greedy = httpx.post(
            f"{url}/v1/completions", json={**body, "max_tokens": 12}, headers=headers, timeout=60
        ).json()
        assert defaulted["usage"]["completion_tokens"] == 12
        assert defaulted["choices"][0]["text"] == greedy["choices"][0]["text"]
        assert any("default sampling parameters come from" in line for line in lines)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()


def _listening(proc: subprocess.Popen, lines: list[str]) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in list(lines):
            if match := re.search(r"amoe serve: listening on (http://\S+)$", line):
                return match.group(1)
        assert proc.poll() is None, "server exited early:\n" + "\n".join(lines)
        time.sleep(0.05)
    raise AssertionError("no listening line:\n" + "\n".join(lines))


def _first_sampled(model_dir, seed: int) -> str:
    from amoe.llm import LLM
    from amoe.sampling_params import SamplingParams

    llm = LLM(model=str(model_dir), seed=seed)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    return llm.generate([[5, 6, 7]], [params])[0].outputs[0].text


def test_vllms_tool_calling_flags():
    """`--enable-auto-tool-choice` takes no value, as in vLLM; `--tool-call-parser` names one of vLLM's parsers."""
    config = parse("/models/m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert config.server.enable_auto_tool_choice is True and config.server.tool_call_parser == "hermes"
    assert parse("--tool-call-parser", "deepseek_v3").server.enable_auto_tool_choice is False
    assert parse(
        "--server-enable-auto-tool-choice", "true", "--tool-call-parser", "mistral"
    ).server.tool_call_parser
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        parse("--enable-auto-tool-choice")


def test_an_unknown_tool_call_parser_is_refused_in_one_line(capsys):
    assert main(["serve", "--tool-call-parser", "llama3_json"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert "--tool-call-parser" in err and "hermes, deepseek_v3, mistral" in err and "\n" not in err, err

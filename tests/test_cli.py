"""The `amoe` command, run as a user would (subprocesses, or its entry point in-process where a process would only add
importing torch): output on stdout, one-line errors on stderr."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from amoe import __version__, cli
from amoe.model.make import default_model_path, make_model

LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
GENERATE = ["generate", "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0"]
MISSING_TENSOR = "model.layers.1.self_attn.q_proj.weight"
RESHAPED_TENSOR = "model.layers.0.block_sparse_moe.experts.3.w2.weight"


def _start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "amoe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _finish(_start(args, env))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("cli") / "tiny", seed=0)


# Each case breaks a copy of the tiny model; the error line must name what is wrong.
def _no_dir(d: Path) -> None:
    shutil.rmtree(d)


def _bad_config_json(d: Path) -> None:
    (d / "config.json").write_text('{"vocab_size": 1024,')


def _unsupported_architecture(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (d / "config.json").write_text(json.dumps(config))


def _rewrite_tensors(d: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(d / "model.safetensors")
    change(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _missing_tensor(d: Path) -> None:
    _rewrite_tensors(d, lambda t: t.pop(MISSING_TENSOR))


def _wrong_shape(d: Path) -> None:
    _rewrite_tensors(d, lambda t: t.update({RESHAPED_TENSOR: t[RESHAPED_TENSOR][:-1].clone()}))


def _bad_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").write_text("{}")


BROKEN_MODELS = {
    "no-dir": (_no_dir, "missing-model"),
    "bad-config": (_bad_config_json, "config.json"),
    "architecture": (_unsupported_architecture, "LlamaForCausalLM"),
    "missing-tensor": (_missing_tensor, MISSING_TENSOR),
    "wrong-shape": (_wrong_shape, RESHAPED_TENSOR),
    "bad-tokenizer": (_bad_tokenizer, "tokenizer.json"),
}
# Argparse and sampling-flag mistakes fail before any model is loaded: checked in-process, which is much faster.
BAD_FLAGS = {
    "no-prompt": (["generate", "--max-tokens", "3"], "--prompt"),
    "bad-int": (["generate", "--prompt", "x", "--max-tokens", "many"], "--max-tokens"),
    "bad-temperature": ([*GENERATE, "--temperature", "-1"], "temperature"),
    "bad-preset": (["make-model", "--preset", "huge", "--out", "x"], "--preset"),
    "unknown-command": (["fly"], "fly"),
    # the merging wave policy is retired: its name says what replaces it
    "retired-policy": (["serve", "--scheduler", "wave"], "use waves"),
}


def _assert_one_error_line(returncode: int, stderr: str, expected: str) -> None:
    assert returncode != 0
    assert "Traceback" not in stderr
    # Log lines may come first; the error itself is one line naming what is wrong.
    lines = [line for line in stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("amoe: error: ")
    assert expected in lines[0]


@pytest.mark.parametrize("case", BROKEN_MODELS)
def test_broken_model_prints_one_line(model_dir, tmp_path, monkeypatch, capsys, case):
    """In-process through the entry point (`cli.main`, what `amoe` runs): a process per case would mostly be
    importing torch."""
    damage, expected = BROKEN_MODELS[case]
    broken = shutil.copytree(model_dir, tmp_path / ("missing-model" if case == "no-dir" else case))
    damage(broken)
    monkeypatch.setattr(cli, "setup_logging", lambda verbose: None)  # leave this process's logging alone
    returncode = cli.main([*GENERATE, "--model", str(broken)])
    _assert_one_error_line(returncode, capsys.readouterr().err, expected)


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_bad_flags_print_one_line(monkeypatch, capsys, case):
    monkeypatch.setattr(cli, "setup_logging", lambda verbose: None)  # leave this process's logging alone
    args, expected = BAD_FLAGS[case]
    try:
        returncode = cli.main(args)
    except SystemExit as e:  # argparse exits by itself
        returncode = e.code
    _assert_one_error_line(returncode, capsys.readouterr().err, expected)


def test_make_model_then_generate(tmp_path, model_dir):
    from amoe import LLM, SamplingParams

    made = _run(["make-model", "--preset", "tiny", "--out", str(tmp_path / "m"), "--seed", "0"])
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == str(tmp_path / "m")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "m" / name).read_bytes() == (model_dir / name).read_bytes()

    prompts = ["Hello", "Once upon a time"]
    args = ["generate", "--model", str(tmp_path / "m"), "--max-tokens", "6", "--temperature", "0", "-v"]
    result = _run([*args, "--prompt", prompts[0], "--prompt", prompts[1]])
    assert result.returncode == 0, result.stderr
    assert " DEBUG " in result.stderr  # -v after the subcommand works too
    expected = LLM(model=model_dir).generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    assert result.stdout == "".join(f"--- {r.prompt!r}\n{r.outputs[0].text}\n" for r in expected)


def test_generate_chat_on_the_default_model():
    args = [
        "generate",
        "--prompt",
        "Hi",
        "--chat",
        "--max-tokens",
        "4",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
    ]
    result = _run([*args, "--top-k", "20", "--seed", "7"])
    assert result.returncode == 0, result.stderr
    assert str(default_model_path()) in result.stderr and result.stdout.strip()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert (exit_info.value.code, capsys.readouterr().out.strip()) == (0, f"amoe {__version__}")

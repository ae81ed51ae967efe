"""Published deployments as data (amoe.perf.studies.deployments, `amoe bench frontier --deployments FILE`): the
built-in file parses, a bad line is one error naming the line and the field, and a file of one's own is predicted
line by line with one calibration."""

from __future__ import annotations

import argparse
import json

import pytest

from amoe.perf.studies import deployments as dp

GOOD = {
    "name": "tiny", "phase": "decode", "model": "qwen3-30b-a3b", "gpu": "h100", "gpus": 16,
    "layout": {"mode": "ep", "ep_size": 16, "dp_attention": True}, "batch_per_gpu": 32, "kv_length": 1000,
    "two_batch_overlap": True, "redundant_experts": 16, "eplb": True,
    "published": {"value": 1000, "unit": "output_tokens_per_s_per_gpu", "source": "https://example.org", "where": "x"},
}  # fmt: skip


def write(tmp_path, *lines) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("# a comment\n\n" + "\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_the_built_in_file_parses_and_names_its_sources():
    lines = dp.load(dp.DEFAULT_FILE)
    names = {d.name for d in lines}
    assert {
        "sglang-96xh100-decode",
        "sglang-prefill-4k",
        "deepseek-profile-decode",
        "deepseek-day6-decode",
    } <= names
    for d in lines:
        assert d.published.source.startswith("https://") and d.published.where
    profile = next(d for d in lines if d.name == "deepseek-profile-decode")
    assert profile.in_sample and profile.draft_tokens == 1 and profile.acceptance == 0.6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gpu": "h300"}, r"d.jsonl:3: field 'gpu': unknown GPU 'h300'; choose from"),
        ({"phase": "train"}, r"d.jsonl:3: field 'phase': 'train'; choose from decode, prefill"),
        ({"gpuz": 1}, r"d.jsonl:3: field 'gpuz': unknown"),
        ({"model": "nope"}, r"d.jsonl:3: field 'model': 'nope' is neither a profile"),
        ({"layout": {"mode": "ep", "ep_size": 32}}, r"d.jsonl:3: field 'layout.ep_size': 32 exceeds gpus 16"),
        ({"layout": {"mode": "ep", "ep_size": 16, "dp_attention": False}}, r"field 'layout.dp_attention'"),
        ({"eplb": False}, r"field 'eplb': EPLB is modelled with redundant experts"),
        ({"batch_per_gpu": "many"}, r"field 'batch_per_gpu': must be a number; got 'many'"),
        ({"concurrency": 64}, r"field 'batch_per_gpu': give batch_per_gpu or concurrency"),
        ({"precision": {"experts": "fp6"}}, r"field 'precision.experts': 'fp6'"),
        ({"mtp": {"draft_tokens": 1, "acceptance": 2}}, r"field 'mtp.acceptance': must be in \[0, 1\]"),
        ({"routing": "skew-exp:-1"}, r"field 'routing'"),
        ({"published": {"value": 1, "unit": "input_tokens_per_s_per_gpu", "source": "u", "where": "w"}},
         r"field 'published.unit': input_tokens_per_s_per_gpu does not fit phase decode"),
        ({"ablation": {"of": "missing", "published_gain": 1.2}}, r"field 'ablation.of': no line named 'missing'"),
    ],
)  # fmt: skip
def test_a_bad_line_is_one_error_naming_the_line_and_the_field(tmp_path, change, message):
    with pytest.raises(dp.DeploymentError, match=message):
        dp.load(write(tmp_path, {**GOOD, **change}))


def test_a_line_that_is_not_json_and_a_name_used_twice(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{nope\n")
    with pytest.raises(dp.DeploymentError, match=r"d.jsonl:2: not a JSON object"):
        dp.load(path)
    with pytest.raises(dp.DeploymentError, match=r"d.jsonl:3: field 'name': 'tiny' is used by another line"):
        dp.load(write(tmp_path, GOOD, GOOD))


def test_lengths_give_the_mean_kv_a_decoded_token_attends(tmp_path):
    fixed = {k: v for k, v in GOOD.items() if k != "kv_length"} | {"input_len": 1800, "output_len": 100}
    ranged = fixed | {"name": "r", "input_len": [100, 300], "output_len": [0, 100]}
    a, b = dp.load(write(tmp_path, fixed, ranged))
    assert a.kv_length == 1850
    assert b.kv_length == pytest.approx(200 + (sum(o * o for o in range(101)) / 101) / (2 * 50))


def test_the_cli_predicts_a_file_of_ones_own_line_by_line(tmp_path, capsys):
    """Two lines, one an ablation of the other (two-batch overlap off): a row each, the gain, a final JSON line."""
    from amoe.perf.studies.commands import run_frontier

    off = GOOD | {
        "name": "tiny-no-tbo",
        "two_batch_overlap": False,
        "ablation": {"of": "tiny", "published_gain": 1.1},
    }
    args = argparse.Namespace(deployments=write(tmp_path, GOOD, off), calibration=None, out=str(tmp_path), table=False,
                              breakdown=False, trace=None)  # fmt: skip
    assert run_frontier(args) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["frontier"]
    rows = {r["name"]: r for r in final["deployments"]}
    assert final["calibration"] == "2026-11-29" and set(rows) == {"tiny", "tiny-no-tbo"}
    assert rows["tiny"]["ratio"] == pytest.approx(rows["tiny"]["predicted"] / 1000)
    (gain,) = final["ablations"]
    assert gain["predicted_gain"] == pytest.approx(
        rows["tiny"]["predicted"] / rows["tiny-no-tbo"]["predicted"]
    )
    assert (tmp_path / "frontier.json").exists()


def test_the_cli_refuses_a_bad_file_in_one_line(tmp_path):
    from amoe.perf.studies.commands import run_frontier

    args = argparse.Namespace(deployments=write(tmp_path, GOOD | {"gpus": 0}), calibration=None, out=None,
                              table=False, breakdown=False, trace=None)  # fmt: skip
    with pytest.raises(
        SystemExit, match=r"amoe bench frontier: .*d.jsonl:3: field 'gpus': must be at least 1"
    ):
        run_frontier(args)

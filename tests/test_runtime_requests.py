"""An attention rank's requests: a batch that fails ends its own requests (KV freed) and nothing else; an abort
whose tokens never come back expires and frees its KV, but never under a batch that may still write it."""

import time

import pytest
from factories import random_prompts, reference_tokens

from amoe.runtime.requests import RankRequests
from amoe.sampling_params import SamplingParams
from amoe.testing.inproc import InProcessCluster

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def rank_requests() -> RankRequests:
    return RankRequests(vocab_size=100, eos_token_ids=(2,), num_kv_blocks=8, block_size=4, max_model_len=32)


def test_an_unconfirmed_abort_expires_and_frees_its_kv():
    requests = rank_requests()
    req, rows = requests.add(7, [5, 6, 7], GREEDY)
    requests.enter([7], [3], [3])
    assert requests.kv_used_blocks == 1 and len(rows) == 3
    assert requests.abort(7)
    assert requests.expire_aborts(timeout_s=60) == []  # not yet
    assert requests.expire_aborts(timeout_s=0) == [7]
    requests.begin_batch([7])  # a batch already running it may still write its slots
    requests.collect_expired()
    assert requests.kv_used_blocks == 1 and not req.done.is_set()
    requests.end_batch()
    assert requests.kv_used_blocks == 0 and req.done.is_set() and req.finish_reason == "abort"
    assert requests.expire_aborts(timeout_s=0) == []  # gone: nothing expires twice


def test_a_failed_batch_frees_its_requests():
    requests = rank_requests()
    a, _ = requests.add(1, [5, 6], GREEDY)
    b, _ = requests.add(2, [5], GREEDY)
    requests.enter([1, 2], [2, 1], [2, 1])
    out = requests.fail([1, 2, 1], "RuntimeError: boom")
    assert out.tokens == [(1, [], "error"), (2, [], "error")] and out.error == "RuntimeError: boom"
    assert out.finished == [1, 2] and len(out.next) == 0 and out.kv_free_blocks == 8
    assert a.done.is_set() and b.done.is_set() and a.finish_reason == "error"


@pytest.mark.timeout(120)
def test_a_layer_failing_for_one_request_fails_it_alone(tiny_checkpoint):
    """The torch compute raises for one request's batch: that request ends with "error" and its KV is freed; the
    rank serves on and later requests get the reference tokens; the engine forgot it (late rows would drop)."""
    prompts = random_prompts([4, 9, 2])
    reference = reference_tokens(tiny_checkpoint, prompts, GREEDY)
    with InProcessCluster(tiny_checkpoint, num_attn_ranks=1, num_expert_ranks=2) as cluster:
        (attn,) = cluster.attention
        attend = attn.compute.attend
        doomed = 1000

        def flaky(batch, request_ids, requests):
            if doomed in request_ids and batch.block == 1:
                raise RuntimeError("a layer failed")
            return attend(batch, request_ids, requests)

        attn.compute.attend = flaky
        bad = cluster.add_request(0, doomed, [1, 5, 9], GREEDY)  # alone in its batches: it fails alone
        assert bad.done.wait(30) and bad.finish_reason == "error" and bad.output == []
        assert cluster.generate(prompts, GREEDY, timeout=60) == reference
        assert attn.requests.kv_used_blocks == 0
        # A request is done once sampled; the loop hands its end to the engine a moment later.
        deadline = time.monotonic() + 10
        while (stats := cluster.engines[0].stats())["tracked_requests"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stats["tracked_requests"] == 0 and stats["pool_entries"] == 0

"""The control-plane wire module: every message round-trips; garbage, truncation, unknown tags and other versions
are a WireError (never another exception, never a crash)."""

import msgspec
import pytest

from amoe import wire
from amoe.sampling_params import SamplingParams

PARAMS = wire.WireSampling(8, 0.7, 40, 0.9, 1234, [2], True)

MESSAGES = [
    wire.Hello(3, "expert", 4242, "ipc:///tmp/x/data", num_kv_blocks=0, max_model_len=4096, vocab_size=32000),
    wire.Ready(1),
    wire.Failed(2, "ModelLoadError: missing tensor"),
    wire.Heartbeat(0, {"busy_s": 1.5, "depth": [["attn", 0, 0, 3]], "comm": {"dropped": {"garbage": 1}}}),
    wire.TokenOut(0, [7, 8], [[11], []], [None, "abort"], kv_free_blocks=99),
    wire.TokenOut(0, [9], [[]], ["error"], kv_free_blocks=1, error="RequestError: bad"),
    wire.Welcome(["ipc:///a", "tcp://127.0.0.1:5555"]),
    wire.AddRequest(5, [1, 2, 3], PARAMS),
    wire.Abort(5),
    wire.Shutdown(),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frame = wire.encode(msg)
    assert frame[0] == wire.PROTOCOL_VERSION
    assert wire.decode(frame) == msg
    assert wire.decode(memoryview(frame)) == msg


@pytest.mark.timeout(10)
def test_tags_are_one_byte_and_distinct():
    tags = [m.__struct_config__.tag for m in {type(m) for m in MESSAGES}]
    assert len(set(tags)) == len(tags) and all(0 <= t < 128 for t in tags)  # msgpack positive fixint: 1 byte
    assert wire.encode(wire.Abort(1))[2] == wire.Abort.__struct_config__.tag


BAD_FRAMES = {
    "empty": b"",
    "other version": bytes([wire.PROTOCOL_VERSION + 1]) + wire.encode(wire.Ready(0))[1:],
    "garbage": b"\x01\xc1\xc1\xc1",
    "truncated": wire.encode(wire.AddRequest(5, [1, 2, 3], PARAMS))[:-4],
    "unknown tag": bytes([wire.PROTOCOL_VERSION]) + msgspec.msgpack.encode([99, 1]),
    "wrong field type": bytes([wire.PROTOCOL_VERSION]) + msgspec.msgpack.encode([2, "one"]),
    "not an array": bytes([wire.PROTOCOL_VERSION]) + msgspec.msgpack.encode({"t": 2, "runtime": 1}),
    "pickle": b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.",
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("frame", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
def test_bad_frames_raise_wire_error(frame):
    with pytest.raises(wire.WireError):
        wire.decode(frame)


@pytest.mark.timeout(10)
def test_sampling_params_round_trip():
    params = SamplingParams(
        max_tokens=8, temperature=0.7, top_k=40, top_p=0.9, stop_token_ids=(2,), ignore_eos=True
    )
    back = wire.from_wire_sampling(
        wire.decode(wire.encode(wire.AddRequest(1, [1], wire.to_wire_sampling(params, 7)))).params
    )
    assert back == SamplingParams(**{**params.__dict__, "seed": 7})


@pytest.mark.timeout(10)
def test_stats_layer_maps_survive_the_wire():
    stats = {
        "depth": {("attn", 0, 0): 2, ("expert", 1, 3): 5},
        "batches": {},
        "rows": {("attn", 4, 1): 9},
        "x": 1,
    }
    frame = wire.encode(wire.Heartbeat(0, wire.flatten_stats(stats)))
    assert wire.unflatten_stats(wire.decode(frame).stats) == stats


@pytest.mark.timeout(10)
def test_worker_spec_json_and_bad_spec():
    spec = wire.WorkerSpec(
        runtime=1, role="expert", coordinator="ipc:///x", model_dir="/m", config={}, parent_pid=1
    )
    assert wire.decode_spec(wire.encode_spec(spec)) == spec
    with pytest.raises(wire.WireError):
        wire.decode_spec(b'{"runtime": "one"}')

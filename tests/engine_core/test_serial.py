"""Round trips of every wire type through ``tidal.engine_core.serial``, arrays as zero-copy
frames, and typed decode failures."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tidal.engine_core.config import EngineArgs, EngineConfig
from tidal.engine_core.control import (
    ControlCall,
    ControlResult,
    GetKVStats,
    KVStats,
    Ping,
    Pong,
    ResetPrefixCache,
)
from tidal.engine_core.protocol import (
    AbortRequests,
    AddRequests,
    CachedRequestData,
    ControlRequest,
    ControlResponse,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineMessage,
    EngineRegister,
    FinishReason,
    FrontendMessage,
    Goodbye,
    HandshakeFailed,
    HandshakeMessage,
    Heartbeat,
    Hello,
    LogprobsArrays,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    Ready,
    SchedulerOutput,
    SchedulerStats,
)
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.engine_core.serial import (
    DEFAULT_OOB_THRESHOLD,
    Decoder,
    Encoder,
    SerialDecodeError,
)


def _roundtrip(obj, type_, encoder=None):
    frames = (encoder or Encoder()).encode(obj)
    # What a socket delivers: separate buffers (bytes for frame 0, memoryviews for the rest).
    wire = [bytes(frames[0])] + [memoryview(f) for f in frames[1:]]
    return Decoder(type_).decode(wire), frames


def _assert_equal(a, b):
    """Structs with numpy fields: compare field by field (``==`` on arrays is elementwise)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b)
        for name in a.__struct_fields__:
            _assert_equal(getattr(a, name), getattr(b, name))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b and type(a) is type(b)


def _logprobs(rows: int, width: int) -> LogprobsArrays:
    rng = np.random.default_rng(rows)
    return LogprobsArrays(
        rng.integers(0, 1000, (rows, width), dtype=np.int32),
        rng.standard_normal((rows, width)).astype(np.float32),
        rng.integers(1, 50, rows, dtype=np.int32),
    )


PARAMS = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, seed=11, logit_bias={5: -2.0},
                        stop=["\n\n"], stop_token_ids=[7], logprobs=2,
                        output_kind=OutputKind.DELTA)
REQUEST = EngineCoreRequest("req-1", [1, 2, 3], PARAMS, arrival_time=1.5, cache_salt="s",
                            client_index=2)
OUTPUT = EngineCoreOutput("req-1", [4, 5], new_logprobs=_logprobs(2, 3),
                          new_prompt_logprobs=_logprobs(100, 3), prompt_logprobs_start=1,
                          finish_reason=FinishReason.STOP, stop_reason="\n\n",
                          num_cached_tokens=16)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    import json

    folder = tmp_path_factory.mktemp("cfg")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 384, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "eos_token_id": [0, 1]}))
    return EngineArgs(model=str(folder), num_kv_blocks=64,
                      distributed_executor_backend="noop").create_config()


@pytest.mark.parametrize("obj, type_", [
    (REQUEST, EngineCoreRequest),
    (EngineCoreOutputs([OUTPUT, EngineCoreOutput("r2", pooled=np.ones(384, np.float32))], 3.0,
                       SchedulerStats(1, 2, 0.5, 3, 4, 5, 6, 7), engine_index=1),
     EngineCoreOutputs),
    (SchedulerOutput(7, [NewRequestData("a", [1, 2], [3], PARAMS, [0, 1], 2, 1)],
                     CachedRequestData(["b"], [9], [0], [[4]]), [1, 2], 3, ["z"]),
     SchedulerOutput),
    (ModelRunnerOutput(["a", "b"], [[1], [2, 3]], _logprobs(3, 2),
                       {"a": (1, _logprobs(40, 2))}, {"c": "sampling failed"},
                       {"d": np.arange(1024, dtype=np.float32)}), ModelRunnerOutput),
    (AddRequests([REQUEST, EngineCoreRequest("req-2", [4], PARAMS)]), FrontendMessage),
    (AbortRequests(["a", "b"]), FrontendMessage),
    (ControlRequest(4, GetKVStats()), FrontendMessage),
    (ControlRequest(5, ResetPrefixCache()), FrontendMessage),
    (ControlRequest(6, Ping()), FrontendMessage),
    (Goodbye(), FrontendMessage),
    (CoreOutputs(OutputBatch.pack([OUTPUT, EngineCoreOutput("r3", [9])], 2.0,
                                  SchedulerStats(1, 2, 0.5))), EngineMessage),
    (ControlResponse(4, KVStats(64, 60, 1, 2)), EngineMessage),
    (ControlResponse(5, True), EngineMessage),
    (ControlResponse(6, Pong(123, 4)), EngineMessage),
    (ControlResponse(7, error="TypeError: boom"), EngineMessage),
    (Heartbeat(), EngineMessage),
    (EngineDead("worker 1 died"), EngineMessage),
    (Hello("ipc:///tmp/x/in.sock", "tcp://127.0.0.1:5000", 42), HandshakeMessage),
    (HandshakeFailed("no weights"), HandshakeMessage),
    (EngineRegister(b"tidal-engine-1234"), EngineRegister),
], ids=lambda v: type(v).__name__ if not isinstance(v, type) else "")
def test_every_wire_type_round_trips(obj, type_):
    decoded, _ = _roundtrip(obj, type_)
    _assert_equal(obj, decoded)


def test_config_travels_in_ready(config):
    """READY carries the resolved config (a frozen struct) intact, nested arch and all."""
    ready = Ready(b"tidal-engine-abcd", 3, config, 99, 0.5)
    decoded, frames = _roundtrip(ready, HandshakeMessage)
    assert len(frames) == 1
    assert decoded == ready and decoded.config.cache.num_blocks == 64
    assert decoded.config.model.arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_control_results_have_declared_types():
    results: list[tuple[ControlCall, ControlResult]] = [
        (GetKVStats(), KVStats(1, 1, 0, 0)), (ResetPrefixCache(), False), (Ping(), Pong(1, 0))]
    for call, result in results:
        decoded, _ = _roundtrip(ControlResponse(0, result), EngineMessage)
        assert isinstance(decoded.result, type(call).result_type)


def test_large_arrays_are_zero_copy_frames_small_ones_inline():
    big = np.arange(DEFAULT_OOB_THRESHOLD // 4, dtype=np.float32)  # exactly the threshold
    small = np.arange(DEFAULT_OOB_THRESHOLD // 4 - 1, dtype=np.float32)
    msg = EngineCoreOutputs([EngineCoreOutput("a", pooled=big), EngineCoreOutput("b",
                                                                                 pooled=small)])
    frames = Encoder().encode(msg)
    assert len(frames) == 2
    # Encoding did not copy: the extra frame is the array's own memory.
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), big)
    received = [bytes(frames[0]), bytearray(frames[1])]  # a frame as a socket would hand it over
    out = Decoder(EngineCoreOutputs).decode(received)
    a, b = out.outputs[0].pooled, out.outputs[1].pooled
    np.testing.assert_array_equal(a, big)
    np.testing.assert_array_equal(b, small)
    # Decoding did not copy either: the array views the received frame.
    assert np.shares_memory(a, np.frombuffer(received[1], np.uint8))
    assert len(frames[0]) < small.nbytes + big.nbytes  # the big array is not in frame 0


def test_zmq_frames_decode_without_copy():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://serial-test")
    b.connect("inproc://serial-test")
    try:
        lp = _logprobs(500, 5)
        a.send_multipart(Encoder().encode(CoreOutputs(OutputBatch.pack([EngineCoreOutput(
            "r", [1], new_logprobs=lp)]))), copy=False)
        frames = b.recv_multipart(copy=False)
        assert len(frames) == 4  # message + three arrays
        out = Decoder(EngineMessage).decode(frames).outputs.details[0].new_logprobs
        _assert_equal(lp, out)
        # A view of the received zmq message, not a copy.
        assert np.shares_memory(out.logprobs, np.frombuffer(frames[2].buffer, np.uint8))
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_noncontiguous_and_odd_arrays():
    enc, dec = Encoder(oob_threshold=16), Decoder(np.ndarray)
    base = np.arange(60, dtype=np.int64).reshape(6, 10)
    for arr in (base[:, ::3], base.T, np.zeros((0, 4), np.float16), np.array(3.5),
                np.array([True, False, True]), np.arange(8, dtype=">i4"),
                (np.arange(6) + 1j).astype(np.complex64)):
        out = dec.decode(enc.encode(arr))
        assert out.dtype == arr.dtype and out.shape == arr.shape
        np.testing.assert_array_equal(out, arr)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(st.sampled_from([np.int8, np.int32, np.uint16, np.float16, np.float32,
                                   np.float64, np.bool_]),
                  hnp.array_shapes(min_dims=0, max_dims=3, max_side=40)),
       st.integers(1, 512))
def test_any_array_round_trips(arr, threshold):
    frames = Encoder(oob_threshold=threshold).encode({"x": arr, "y": [arr]})
    assert len(frames) == 1 + 2 * (arr.nbytes >= threshold)
    out = Decoder().decode(frames)
    for got in (out["x"], out["y"][0]):
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)


def test_numpy_scalars_become_numbers_and_objects_are_refused():
    assert Decoder().decode(Encoder().encode([np.int64(3), np.float32(0.5)])) == [3, 0.5]
    with pytest.raises(TypeError, match="dtype object"):
        Encoder().encode(np.array([object()]))
    with pytest.raises(NotImplementedError, match="no pickle"):
        Encoder().encode(object())


def _bad_frames() -> list[tuple[str, list[bytes]]]:
    enc = msgspec.msgpack.encode
    good = Encoder().encode(CoreOutputs(OutputBatch.pack([EngineCoreOutput(
        "r", pooled=np.ones(256, np.float32))])))
    header = msgspec.msgpack.Ext(2, enc(["<f4", [4], 5]))
    return [
        ("empty", []),
        ("garbage", [b"\xc1\xff garbage"]),
        ("truncated", [bytes(good[0])[:-3]]),
        ("unknown tag", [enc(["nope", 1])]),
        ("wrong field type", [enc(["abort", "not-a-list"])]),
        ("missing array frame", [bytes(good[0])]),
        ("short array frame", [bytes(good[0]), b"\x00" * 10]),
        ("frame index out of range", [enc(["out", [[], None, None, [
            ["r", [], None, None, 0, None, None, 0, None, header]]]])]),
        ("object dtype", [enc(["out", [[], None, None, [
            ["r", [], None, None, 0, None, None, 0, None,
             msgspec.msgpack.Ext(1, enc(["|O", [1], b"x" * 8]))]]]])]),
        ("unknown extension", [enc(["out", [[], None, None, [
            ["r", [], None, None, 0, None, None, 0, None, msgspec.msgpack.Ext(9, b"")]]]])]),
        ("request ids not a list", [enc(["out", [
            "not-a-list"]])]),
    ]


@pytest.mark.parametrize("frames", [f for _, f in _bad_frames()],
                         ids=[name for name, _ in _bad_frames()])
def test_bad_messages_raise_a_typed_error(frames):
    with pytest.raises(SerialDecodeError):
        Decoder(EngineMessage).decode(frames)


def test_invalid_sampling_params_fail_to_decode():
    """A peer cannot smuggle in parameters the constructor would refuse."""
    raw = msgspec.msgpack.encode(["add", [["r1", [1, 2], {"n": 0}]]])
    with pytest.raises(SerialDecodeError, match="n must be in"):
        Decoder(FrontendMessage).decode([raw])

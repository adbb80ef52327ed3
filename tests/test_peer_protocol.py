"""The peer wire protocol: every message round-trips, frames cross a real socket with recv_into,
and hostile or broken input ends in a typed ProtocolError: never a crash, a hang or a large
allocation driven by a length field."""

from __future__ import annotations

import socket
import threading
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_engine.errors import DuetError
from peer.wire.framing import (
    BufferPool,
    FrameReader,
    encode_frame,
    encode_message,
    encode_prefill,
    send_frame,
)
from peer.wire.handshake import check_peer, inexact_reasons, negotiate_version
from peer.wire.kv_wire import KVFormat, decode_layer, encode_layer
from peer.wire.protocol import (
    MAX_HEADER_BYTES,
    Accept,
    Busy,
    Cancel,
    Done,
    Error,
    ErrorCode,
    Hello,
    LayerKV,
    LayerSpec,
    Prefill,
    ProtocolError,
)

LAYERS = [LayerSpec("full", 2, 64, 64), LayerSpec("sliding", 2, 64, 64, window=128)]


def hello(**over) -> Hello:
    fields = dict(
        protocol_min=1,
        protocol_max=1,
        model_fingerprint="ab" * 32,
        backend="cpu",
        mlx_version="0.32.4",
        mlx_lm_version="0.32.2",
        weight_format="dense",
        dtype="bfloat16",
        block_size=16,
        kv_bits=None,
        kv_group_size=32,
        num_layers=2,
        layers=LAYERS,
        max_tokens=4096,
    )
    return Hello(**{**fields, **over})


FMT = KVFormat.from_hello(hello())


class BytesSource:
    """A socket stand-in over fixed bytes (then EOF), for decoding without a peer."""

    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    def recv_into(self, view) -> int:
        n = min(len(view), len(self.data) - self.pos, 1 + len(view) // 2)  # short reads too
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def joined(buffers) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def reframed(buffers, **change) -> bytes:
    """The frame with header fields changed (its length prefix fixed, nbytes left as given)."""
    header = {**msgpack.unpackb(bytes(buffers[0][4:])), **change}
    raw = msgpack.packb(header)
    return len(raw).to_bytes(4, "big") + raw + joined(buffers[1:])


def reader_over(data: bytes, cap: int = 1 << 20, fmt: KVFormat | None = FMT) -> FrameReader:
    return FrameReader(BytesSource(data), BufferPool(cap), kv_format=fmt, max_prompt_tokens=4096)


def layer_frame(t0=3, t1=11, layer=1, seed=0, fmt=FMT) -> tuple[list, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 1 << 16, shape, dtype=np.uint16) for shape, _ in fmt.part_specs(t1 - t0)]
    return encode_layer(fmt, "req-1", 7, layer, t0, t1, parts), parts


HEADER_ONLY = [
    hello(),
    hello(kv_bits=8, dtype="float16"),
    Accept("req-1", 7, hit=32, eta_s=0.25),
    Busy("req-1", 7, retry_after_s=1.5),
    Done("req-1", 7, tokens_computed=100, compute_s=0.5),
    Error(ErrorCode.FINGERPRINT, "different model", "req-1", 7),
    Error(ErrorCode.INTERNAL, "connection-level"),
    Cancel("req-1", 7),
]


@pytest.mark.parametrize("msg", HEADER_ONLY, ids=lambda m: m.TYPE.value)
def test_header_only_messages_round_trip(msg):
    frame = reader_over(joined(encode_message(msg))).read()
    assert frame.msg == msg and frame.payload is None


def test_prefill_round_trips_with_token_ids_as_payload():
    tokens = np.array([1, 50_000, 151_000, 7, 2**32 - 1], np.int64)
    msg = Prefill("req-2", 2**63, n_tokens=5, start=2, chunk_size=512)
    frame = reader_over(joined(encode_prefill(msg, tokens))).read()
    assert frame.msg == msg
    assert frame.token_ids().tolist() == tokens.tolist()


def test_layer_kv_round_trips_bf16_bit_exact():
    buffers, parts = layer_frame()
    with reader_over(joined(buffers)).read() as frame:
        assert isinstance(frame.msg, LayerKV) and (frame.msg.layer, frame.msg.t0, frame.msg.t1) == (1, 3, 11)
        got = decode_layer(frame, FMT)
        # every uint16 pattern (NaNs with payloads included) comes back bit for bit
        assert all(np.array_equal(a, b) for a, b in zip(got, parts, strict=True))


def test_unknown_header_keys_are_ignored():
    msg = Accept("req-1", 7, hit=0, eta_s=0.0)
    data = joined(encode_frame({**msg.to_header(), "added_in_v9": {"x": [1, 2]}}))
    assert reader_over(data).read().msg == msg


def test_unknown_error_code_decodes_as_internal():
    data = joined(encode_frame({**Error(ErrorCode.BUSY, "x").to_header(), "code": "new_code"}))
    assert reader_over(data).read().msg.code == ErrorCode.INTERNAL


@pytest.mark.parametrize(
    "header",
    [
        {"type": "teleport"},
        {"type": 3},
        {"type": "cancel", "request_id": "r"},  # lacks load_id
        {"type": "cancel", "request_id": "r", "load_id": -1},
        {"type": "cancel", "request_id": "r", "load_id": True},
        {"type": "accept", "request_id": "r", "load_id": 1, "hit": 0, "eta_s": float("nan")},
        {"type": "prefill", "request_id": "r", "load_id": 1, "n_tokens": 4, "start": 3, "chunk_size": 8},
        {**hello().to_header(), "num_layers": 3},
    ],
)
def test_bad_headers_are_bad_frames(header):
    with pytest.raises(ProtocolError) as e:
        reader_over(joined(encode_frame(header))).read()
    assert e.value.code == ErrorCode.BAD_FRAME and isinstance(e.value, DuetError)


def test_frames_cross_a_socketpair_with_recv_into_in_order():
    a, b = socket.socketpair()
    frames = [layer_frame(t0=64 * i, t1=64 * (i + 1) + 900, seed=i) for i in range(4)]  # > socket buffer
    reader = FrameReader(b, BufferPool(8 << 20), kv_format=FMT, stall_timeout=30)

    def send():
        with a:
            for buffers, _ in frames:
                send_frame(a, buffers)
            send_frame(a, encode_message(Done("req-1", 7, 0, 0.0)))

    sender = threading.Thread(target=send)
    sender.start()
    for _, parts in frames:
        with reader.read(idle_timeout=30) as frame:
            assert all(np.array_equal(x, y) for x, y in zip(decode_layer(frame, FMT), parts, strict=True))
    assert isinstance(reader.read(idle_timeout=30).msg, Done)
    assert reader.read(idle_timeout=30) is None  # closed between frames
    sender.join(30)
    assert reader.buffers.in_use == 0
    b.close()


def test_truncated_frame_is_an_error_that_sticks():
    data = joined(layer_frame()[0])
    reader = reader_over(data[:-10])
    with pytest.raises(ProtocolError) as e:
        reader.read()
    assert e.value.code == ErrorCode.TRUNCATED
    assert reader.buffers.in_use == 0
    with pytest.raises(ProtocolError) as again:
        reader.read()
    assert again.value is e.value


def test_corrupted_payload_fails_its_checksum_and_frees_the_buffer():
    data = bytearray(joined(layer_frame()[0]))
    data[-5] ^= 0x40
    reader = reader_over(bytes(data))
    with pytest.raises(ProtocolError) as e:
        reader.read()
    assert e.value.code == ErrorCode.CHECKSUM and reader.buffers.in_use == 0


def read_traced(data: bytes, **kw) -> tuple[ProtocolError, int]:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as e:
            reader_over(data, **kw).read()
        return e.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_oversized_header_length_allocates_nothing():
    err, peak = read_traced((2**32 - 1).to_bytes(4, "big") + b"\x80" * 100)
    assert err.code == ErrorCode.BAD_FRAME
    assert peak < 2 * MAX_HEADER_BYTES


@pytest.mark.parametrize("delta", [2**62, 1, -1])
def test_payload_size_must_match_the_shapes(delta):
    buffers, _ = layer_frame()
    size = sum(len(b) for b in buffers[1:])
    err, peak = read_traced(reframed(buffers, nbytes=size + delta))  # a lying size
    assert err.code == ErrorCode.BAD_FRAME and f"payload of {size + delta} bytes" in str(err)
    assert peak < 2 * MAX_HEADER_BYTES


@pytest.mark.parametrize(
    "change,says",
    [
        ({"shapes": [[8, 2, 64], [8, 2, 32]]}, "part shapes"),
        ({"layer": 2}, "layer 2 of a 2-layer model"),
        ({"dtype": "float16"}, "is not this pool's"),
        ({"kv_bits": 8}, "is not this pool's"),
        ({"t1": 5000}, "exceed the 4096-token limit"),
        ({"t0": 4}, "part shapes"),
        ({"t0": 4, "shapes": [[7, 2, 64], [7, 2, 64]]}, "payload of"),  # fewer tokens than sent
    ],
)
def test_layer_kv_must_match_the_receivers_format(change, says):
    reader = reader_over(reframed(layer_frame()[0], **change))
    with pytest.raises(ProtocolError, match=says) as e:
        reader.read()
    assert e.value.code == ErrorCode.BAD_FRAME and reader.buffers.peak == 0
    assert reader_over(reframed(layer_frame()[0])).read().msg.t0 == 3  # unchanged, it reads


def test_layer_kv_before_hello_and_oversized_prefill_are_refused():
    with pytest.raises(ProtocolError, match="before the HELLO"):
        reader_over(joined(layer_frame()[0]), fmt=None).read()
    msg = Prefill("r", 1, n_tokens=5000, start=0, chunk_size=8)
    with pytest.raises(ProtocolError, match="exceeds"):
        reader_over(joined(encode_prefill(msg, np.zeros(5000)))).read()


def test_frame_larger_than_the_receive_pool_is_refused():
    with pytest.raises(ProtocolError, match="receive buffer"):
        reader_over(joined(layer_frame()[0]), cap=1024).read()


def test_idle_timeout_between_frames_does_not_poison_the_reader():
    a, b = socket.socketpair()
    with a, b:
        reader = FrameReader(b, BufferPool(1 << 20))
        with pytest.raises(ProtocolError) as e:
            reader.read(idle_timeout=0.01)  # nothing was sent: this can only time out
        assert e.value.code == ErrorCode.TIMEOUT
        send_frame(a, encode_message(Cancel("r", 1)))
        assert reader.read(idle_timeout=30).msg == Cancel("r", 1)


def test_stall_inside_a_frame_times_out():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(joined(layer_frame()[0])[:100])  # the rest never comes, the socket stays open
        reader = FrameReader(b, BufferPool(1 << 20), kv_format=FMT, stall_timeout=0.05)
        with pytest.raises(ProtocolError) as e:
            reader.read(idle_timeout=30)
        assert e.value.code == ErrorCode.TIMEOUT and reader.buffers.in_use == 0


def test_buffer_pool_blocks_at_its_cap_until_a_release():
    pool = BufferPool(1000)
    first = pool.acquire(600)
    with pytest.raises(ProtocolError) as e:
        pool.acquire(600, timeout=0.01)  # nothing releases: it must time out
    assert e.value.code == ErrorCode.TIMEOUT
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(600, timeout=60)))
    waiter.start()
    first.release()
    waiter.join(60)
    assert got and got[0].array is first.array  # the released buffer is reused
    assert pool.peak <= pool.cap
    blocked = threading.Thread(target=lambda: got.append(pytest.raises(ProtocolError, pool.acquire, 600)))
    blocked.start()
    pool.close()
    blocked.join(60)
    assert got[1].value.code == ErrorCode.CANCELLED


def test_hello_checks():
    local = hello()
    assert check_peer(local, hello(protocol_max=3)) == 1
    assert negotiate_version(hello(protocol_max=4), hello(protocol_min=2, protocol_max=3)) == 3
    cases = [
        (hello(protocol_min=2, protocol_max=2), ErrorCode.VERSION),
        (hello(model_fingerprint="cd" * 32), ErrorCode.FINGERPRINT),
        (hello(layers=[LAYERS[0], LayerSpec("mla", 1, 576, 512)]), ErrorCode.UNSUPPORTED_MODEL),
        (hello(layers=[LAYERS[0], LayerSpec("shared", 2, 64, 64)]), ErrorCode.UNSUPPORTED_MODEL),
        (hello(layers=[LAYERS[0], LayerSpec("full", 2, 128, 128)]), ErrorCode.UNSUPPORTED_MODEL),
    ]
    for remote, code in cases:
        with pytest.raises(ProtocolError) as e:
            check_peer(local, remote)
        assert e.value.code == code
    assert inexact_reasons(local, hello(block_size=32, weight_format="q4_1")) == []
    assert inexact_reasons(local, hello(kv_bits=8)) == ["kv_bits 8 != None", "kv_group_size 32 != None"]
    assert inexact_reasons(local, hello(backend="cuda", mlx_version="0.30.0")) == [
        "backend cuda != cpu",
        "mlx 0.30.0 != 0.32.4",
    ]


# --- fuzz ---------------------------------------------------------------------------------------

VALID = [joined(encode_message(m)) for m in HEADER_ONLY] + [
    joined(layer_frame()[0]),
    joined(encode_prefill(Prefill("r", 1, 3, 0, 8), [1, 2, 3])),
]


@st.composite
def hostile_streams(draw) -> bytes:
    kind = draw(st.sampled_from(["random", "mutated", "header"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "header":  # a well-framed msgpack header of arbitrary content and any length field
        body = msgpack.packb(
            draw(
                st.dictionaries(
                    st.sampled_from(["type", "nbytes", "checksum", "layer", "t0", "t1", "shapes", "x"]),
                    st.one_of(
                        st.sampled_from(["layer_kv", "prefill", "hello", "done"]),
                        st.integers(-(2**63), 2**64 - 1),
                        st.lists(st.integers(0, 2**40), max_size=4),
                        st.none(),
                    ),
                )
            )
        )
        return len(body).to_bytes(4, "big") + body + draw(st.binary(max_size=100))
    data = bytearray(b"".join(draw(st.lists(st.sampled_from(VALID), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


def drain(reader: FrameReader) -> None:
    for _ in range(10):  # a stream holds at most 3 frames: more reads would mean a loop
        try:
            frame = reader.read()
        except ProtocolError:
            return
        if frame is None:
            return
        frame.release()
    raise AssertionError("reader kept returning frames from a short stream")


CAP = 64 * 1024


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_streams())
def test_fuzz_frame_decoder_over_bytes(data):
    reader = reader_over(data, cap=CAP)
    tracemalloc.start()
    try:
        drain(reader)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert reader.buffers.peak <= CAP and reader.buffers.in_use == 0
    assert peak < MAX_HEADER_BYTES + CAP + 256 * 1024


@settings(max_examples=60, deadline=None)
@given(hostile_streams())
def test_fuzz_frame_decoder_over_a_socketpair(data):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.close()  # the writer is gone: every read ends in a frame, EOF or an error, never a wait
        drain(FrameReader(b, BufferPool(CAP), kv_format=FMT))

"""KV moves between two pools over the wire bit for bit: export a token range of one layer, frame
it, cross a socket with recv_into, write it into a pool with another block size and block table."""

from __future__ import annotations

import random
import socket
import threading

import mlx.core as mx
import numpy as np
import pytest

from mlx_engine.kv_cache.kv_pool import KVPool
from peer.wire.framing import BufferPool, FrameReader, send_frame
from peer.wire.kv_wire import KVFormat, decode_layer, encode_layer, to_mx, to_wire

LAYERS, HEADS, DIM, N = 3, 2, 64, 75
START = 5  # the decoder already holds tokens [0, START); the peer sends [START, N - 1)
CHUNK = 32


def make_pool(block_size: int, dtype, kv_bits) -> KVPool:
    return KVPool(LAYERS, 64, block_size, HEADS, DIM, dtype, kv_bits)


def table_for(pool: KVPool, seed: int) -> list[int]:
    blocks = list(range(1, pool.num_blocks))
    random.Random(seed).shuffle(blocks)
    return blocks[: -(-N // pool.block_size)]


def random_kv(dtype, kv_bits, seed: int) -> mx.array:
    if dtype == mx.bfloat16 and kv_bits is None:  # every bit pattern, NaN payloads included
        bits = np.random.default_rng(seed).integers(0, 1 << 16, (N, HEADS, DIM), dtype=np.uint16)
        return mx.array(bits).view(mx.bfloat16)
    return mx.random.normal((N, HEADS, DIM), key=mx.random.key(seed)).astype(dtype)


def fill(pool: KVPool, table: list[int]) -> None:
    slots = pool.token_slots(table, 0, N)
    for layer in range(LAYERS):
        k, v = (random_kv(pool.dtype, pool.kv_bits, 2 * layer + i) for i in (0, 1))
        pool.write(layer, slots, k, v)
    mx.eval(pool.arrays())


def as_bytes(parts: list[mx.array]) -> list[bytes]:
    return [to_wire(p).tobytes() for p in parts]


def stream(src: KVPool, src_table, dst: KVPool, dst_table, ranges) -> int:
    """Peer side exports and sends every layer of every range; the decoder side receives and
    writes. Returns the payload bytes received."""
    fmt = KVFormat.from_pool(dst, max_tokens=N)
    a, b = socket.socketpair()

    def send():
        with a:
            for t0, t1 in ranges:
                for layer in range(LAYERS):
                    parts = src.read_tokens(layer, src_table, t0, t1)
                    send_frame(a, encode_layer(fmt, "req", 1, layer, t0, t1, parts))

    sender = threading.Thread(target=send)
    sender.start()
    reader = FrameReader(b, BufferPool(4 << 20), kv_format=fmt, stall_timeout=60)
    received = 0
    while (frame := reader.read(idle_timeout=60)) is not None:
        with frame:
            parts = to_mx(decode_layer(frame, fmt), fmt)
            received += frame.payload.nbytes
        dst.write_tokens(frame.msg.layer, dst_table, frame.msg.t0, parts)
        mx.eval(dst.layer_arrays(frame.msg.layer))
    sender.join(60)
    b.close()
    assert reader.buffers.in_use == 0
    return received


CASES = [
    (mx.float32, None),
    (mx.float16, None),
    (mx.bfloat16, None),
    (mx.float16, 8),
    (mx.bfloat16, 4),
]


@pytest.mark.parametrize("dtype,kv_bits", CASES, ids=lambda c: str(c))
def test_export_wire_write_round_trip_is_bit_exact(dtype, kv_bits):
    src, dst = make_pool(16, dtype, kv_bits), make_pool(8, dtype, kv_bits)
    src_table, dst_table = table_for(src, 1), table_for(dst, 2)
    fill(src, src_table)
    # the chunk grid anchored at token 0, clipped to [START, N - 1): unaligned to both block sizes
    ranges = [(max(c, START), min(c + CHUNK, N - 1)) for c in range(0, N - 1, CHUNK)]
    received = stream(src, src_table, dst, dst_table, ranges)

    fmt = KVFormat.from_pool(dst, max_tokens=N)
    assert received == LAYERS * fmt.nbytes(N - 1 - START)  # only [START, N - 1) was sent
    for layer in range(LAYERS):
        want = as_bytes(src.read_tokens(layer, src_table, START, N - 1))
        assert as_bytes(dst.read_tokens(layer, dst_table, START, N - 1)) == want
        # nothing outside the range was touched: the decoder's own tokens stay as they were
        for t0, t1 in ((0, START), (N - 1, N)):
            assert all(not any(b) for b in as_bytes(dst.read_tokens(layer, dst_table, t0, t1)))


def test_rewriting_a_range_is_idempotent_and_overwrites_only_its_slots():
    src, dst = make_pool(16, mx.float16, None), make_pool(8, mx.float16, None)
    src_table, dst_table = table_for(src, 3), table_for(dst, 4)
    fill(src, src_table)
    stream(src, src_table, dst, dst_table, [(10, 40)])
    before = [as_bytes(dst.read_tokens(layer, dst_table, 0, N)) for layer in range(LAYERS)]
    stream(src, src_table, dst, dst_table, [(10, 40)])  # a peer re-sending after its preemption
    assert [as_bytes(dst.read_tokens(layer, dst_table, 0, N)) for layer in range(LAYERS)] == before

    ones = [mx.ones((5, HEADS, DIM), mx.float16)] * 2
    dst.write_tokens(1, dst_table, 20, ones)
    mx.eval(dst.arrays())
    after = as_bytes(dst.read_tokens(1, dst_table, 0, N))
    row = HEADS * DIM * 2
    for part, old in zip(after, before[1], strict=True):
        assert part[: 20 * row] == old[: 20 * row] and part[25 * row :] == old[25 * row :]
        assert np.all(np.frombuffer(part[20 * row : 25 * row], np.float16) == 1)


def test_received_arrays_do_not_alias_the_pooled_buffer():
    fmt = KVFormat(1, 1, 32, 32, "bfloat16", None, 32, 16)
    buf = np.arange(2 * 4 * 32, dtype=np.uint16)
    parts = to_mx([buf[:128].reshape(4, 1, 32), buf[128:].reshape(4, 1, 32)], fmt)
    mx.eval(parts)
    buf[:] = 0  # the buffer goes back to the pool and is reused for the next frame
    assert parts[0].dtype == mx.bfloat16
    assert np.array_equal(np.asarray(parts[0].view(mx.uint16)).ravel(), np.arange(128))


def test_to_wire_makes_parts_contiguous_and_little_endian():
    fmt = KVFormat(1, 2, 32, 32, "float32", None, 32, 16)
    k = np.arange(4 * 2 * 64, dtype=">f4").reshape(4, 2, 64)[:, :, ::2]  # strided, big-endian
    v = mx.arange(4 * 2 * 32, dtype=mx.float32).reshape(2, 4, 32).transpose(1, 0, 2)
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, encode_layer(fmt, "r", 1, 0, 0, 4, [k, v]))  # small: fits the socket buffer
        with FrameReader(b, BufferPool(1 << 16), kv_format=fmt).read(idle_timeout=60) as frame:
            got = decode_layer(frame, fmt)
            assert np.array_equal(got[0], k) and np.array_equal(got[1], np.asarray(v))


def test_bad_writes_are_refused():
    pool = make_pool(16, mx.float16, 8)
    table = [3, 4]
    parts = pool.read_tokens(0, table, 0, 10)
    with pytest.raises(ValueError, match="does not cover"):
        pool.write_tokens(0, table, 30, parts)
    with pytest.raises(ValueError, match="outside"):
        pool.write_tokens(0, [0, 4], 0, parts)  # the null block is never a destination
    with pytest.raises(ValueError, match="outside"):
        pool.write_tokens(0, [pool.num_blocks], 0, parts)
    with pytest.raises(ValueError, match="does not fit"):
        pool.write_tokens(0, table, 0, [p.astype(mx.float32) for p in parts])
    with pytest.raises(ValueError, match="KV parts"):
        pool.write_tokens(0, table, 0, parts[:3])

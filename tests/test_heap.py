"""Memory that malloc holds free goes back to the system after a long prompt (mlx_engine/heap.py):
bench/soak.py's server grew ~150 MB at every 2 MB prompt, in glibc's heaps, with nothing more in
use."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import mlx.core as mx
import pytest

from mlx_engine import heap
from mlx_engine.engine.inputs import InputProcessor
from mlx_engine.errors import ContextLengthError
from mlx_engine.loading.resolve import bundled_model_path
from mlx_engine.request import GenerationRequest
from mlx_engine.tokenization.gguf_tokenizer import tokenizer_from_gguf
from mlx_engine.tokenization.reply_memory import ReplyMemory


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._malloc_trim() is None, reason="glibc only")
def test_free_memory_pinned_by_a_live_block_goes_back():
    """What a tokenizer frees below a block still in use stays resident until ``release_free``:
    glibc gives back only the top of a heap."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    blocks = [libc.malloc(1000) for _ in range(150_000)]  # ~150 MB of small blocks
    for b in blocks:
        ctypes.memset(b, 1, 1000)  # resident
    pin = libc.malloc(1000)  # above them, in use: the heap's top cannot shrink past it
    for b in blocks:
        libc.free(b)
    held = rss_mb()
    assert heap.release_free()
    released = held - rss_mb()
    libc.free(pin)
    assert released > 100, f"{released:.0f} MB released"


@pytest.fixture(scope="module")
def inputs() -> InputProcessor:
    _, md = mx.load(str(bundled_model_path()), return_metadata=True)
    tok = tokenizer_from_gguf(md)
    return InputProcessor(tok, ReplyMemory(), context_length=8192, kv_tokens=8192 * 4)


@pytest.mark.parametrize("chat", [False, True])
def test_a_long_prompt_is_followed_by_a_release(inputs, monkeypatch, chat):
    """After a prompt of RELEASE_AFTER_TOKENS tokens or more, refused or not; none after a short one."""
    calls = []
    monkeypatch.setattr(heap, "release_free", lambda: calls.append(1) or True)

    def request(text: str) -> GenerationRequest:
        if chat:
            return GenerationRequest(messages=[{"role": "user", "content": text}])
        return GenerationRequest(prompt=text)

    inputs.prompt_ids(request("river stone light garden"))
    assert calls == []
    long = " ".join(["river stone light garden"] * (heap.RELEASE_AFTER_TOKENS // 2))
    with pytest.raises(ContextLengthError):
        inputs.prompt_ids(request(long))
    assert calls == [1]


def test_load_model_gives_back_what_compacting_the_scales_freed(monkeypatch):
    """On the CPU the load releases malloc's free memory after the kernel layers' scale passes (their
    float32 scales and biases, replaced, would otherwise stay resident: the synthetic 1B Q8_0 model
    held 1622 MB after its load, 1290 MB after a release)."""
    import cpu_kernels.scales
    from mlx_engine.loading import loader

    events: list[str] = []
    half = cpu_kernels.scales.half_scales
    monkeypatch.setattr(cpu_kernels.scales, "half_scales", lambda m: events.append("half") or half(m))
    monkeypatch.setattr(heap, "release_free", lambda: events.append("release") or True)
    loader.load_model(None)
    if loader.backend_name() == "cpu":
        assert events == ["half", "release"]

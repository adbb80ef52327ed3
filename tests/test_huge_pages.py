"""The loaded model's weights on 2 MiB pages (mlx_engine/huge_pages.py): asked for, data unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_engine import huge_pages

linux_thp = pytest.mark.skipif(
    huge_pages.thp_mode() not in ("always", "madvise"),
    reason="transparent huge pages are Linux's, and this kernel has them off (or none)",
)


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@linux_thp
def test_weights_are_marked_for_huge_pages_and_keep_their_values() -> None:
    a = mx.random.normal((4096, 2048))  # 32 MiB
    mx.eval(a)
    before = np.array(a)
    advised = huge_pages.use_huge_pages([a, mx.zeros((16,))])  # a small array is left alone
    assert advised >= 28 << 20  # all but the unaligned ends of the buffer
    view = np.asarray(memoryview(a))
    middle = view.ctypes.data + a.nbytes // 2
    entry = _smaps_entry(middle)
    assert entry.get("THPeligible") == "1"
    np.testing.assert_array_equal(np.array(a), before)
    assert mx.array_equal(a @ mx.ones((2048,)), mx.array(before) @ mx.ones((2048,))).item()


@linux_thp
def test_a_strided_view_is_left_alone() -> None:
    a = mx.random.normal((2048, 2048))
    mx.eval(a)
    assert huge_pages.use_huge_pages([a[:, ::2]]) == 0


def test_nothing_is_asked_where_thp_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_MODE", mode)
    a = mx.zeros((4096, 2048))
    mx.eval(a)
    expected = None if not sys.platform.startswith("linux") else "never"
    assert huge_pages.thp_mode() == expected
    assert huge_pages.use_huge_pages([a]) == 0


@linux_thp
def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUET_HUGE_PAGES", "0")
    a = mx.zeros((4096, 2048))
    mx.eval(a)
    assert huge_pages.use_huge_pages([a]) == 0


@pytest.mark.skipif(huge_pages.thp_mode() != "madvise", reason="the mark is only undone where THP is madvise")
def test_an_unloaded_models_buffers_lose_the_mark() -> None:
    """A server unloading a model takes the mark off its buffers (app/server/registry.py), so heap
    ranges reused by small allocations take 4 KiB pages again."""
    a = mx.random.normal((4096, 2048))
    mx.eval(a)
    assert huge_pages.use_huge_pages([a]) > 0
    middle = np.asarray(memoryview(a)).ctypes.data + a.nbytes // 2  # type: ignore[arg-type]
    assert _smaps_entry(middle).get("THPeligible") == "1"
    assert huge_pages.release_huge_pages([a]) >= 28 << 20
    assert _smaps_entry(middle).get("THPeligible") == "0"


@linux_thp
def test_a_background_move_returns_at_once_and_an_unload_waits_for_it() -> None:
    """The engine's way (``background=True``): the call marks the buffers and returns while a thread
    of its own moves them; the values never change; ``release_huge_pages`` (a server unloading the
    model) returns only once that thread is done, so no collapse outlives the unload."""
    arrays = [mx.random.normal((4096, 2048)) for _ in range(3)]  # 3 x 32 MiB
    mx.eval(*arrays)
    before = [np.array(a) for a in arrays]
    advised = huge_pages.use_huge_pages(arrays, background=True)
    assert advised >= 3 * (28 << 20)
    middles = [np.asarray(memoryview(a)).ctypes.data + a.nbytes // 2 for a in arrays]  # type: ignore[arg-type]
    assert all(_smaps_entry(m).get("THPeligible") == "1" for m in middles)  # marked before it returned
    total = mx.sum(arrays[0]).item()  # the buffers stay readable while they move
    huge_pages.wait_for_huge_pages()
    assert not any(t.is_alive() for t in huge_pages._collapses)
    for a, b in zip(arrays, before, strict=True):
        np.testing.assert_array_equal(np.array(a), b)
    assert mx.sum(arrays[0]).item() == total
    fresh = mx.random.normal((32768, 2048))  # 256 MiB on small pages: a move of a good fraction of a second
    mx.eval(fresh)
    moved = huge_pages.use_huge_pages([fresh], background=True)
    assert moved >= 250 << 20
    if huge_pages.thp_mode() == "madvise":
        assert huge_pages.release_huge_pages([fresh]) >= 250 << 20
        assert not any(t.is_alive() for t in huge_pages._collapses)  # it waited for the move


@linux_thp
def test_the_engine_moves_its_weights_itself() -> None:
    """``Engine.load`` asks the loader for no move (it would copy arrays the panel layout replaces)
    and moves every weight of the model as the engine keeps it, in the background."""
    from mlx_engine.config import EngineConfig
    from mlx_engine.engine.api import Engine
    from mlx_engine.mlx_tree import flat_parameters

    engine = Engine.load(None, config=EngineConfig(speculative="off"))
    try:
        huge_pages.wait_for_huge_pages()
        big = max((v for _, v in flat_parameters(engine.loaded.model)), key=lambda v: v.nbytes)
        middle = np.asarray(memoryview(big)).ctypes.data + big.nbytes // 2  # type: ignore[arg-type]
        assert _smaps_entry(middle).get("THPeligible") == "1"
    finally:
        engine.shutdown()

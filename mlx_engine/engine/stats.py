"""``Engine.stats()``'s snapshot: what the engine holds and has done, read on the worker between
two steps (``engine_stats``), so every field describes the same moment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlx_engine.backend import backend_name
from mlx_engine.blas import active_blas
from mlx_engine.engine.build import kernel_math
from mlx_engine.loading.cpu_layout import panel_types

if TYPE_CHECKING:
    from mlx_engine.engine.core import EngineCore


@dataclass
class EngineStats:
    model: str
    backend: str
    blas: str
    weight_format: str
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_bytes: int
    kv_bits: int | None
    kv_format: str  # what a KV element is stored as: "float16", "8-bit", ...
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    steps: int
    loading: int = 0  # sequences whose KV is arriving from a KV source
    kv_loads: int = 0  # loads started (disk and remote)
    kv_load_failures: int = 0  # loads that ended early (their landed prefix was kept)
    kv_bytes_loaded: int = 0  # KV bytes applied from loads
    remote_prefills: int = 0  # requests that got prompt KV from a remote source
    kv_frames_dropped: int = 0  # arriving layer ranges of dead loads (cancelled, failed, finished)
    # one KV block, every layer (and a draft model's): kv_blocks_total of them is the budget
    kv_block_bytes: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def fixed_stats(engine: Any, core: EngineCore) -> dict[str, Any]:
    """The fields that do not change while the engine runs (read once: describing the BLAS alone
    takes ~0.2 ms)."""
    pool = core.pool
    return dict(
        model=engine.model_name,
        backend=backend_name(),
        blas=active_blas(),
        weight_format=_with_math(
            engine.loaded.weight_format, kernel_math(engine.loaded), panel_types(engine.loaded.model)
        ),
        kv_blocks_total=core.allocator.num_blocks - 1,
        kv_block_bytes=core.block_bytes,
        kv_bits=engine.config.kv_bits,
        kv_format=f"{pool.kv_bits}-bit" if pool.kv_bits else str(pool.dtype).rsplit(".", 1)[-1],
    )


def _with_math(weight_format: str, cpu_math: str | None, panels: list[str]) -> str:
    """The weight format, how the CPU kernels multiply the weights when it is not the default math,
    and the quant types they read in the panel layout."""
    if cpu_math is None:
        return weight_format
    return (
        weight_format
        + next((f", {m} activations" for m in ("int8", "int16") if cpu_math.startswith(m)), "")
        + (f", {_and_list(panels)} in 16-row panels" if panels else "")
    )


def _and_list(names: list[str]) -> str:
    """'A', 'A and B', 'A, B and C'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def engine_stats(fixed: dict[str, Any], core: EngineCore) -> EngineStats:
    """The snapshot (worker thread only: it reads the scheduler's and the allocator's state)."""
    a, s, pool = core.allocator, core.scheduler, core.pool
    return EngineStats(
        **fixed,
        kv_bytes=pool.max_nbytes // pool.num_blocks * pool.capacity,  # the pool grows: pool.nbytes, cheaply
        running=len(s.running),
        waiting=len(s.waiting),
        kv_blocks_used=a.num_used,
        kv_blocks_cached=a.num_cached,
        prefix_query_tokens=s.prefix_query_tokens,
        prefix_hit_tokens=s.prefix_hit_tokens,
        preemptions=s.preemptions,
        steps=core.steps,
        loading=len(s.loading),
        kv_loads=s.loads_started,
        kv_load_failures=s.loads_failed,
        kv_bytes_loaded=core.kv.bytes_loaded,
        remote_prefills=core.remote_prefills,
        kv_frames_dropped=core.kv.frames_dropped,
    )

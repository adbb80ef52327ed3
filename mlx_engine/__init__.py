"""Duet's MLX inference engine.

    from mlx_engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    with Engine.load(None) as engine:  # None: the bundled model
        ...

Importing this package first loads the system OpenBLAS (Linux) so that MLX, imported after it,
binds its BLAS calls there instead of the `mlx[cpu]` wheel's reference BLAS (see `blas.py`).
`Engine`, `EngineConfig` and `EngineStats` are imported on first use (they import MLX); the
request vocabulary and the errors are plain Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_engine.blas_preload import preload_openblas

preload_openblas()  # before anything imports mlx: libmlx binds cblas_* when it loads

from mlx_engine.errors import (  # noqa: E402
    ConfigError,
    ContextLengthError,
    DuetError,
    EngineShutDownError,
    GGUFError,
    ModelLoadError,
    ModelNotFoundError,
    QueueFullError,
    RequestError,
    TemplateError,
)
from mlx_engine.request import GenerationEvent, GenerationRequest, SamplingParams, TokenLogprob, Usage  # noqa: E402

if TYPE_CHECKING:
    from mlx_engine.engine import Engine, EngineConfig, EngineStats

__version__ = "0.1.0"

_LAZY = {"Engine": "engine", "EngineConfig": "engine", "EngineStats": "engine"}

__all__ = [
    "ConfigError",
    "ContextLengthError",
    "DuetError",
    "Engine",
    "EngineConfig",
    "EngineShutDownError",
    "EngineStats",
    "GGUFError",
    "GenerationEvent",
    "GenerationRequest",
    "ModelLoadError",
    "ModelNotFoundError",
    "QueueFullError",
    "RequestError",
    "SamplingParams",
    "TemplateError",
    "TokenLogprob",
    "Usage",
]


def __getattr__(name: str) -> Any:  # PEP 562: the engine (and MLX) load on first use
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

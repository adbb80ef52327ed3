"""Check a model before loading it: it resolves, and the files loading reads first are sound.

No weights are read, so front ends run ``check_model`` before anything slow and a bad
``--model`` is a one-line error at once: ``ModelNotFoundError`` (no such file, directory or
cached repo), ``GGUFError`` (not a GGUF file, truncated, corrupt, unsupported tensor types) or
``ModelLoadError`` (a model directory whose config.json is unreadable or names an architecture
mlx-lm cannot build).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from mlx_engine.errors import ModelLoadError
from mlx_engine.loading.resolve import ModelSource, resolve_model


def check_context(src: ModelSource, asked: int | None) -> None:
    """A ``--context-length`` past what the model's RoPE reaches is refused before any weight is
    read (``mlx_engine.context_length.check_context_length``; the engine checks again with the built model)."""
    if asked is None:
        return
    from mlx_engine.context_length import check_context_length, declared_context, gguf_declared_context

    if src.kind == "gguf":
        from mlx_engine.loading.gguf_file import read_gguf

        trained, scaling = gguf_declared_context(read_gguf(src.path).metadata)
    else:
        try:
            trained, scaling = declared_context(json.loads((src.path / "config.json").read_text()))
        except (OSError, ValueError):
            return
    if trained:
        check_context_length(asked, trained, scaling, src.name)


def check_model(spec: str | os.PathLike | None) -> ModelSource:
    """Resolve ``spec`` (None: the bundled model) and check its files; returns where it is."""
    src = resolve_model(spec)
    if src.kind == "gguf":
        from mlx_engine.loading.gguf_file import read_tensor_table

        read_tensor_table(src.path)
    else:
        _check_hf_dir(src.path)
    return src


def _check_hf_dir(path: Path) -> None:
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {config_path}: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{config_path} names no model_type, so the architecture is unknown")
    model_type = config["model_type"]
    if not _mlx_lm_builds(config):
        raise ModelLoadError(f"unsupported architecture {model_type!r} in {path}: mlx-lm has no model for it")


def _has_module(model_type: str) -> bool:
    if not model_type.isidentifier():
        return False
    from mlx_engine.loading import mlx_lm_lazy

    mlx_lm_lazy.install()  # find_spec imports the parent packages: not mlx_lm/__init__ (transformers)
    return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None


def _mlx_lm_builds(config: dict) -> bool:
    """Whether mlx-lm has a model class for this config (its own lookup, without importing it)."""
    model_type = config["model_type"]
    if _has_module(model_type):
        return True
    from mlx_lm import utils  # its remapping tables (e.g. a model type another module builds)

    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    by_architecture = getattr(utils, "MODEL_ARCHITECTURE_REMAPPING", {})
    remapped = [by_architecture.get((model_type, a)) for a in architectures]
    remapped.append(getattr(utils, "MODEL_REMAPPING", {}).get(model_type))
    return any(isinstance(m, str) and _has_module(m) for m in remapped)

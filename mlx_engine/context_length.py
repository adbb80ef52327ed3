"""How long a context an engine may run a model at (``EngineConfig.context_length``, ``-c``).

Less than the model's own is always allowed (it bounds the KV cache a sequence can take, so the
budget the engine plans shrinks with it). More is allowed only as far as the model's RoPE scaling
reaches: a YaRN, linear or dynamic factor over the original context (Qwen3's 32K x 4 = 128K), as
the model's config or GGUF metadata declares it. Past that the positions were never seen in
training and replies fall apart, so it is refused with a clear error instead of a warning.
"""

from __future__ import annotations

from typing import Any

from mlx_engine.errors import ConfigError

_SCALED = ("yarn", "linear", "dynamic", "longrope", "su", "llama3")


def _rope_scaling(model: Any) -> dict[str, Any] | None:
    args = getattr(model, "args", None)
    scaling = getattr(args, "rope_scaling", None) or getattr(args, "rope_parameters", None)
    return scaling if isinstance(scaling, dict) else None


def scaled_context(trained: int, scaling: dict[str, Any] | None) -> tuple[int, str | None]:
    """The longest context ``scaling`` allows for a model trained for ``trained`` tokens, and how
    (None: no scaling, the trained context is the limit)."""
    if not scaling:
        return trained, None
    kind = str(scaling.get("rope_type") or scaling.get("type") or "")
    factor = scaling.get("factor")
    if kind not in _SCALED or not isinstance(factor, int | float) or factor <= 1:
        return trained, None
    original = scaling.get("original_max_position_embeddings") or trained
    return max(trained, int(original * factor)), f"{kind} RoPE scaling x{factor:g} over {original}"


def check_context_length(asked: int | None, trained: int, scaling: dict[str, Any] | None, name: str) -> int:
    """``asked`` (None: the model's own ``trained``), checked against what ``scaling`` allows."""
    if asked is None:
        return trained
    limit, how = scaled_context(trained, scaling)
    if asked > limit:
        reach = f"its {how} reaches {limit}" if how else "it has no RoPE scaling to reach further"
        raise ConfigError(
            f"context length {asked} is more than {name} can attend over: it was trained for {trained} "
            f"tokens and {reach}; use at most {limit}",
            "context_length",
        )
    return asked


def context_length(asked: int | None, trained: int, model: Any, name: str) -> int:
    """``check_context_length`` with the loaded model's own RoPE scaling."""
    return check_context_length(asked, trained, _rope_scaling(model), name)


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def declared_context(config: dict[str, Any]) -> tuple[int | None, dict[str, Any] | None]:
    """The trained context and the RoPE scaling an HF ``config.json`` declares (or its
    ``text_config``'s), without building the model."""
    for c in (config, config.get("text_config") or {}):
        if not isinstance(c, dict):
            continue
        for key in CONTEXT_KEYS:
            if isinstance(c.get(key), int):
                scaling = c.get("rope_scaling") or c.get("rope_parameters")
                return int(c[key]), scaling if isinstance(scaling, dict) else None
    return None, None


def gguf_declared_context(metadata: dict[str, Any]) -> tuple[int | None, dict[str, Any] | None]:
    """The same from a GGUF's metadata: ``<arch>.context_length`` and ``<arch>.rope.scaling.*``."""
    arch = metadata.get("general.architecture")
    trained = metadata.get(f"{arch}.context_length")
    if not isinstance(trained, int):
        return None, None
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if not kind or kind == "none" or not isinstance(factor, int | float):
        return trained, None
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(factor)}
    if isinstance(original, int) and original > 0:
        scaling["original_max_position_embeddings"] = original
    return trained, scaling

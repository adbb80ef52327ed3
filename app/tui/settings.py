"""Sampling settings the user edits in the chat (settings screen and slash commands).

The defaults are the shared ones of every front end (`mlx_engine.defaults`, Ollama's set).
``max_tokens`` None is "auto": the reply runs until the model stops or the context is full.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from mlx_engine import defaults
from mlx_engine.request import RequestError, SamplingParams

# name -> (type, alias used by slash commands)
FIELDS = {
    "temperature": (float, "temp"),
    "top_p": (float, "top_p"),
    "top_k": (int, "top_k"),
    "min_p": (float, "min_p"),
    "max_tokens": (int, "max"),
    "seed": (int, "seed"),
}
ALIASES = {alias: name for name, (_, alias) in FIELDS.items()}

# What each optional field accepts for "not set", and how it is shown.
_UNSET_WORDS = {"seed": ("", "none", "off", "random"), "max_tokens": ("", "auto", "none", "off")}
UNSET_LABEL = {"seed": "random", "max_tokens": "auto"}


@dataclass(frozen=True)
class Sampling:
    temperature: float = defaults.TEMPERATURE
    top_p: float = defaults.TOP_P
    top_k: int = defaults.TOP_K
    min_p: float = defaults.MIN_P
    max_tokens: int | None = defaults.MAX_TOKENS  # None: auto, until EOS or the context is full
    seed: int | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=defaults.REPETITION_PENALTY,
            seed=self.seed,
        )

    def validate(self) -> None:
        self.params().validate()
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise RequestError(
                "max_tokens must be a positive integer, or auto (until the model stops)", "max_tokens"
            )

    def with_value(self, name: str, text: str) -> Sampling:
        """A copy with one field parsed from text; raises ValueError with a readable message."""
        name = ALIASES.get(name, name)
        if name not in FIELDS:
            raise ValueError(f"unknown setting {name!r}; one of: {', '.join(FIELDS)}")
        kind = FIELDS[name][0]
        text = text.strip()
        value: int | float | None
        if text.lower() in _UNSET_WORDS.get(name, ()):
            value = None
        else:
            try:
                value = kind(text)
            except ValueError:
                raise ValueError(
                    f"{name} needs {'an integer' if kind is int else 'a number'}, not {text!r}"
                ) from None
        changes: dict[str, Any] = {name: value}
        new = replace(self, **changes)
        new.validate()  # RequestError is a ValueError
        return new

    def shown(self, name: str) -> str:
        """A field as the user reads and types it ("auto" for max_tokens None, "random" for seed None)."""
        value = getattr(self, name)
        return (
            UNSET_LABEL[name] if value is None else f"{value:g}" if isinstance(value, float) else str(value)
        )

    def summary(self) -> str:
        return (
            f"temp {self.shown('temperature')} · top-p {self.shown('top_p')} · top-k {self.top_k} · "
            f"min-p {self.shown('min_p')} · max {self.shown('max_tokens')} · seed {self.shown('seed')}"
        )


def field_names() -> list[str]:
    return [f.name for f in fields(Sampling)]

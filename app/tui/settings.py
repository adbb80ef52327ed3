"""Sampling settings the user edits in the chat (settings screen and slash commands)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.05
    max_tokens: int = 1024
    seed: int | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed
        )

    def validate(self) -> None:
        self.params().validate()
        if self.max_tokens <= 0:
            raise RequestError("max_tokens must be a positive integer", "max_tokens")

    def with_value(self, name: str, text: str) -> Sampling:
        """A copy with one field parsed from text; raises ValueError with a readable message."""
        name = ALIASES.get(name, name)
        if name not in FIELDS:
            raise ValueError(f"unknown setting {name!r}; one of: {', '.join(FIELDS)}")
        kind = FIELDS[name][0]
        text = text.strip()
        if name == "seed" and text.lower() in ("", "none", "off", "random"):
            value = None
        else:
            try:
                value = kind(text)
            except ValueError:
                raise ValueError(
                    f"{name} needs {'an integer' if kind is int else 'a number'}, not {text!r}"
                ) from None
        new = replace(self, **{name: value})
        new.validate()  # RequestError is a ValueError
        return new

    def summary(self) -> str:
        seed = "random" if self.seed is None else str(self.seed)
        return (
            f"temp {self.temperature:g} · top-p {self.top_p:g} · top-k {self.top_k} · min-p {self.min_p:g} · "
            f"max {self.max_tokens} · seed {seed}"
        )


def field_names() -> list[str]:
    return [f.name for f in fields(Sampling)]

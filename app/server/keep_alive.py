"""Keep-alive durations as Ollama takes them (``keep_alive``, ``OLLAMA_KEEP_ALIVE``) and LM Studio
(``ttl``): seconds as a number, or a Go duration string ("5m", "1h30m", "250ms", "0", "-1");
negative keeps a model loaded for ever. No server imports here: ``duet serve``'s option check
uses it before FastAPI is imported."""

from __future__ import annotations

from typing import Any

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any, param: str = "keep_alive") -> float | None:
    """Seconds (None: for ever). ValueError naming ``param`` for anything else."""
    if isinstance(value, bool) or value is None or value == "":
        raise ValueError(f"{param} must be a duration like '5m' or a number of seconds")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _duration(text, param)
    if seconds != seconds:  # NaN
        raise ValueError(f"{param} must be a duration like '5m' or a number of seconds")
    return None if seconds < 0 else seconds


def _duration(text: str, param: str) -> float:
    """A Go duration: a sign, then number+unit pairs ("1h30m", "-1m", "250ms")."""
    sign = -1.0 if text.startswith("-") else 1.0
    rest, total = text.lstrip("+-"), 0.0
    if not rest:
        raise ValueError(f"{param} {text!r} is not a duration (e.g. '5m', '1h', '30s', '-1')")
    while rest:
        i = 0
        while i < len(rest) and (rest[i].isdigit() or rest[i] == "."):
            i += 1
        j = i
        while j < len(rest) and rest[j].isalpha():
            j += 1
        number, unit = rest[:i], rest[i:j]
        if not number or unit not in _UNITS:
            raise ValueError(f"{param} {text!r} is not a duration (e.g. '5m', '1h', '30s', '-1')")
        try:
            total += float(number) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"{param} {text!r} is not a duration (e.g. '5m', '1h', '30s', '-1')") from None
        rest = rest[j:]
    return sign * total

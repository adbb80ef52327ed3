"""Every error the engine raises on purpose, under one base class.

Callers (the CLI, the server, the TUI, library users) catch ``DuetError`` and show its message: each
message is one line that says what is wrong and, where there is one, what to do about it. Code that
needs to tell kinds apart checks the class, never the message text.

    DuetError
    ├── ConfigError          bad engine or command options (checked before a model loads)
    ├── ModelLoadError       a model that cannot be found, read or built
    │   ├── ModelNotFoundError   no such file, directory or cached repo
    │   └── GGUFError            a GGUF file that is malformed or unsupported
    ├── RequestError         a request the engine refuses (``param`` names the field)
    │   ├── ContextLengthError   the prompt does not fit the context or the KV cache
    │   └── TemplateError        the chat template failed on these messages
    ├── QueueFullError       too many requests waiting: retry later
    └── EngineShutDownError  the engine was shut down
"""

from __future__ import annotations


class DuetError(Exception):
    """Base of every error Duet raises on purpose. ``str(e)`` is a one-line, user-facing message."""


class ConfigError(DuetError, ValueError):
    """An engine or command option that cannot work (checked before anything is loaded)."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


class ModelLoadError(DuetError, ValueError):
    """A model that cannot be loaded: unsupported architecture, missing files, bad weights."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """No model at that path, and no such repo in the cache (or downloads are off)."""


class GGUFError(ModelLoadError):
    """A GGUF file that is malformed, truncated or uses an unsupported tensor type."""


class RequestError(DuetError, ValueError):
    """A request the engine refuses: the message says what is wrong and ``param`` which field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """The prompt (plus what must be generated) does not fit the model's context or the KV cache."""


class TemplateError(RequestError):
    """The model's chat template could not render these messages."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, param)


class QueueFullError(DuetError, RuntimeError):
    """The engine's request queue is full: try again shortly."""


class EngineShutDownError(DuetError, RuntimeError):
    """The engine has been shut down and takes no more requests."""


__all__ = [
    "ConfigError",
    "ContextLengthError",
    "DuetError",
    "EngineShutDownError",
    "GGUFError",
    "ModelLoadError",
    "ModelNotFoundError",
    "QueueFullError",
    "RequestError",
    "TemplateError",
]

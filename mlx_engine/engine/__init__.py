"""The engine: ``Engine`` (``api.py``) runs an ``EngineCore`` (``core.py``) on a worker thread.

    api.py         Engine: the public methods, the worker thread and its mailbox
    messages.py    the mailbox's vocabulary and the KV sink sources post through
    core.py        EngineCore.step(): schedule, apply arriving KV, run the model, sample; no threads
    inputs.py      a request prepared once: checks, prompt ids, its sequence
    outputs.py     tokens to events: detokenizer, stops, logprobs, usage, reply memory
    kv_transfer.py KV arriving from sources, and exports to a decoder elsewhere
    build.py       the KV budget to pools, allocator, draft pool and disk tier

See docs/architecture.md for how they fit together.
"""

from mlx_engine.config import EngineConfig
from mlx_engine.engine.api import Engine, EngineStats
from mlx_engine.engine.core import EngineCore
from mlx_engine.errors import QueueFullError, RequestError

__all__ = ["Engine", "EngineConfig", "EngineCore", "EngineStats", "QueueFullError", "RequestError"]

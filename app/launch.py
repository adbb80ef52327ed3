"""The one place an engine is built from options: the model, an ``EngineConfig`` and, optionally,
the prefill peers to attach. ``duet generate`` / ``chat`` / ``serve`` (``app/cli.py``), the chat's
model switch (``app/tui/backends.py``) and ``duet peer serve`` (``app/commands/peer.py``) all call
``build_engine``; a failure after the model loaded (a peer that cannot be attached) shuts the engine
down again, so nothing is left running."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_engine.config import EngineConfig
    from mlx_engine.engine import Engine
    from peer.attach import PeerSpec


def build_engine(model: str | None, config: EngineConfig, peers: PeerSpec | None = None) -> Engine:
    """Load ``model`` (None: the bundled one) with ``config``; attach ``peers`` before the first
    request (their HELLO exchanges are not part of anyone's time to first token)."""
    from mlx_engine.engine import Engine

    engine = Engine.load(model, config=config)
    try:
        if peers is not None:
            from peer.attach import attach_peers

            attach_peers(engine, peers)
    except BaseException:
        engine.shutdown()
        raise
    return engine

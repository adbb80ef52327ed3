"""The sampling defaults every front end uses when the user sets nothing: CLI, chat, server, library.

They are Ollama's documented model defaults (temperature 0.8, top_k 40, top_p 0.9, min_p 0,
num_predict -1 = until the model stops or the context is full), so a model behaves in Duet as it does
in `ollama run`. One deliberate difference: Ollama's repeat_penalty 1.1 over the last 64 tokens is
left off (1.0), because Duet's repetition penalty spans the whole prompt, chat-template markup
included, and would push the model away from its own end-of-turn token.
"""

from __future__ import annotations

TEMPERATURE = 0.8
TOP_P = 0.9
TOP_K = 40
MIN_P = 0.0
REPETITION_PENALTY = 1.0
MAX_TOKENS: int | None = None  # None: until EOS, a stop, or the context is full

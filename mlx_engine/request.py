"""What a caller asks the engine for, and what it gets back.

These dataclasses are the Engine API's vocabulary: the server, the TUI, the CLI
and the peer layer all speak in them. Nothing here touches MLX.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mlx_engine import defaults
from mlx_engine.errors import DuetError, RequestError
from mlx_engine.tokenization.reply_parser import ToolParsing
from mlx_engine.tokenization.tool_calls import ParsedToolCall

if TYPE_CHECKING:
    import numpy as np

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs. ``temperature == 0`` means greedy.

    The defaults are Duet's one set for every front end (``mlx_engine/defaults.py``, Ollama's)."""

    temperature: float = defaults.TEMPERATURE
    top_k: int = defaults.TOP_K  # 0 = off
    top_p: float = defaults.TOP_P  # 1 = off
    min_p: float = defaults.MIN_P  # 0 = off
    repetition_penalty: float = defaults.REPETITION_PENALTY  # 1 = off; CTRL-style over prompt + output
    presence_penalty: float = 0.0  # OpenAI-style over output tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position (0..20)

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str, param: str) -> RequestError:
            return RequestError(msg, param)

        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature must be a finite number >= 0", "temperature")
        if self.top_k < 0:
            raise bad("top_k must be >= 0 (0 disables it)", "top_k")
        if not 0 < self.top_p <= 1:
            raise bad("top_p must be in (0, 1]", "top_p")
        if not 0 <= self.min_p < 1:
            raise bad("min_p must be in [0, 1)", "min_p")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty must be > 0", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not -2 <= v <= 2:
                raise bad(f"{name} must be in [-2, 2]", name)
        if not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs must be in [0, 20]", "top_logprobs")
        if self.logit_bias:
            for tok, b in self.logit_bias.items():
                if vocab_size is not None and not 0 <= int(tok) < vocab_size:
                    raise bad(
                        f"logit_bias token id {tok} is outside the vocabulary (0..{vocab_size - 1})",
                        "logit_bias",
                    )
                if not math.isfinite(b) or not -100 <= b <= 100:
                    raise bad("logit_bias values must be in [-100, 100]", "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Constraint(Protocol):
    """Constrained decoding (grammars, JSON schema, forced tool calls).

    The engine asks for the allowed-token mask before each sampled token and
    reports the token it chose. ``None`` from ``allowed_tokens`` means no limit.
    """

    def allowed_tokens(self) -> np.ndarray | None:  # bool array of shape (vocab,), or None
        ...

    def accept(self, token_id: int) -> None: ...

    def is_finished(self) -> bool: ...


@dataclass
class GenerationRequest:
    """One completion. Give exactly one of ``prompt`` (text or token ids) or ``messages``.

    ``max_tokens`` None (the default) generates until the model stops (EOS or a stop) or the
    context is full."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = defaults.MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    tools: list[dict] | None = None  # passed to the chat template
    constraint: Constraint | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    # Another choice of the same prompt (``n > 1``): the id of the request whose prompt KV this
    # one shares, copy-on-write, instead of computing the prompt again. Ignored when that
    # request is not running or its prompt differs.
    fork_of: str | None = None
    # The client request this one is part of (its prompts x n choices share it; None: the one
    # ``fork_of`` names, else itself). The scheduler serves groups round-robin, so one client's
    # many sequences cannot starve another client's one.
    group: str | None = None
    # Prefix-cache isolation: cached prompt blocks are shared only between requests with the same
    # salt (None: the common, unsalted cache). See docs/architecture.md, "Prefix cache".
    cache_salt: str | None = None
    # The reply's thinking apart from its answer (GenerationEvent.reasoning) when the model marks it
    # (mlx_engine/tokenization/reasoning.py); False: everything in ``text``, markers and all
    split_reasoning: bool = True
    # Tools were offered: the reply's calls, in the model family's syntax, come apart from its
    # text (GenerationEvent.tool_calls); None: the text is all answer
    tool_parsing: ToolParsing | None = None
    # Extra variables for the chat template (``chat_template_kwargs``, ``enable_thinking``,
    # ``reasoning_effort``); the names the renderer sets itself cannot be overridden
    template_kwargs: dict[str, Any] | None = None
    # The most tokens the thinking section may take (its markers included): once spent, the
    # engine writes the family's end marker and the answer follows (llama.cpp's
    # --reasoning-budget, Anthropic's budget_tokens); None: no cap
    thinking_budget: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the token's text piece (may be a partial UTF-8 sequence, shown with replacement chars)
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token_id, piece, logprob), best first


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    ttft_s: float = 0.0  # submit -> first token
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    prefill_location: str = "local"  # "local", or "remote:<peer>" when a peer sent prompt KV
    prompt_tokens_computed: int = 0  # prompt tokens this engine computed itself (recomputes included)
    remote_tokens: int = 0  # prompt tokens whose KV a remote peer sent (landed in every layer)
    remote_bytes: int = 0  # KV bytes applied from remote loads
    remote_wait_s: float = 0.0  # from starting the remote load(s) to their end
    remote_compute_s: float = 0.0  # the peer's own compute time, as it reported it
    fallback_reason: str | None = None  # why a KV load ended early (the rest was computed locally)
    prefill_exact: bool | None = None  # remote KV bit-exact with local prefill (None: nothing remote)
    # speculative decoding: proposed tokens verified, and how many of them were kept (None: off)
    speculative: dict[str, int] | None = None
    reasoning_tokens: int = 0  # completion tokens inside the thinking section (markers included)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class GenerationEvent:
    """A step of output for one request. The last event has ``finish_reason`` and ``usage`` set."""

    request_id: str
    text: str = ""  # the answer's text (without the thinking, when it is split out)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # one of FINISH_REASONS on the last event
    usage: Usage | None = None
    error: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # The error's kind (e.g. EngineShutDownError), for callers that tell kinds apart without
    # reading the message; None for an unexpected failure.
    error_type: type[DuetError] | None = None
    reasoning: str = ""  # the thinking section's text (GenerationRequest.split_reasoning)
    tool_calls: list[ParsedToolCall] = field(default_factory=list)  # calls completed at this step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

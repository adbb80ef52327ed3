"""Engine options (``EngineConfig``) and the checks that run before anything is loaded or allocated.

``EngineConfig.validate()`` raises ``ConfigError`` with a one-line message for any option that
cannot work, including memory budgets the machine cannot hold, so a bad option fails at once
instead of after the model has loaded (or after the kernel has killed the process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpu_kernels.spec import CPU_MATHS  # how the CPU kernels multiply quantized weights
from mlx_engine.errors import ConfigError

GiB = 2**30
# The most of the machine's memory the KV cache may take: the rest is for the weights, MLX's
# working buffers and everything else on the machine.
MAX_MEMORY_FRACTION = 0.9
WEIGHT_FORMATS = ("auto", "dense", "quantized")
KV_BITS = (4, 8)
# What an unquantized KV cache stores. "auto": float16 for a model computing in float32 on the CPU
# (half the memory and the bytes attention reads, as llama.cpp's and Ollama's default f16 cache),
# the model's own dtype elsewhere (``KVPool.store_dtype``).
KV_DTYPES = ("auto", "float16", "bfloat16", "float32")
SPECULATIVE_MODES = ("off", "ngram", "draft")
KV_GROUP_SIZES = (32, 64, 128)
# The KV pool starts with room for this many tokens and grows (doubling) as sequences need
# blocks, up to the budget: memory is taken when used, not reserved at start.
KV_FIRST_CHUNK_TOKENS = 512


# The KV budget when none is given: this fraction of memory, at most this many GiB.
DEFAULT_CACHE_FRACTION = 0.15
DEFAULT_CACHE_GB_CAP = 4


def _plain(name: str) -> str:
    return name


def option(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    metavar: str | None = None,
    short: str | None = None,
) -> Any:
    """A field that is also a command-line flag (``--name-with-dashes``): its type, default, choices
    and help are declared once, here, and the flags are derived from them (``app/config_flags.py``).
    ``help`` may name ``{default}``."""
    meta = {"help": help, "choices": choices, "metavar": metavar, "short": short}
    return field(default=default, metadata={"flag": meta})


@dataclass
class EngineConfig:
    kv_bits: int | None = option(
        None,
        "quantize the KV cache to 8 or 4 bits: more tokens in the same memory (default: off)",
        choices=KV_BITS,
    )
    # an unquantized KV cache's dtype
    kv_dtype: str = option(
        "auto",
        "what an unquantized KV cache stores (default auto: float16 on the CPU, as llama.cpp, the model's "
        "dtype on a GPU; float32 keeps a float32 model's KV exact)",
        choices=KV_DTYPES,
    )
    kv_group_size: int = 32
    # KV pool budget in GiB (taken as used)
    cache_gb: float | None = option(
        None,
        f"KV cache budget in GiB, above 0 and at most {MAX_MEMORY_FRACTION:.0%} of the machine's memory "
        f"(default: {DEFAULT_CACHE_FRACTION:.0%} of memory, at most {DEFAULT_CACHE_GB_CAP} GiB)",
    )
    cache_fraction: float | None = option(
        None,
        f"KV cache budget as a fraction of the machine's memory, above 0 and at most {MAX_MEMORY_FRACTION} "
        "(instead of --cache-gb)",
    )
    # the context in tokens, as llama.cpp's --ctx-size and Ollama's num_ctx (None: the model's own, from
    # its config); less saves memory, more only as far as the model's RoPE scaling reaches
    # (mlx_engine/context_length.py)
    context_length: int | None = option(
        None,
        "the context in tokens, as llama.cpp's --ctx-size and Ollama's num_ctx (default: the model's own); "
        "less bounds the KV cache a sequence may take, more is allowed as far as the model's RoPE scaling "
        "(YaRN, linear) reaches and refused past it",
        metavar="N",
        short="-c",
    )
    block_size: int = 16
    max_batch_tokens: int = 512
    prefill_chunk: int = 256
    max_running: int = option(
        64,
        "most sequences generated at once, the batch size (default {default}); also the most sequences "
        "(prompts x n) one request may ask for",
    )
    max_queue: int = option(
        256,
        "most requests waiting for a slot (default {default}); more get 429, and one request with more "
        "sequences than this gets 400",
    )
    prefix_cache: bool = True
    cpu_math: str | None = option(
        None,
        "how the CPU kernels multiply quantized weights: int16 (the default: activations to 2^-15 of each "
        "32 values' largest, two thirds of exact's integer work, logits within ~0.1 of exact's), exact "
        "(activations at float32's accuracy) or int8 (activations in 8 bits per 32 values "
        "and integer dot products, as llama.cpp: fastest, at llama.cpp's accuracy; docs/kernels.md); "
        "default: DUET_CPU_MATH, else int16",
        choices=CPU_MATHS,
    )
    weights: str = option(
        "auto",
        "weight format (default auto: quantized, or dense float32 on a CPU without the built CPU kernels)",
        choices=WEIGHT_FORMATS,
    )
    disk_cache_dir: str | None = None  # prefix-cache disk tier (off when None)
    disk_cache_gb: float = 4.0  # size cap of the disk tier
    # KV sources asked after the disk tier (``kv_source.KVSource``, e.g. remote prefill peers); the
    # engine calls a source's ``attach(engine)`` once its pool exists and ``close()`` at shutdown
    kv_sources: list[Any] = field(default_factory=list)
    # speculative decoding: "ngram" (prompt lookup, adaptive: it proposes only when that pays), "draft"
    # (a draft model's greedy proposals, speculative/draft_model.py) or "off"
    speculative: str = option(
        "ngram",
        "speculative decoding: ngram proposes tokens found earlier in the prompt or reply, draft the "
        "--draft-model's greedy guesses; they are verified in one pass, only when the measured acceptance "
        "and batch make it pay; the output is the same (default ngram, or draft with --draft-model)",
        choices=SPECULATIVE_MODES,
    )
    # the draft model of speculative="draft": a model spec as --model takes, or a LoadedModel; it must
    # share the model's tokenizer
    draft_model: Any = option(
        None,
        "a small model with the same tokenizer that proposes tokens for --speculative draft "
        "(GGUF file, model directory or Hugging Face repo id, as --model)",
        metavar="M",
    )

    # how replies are parsed (mlx_engine/tokenization/reply_parser.py): inferred from the chat template
    # and vocabulary unless set
    reasoning_format: str = option(
        "auto",
        "reasoning apart from the answer (default auto: when the model marks thinking; none: thinking "
        "stays in the answer's text, as llama.cpp's --reasoning-format none)",
        choices=("auto", "none"),
    )
    tool_format: str = option(
        "auto",
        "the tool-call syntax to parse (default auto: from the chat template and vocabulary; see the "
        "README's model families)",
        metavar="NAME",
    )
    chat_template: str | None = option(
        None,
        "a Jinja chat template file to use instead of the model's own (a corrected template, as "
        "llama.cpp's --chat-template-file)",
        metavar="FILE",
    )
    reasoning_budget: int | None = option(
        None,
        "most tokens a reply may think before the engine closes its thinking section and the answer "
        "begins (default: no cap; a request's own budget wins)",
        metavar="N",
    )

    def _check_replies(self, fail: Callable[[str, str], ConfigError], spell: Callable[[str], str]) -> None:
        from mlx_engine.tokenization.reply_parser import REASONING_FORMATS
        from mlx_engine.tokenization.tool_formats import TOOL_FORMATS

        if self.reasoning_format not in REASONING_FORMATS:
            raise fail(
                "reasoning_format",
                f"{spell('reasoning_format')} must be one of {', '.join(REASONING_FORMATS)}",
            )
        if self.tool_format not in TOOL_FORMATS:
            raise fail("tool_format", f"{spell('tool_format')} must be one of {', '.join(TOOL_FORMATS)}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise fail("chat_template", f"{spell('chat_template')}: no such file: {self.chat_template}")
        budget = self.reasoning_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise fail(
                "reasoning_budget",
                f"{spell('reasoning_budget')} must be a whole number of tokens, not {budget!r}",
            )

    def validate(self, memory_bytes: int | None = None, spell: Callable[[str], str] = _plain) -> None:
        """Raise ``ConfigError`` for the first option that cannot work; allocate nothing.

        ``memory_bytes`` is the machine's memory (device memory on Metal/CUDA, RAM on CPU; looked up
        when not given). ``spell`` names an option in messages, e.g. ``cache_gb`` as ``--cache-gb``.
        """

        def fail(option: str, message: str) -> ConfigError:
            return ConfigError(message, option)

        def number(option: str) -> float:
            v = getattr(self, option)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise fail(option, f"{spell(option)} must be a number, not {v!r}")
            return v

        def positive_int(option: str) -> None:
            v = getattr(self, option)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise fail(option, f"{spell(option)} must be a positive integer, not {v!r}")

        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise fail("kv_bits", f"{spell('kv_bits')} must be 4 or 8, not {self.kv_bits!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise fail(
                "kv_dtype",
                f"{spell('kv_dtype')} must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}",
            )
        if self.kv_bits is not None and self.kv_dtype != "auto":
            raise fail("kv_dtype", f"give {spell('kv_bits')} or {spell('kv_dtype')}, not both")
        if self.kv_group_size not in KV_GROUP_SIZES:
            raise fail("kv_group_size", f"{spell('kv_group_size')} must be 32, 64 or 128")
        if self.speculative not in SPECULATIVE_MODES:
            raise fail("speculative", f"{spell('speculative')} must be one of {', '.join(SPECULATIVE_MODES)}")
        if self.speculative == "draft" and self.draft_model is None:
            raise fail("draft_model", f"{spell('speculative')} draft needs {spell('draft_model')}")
        if self.speculative != "draft" and self.draft_model is not None:
            raise fail(
                "draft_model",
                f"{spell('draft_model')} is used only with {spell('speculative')} draft, not {self.speculative}",
            )
        self._check_replies(fail, spell)
        if self.cpu_math is not None and self.cpu_math not in CPU_MATHS:
            raise fail(
                "cpu_math",
                f"{spell('cpu_math')} must be one of {', '.join(CPU_MATHS)}, not {self.cpu_math!r}",
            )
        if self.weights not in WEIGHT_FORMATS:
            raise fail("weights", f"{spell('weights')} must be one of {', '.join(WEIGHT_FORMATS)}")
        if self.context_length is not None:
            positive_int("context_length")
            if self.context_length < 16:
                raise fail("context_length", f"{spell('context_length')} must be at least 16 tokens")
        for option in ("block_size", "max_batch_tokens", "prefill_chunk", "max_running", "max_queue"):
            positive_int(option)
        if self.cache_gb is not None and self.cache_fraction is not None:
            raise fail("cache_gb", f"give {spell('cache_gb')} or {spell('cache_fraction')}, not both")
        if self.cache_fraction is not None:
            f = number("cache_fraction")
            if not 0 < f <= MAX_MEMORY_FRACTION:
                raise fail(
                    "cache_fraction",
                    f"{spell('cache_fraction')} must be above 0 and at most {MAX_MEMORY_FRACTION} "
                    f"(a fraction of memory), not {f:g}",
                )
        if self.cache_gb is not None:
            gb = number("cache_gb")
            if gb <= 0:
                raise fail("cache_gb", f"{spell('cache_gb')} must be above 0 GiB, not {gb:g}")
            memory = memory_bytes if memory_bytes is not None else _memory_bytes()
            limit = MAX_MEMORY_FRACTION * memory
            if gb * GiB > limit:
                what = "more than" if gb * GiB >= memory else "too much of"
                raise fail(
                    "cache_gb",
                    f"{spell('cache_gb')} {gb:g} is {what} this machine's {memory / GiB:.1f} GiB of memory "
                    f"(at most {limit / GiB:.1f} GiB, leaving room for the model)",
                )
        if not isinstance(self.kv_sources, list):
            raise fail("kv_sources", f"{spell('kv_sources')} must be a list of KV sources")
        if self.disk_cache_dir is not None:
            d = number("disk_cache_gb")
            if d <= 0:
                raise fail("disk_cache_gb", f"{spell('disk_cache_gb')} must be above 0 GiB, not {d:g}")

    @property
    def prefill_grid(self) -> int:
        """The prefill chunk in effect: ``prefill_chunk``, at most the step's ``max_batch_tokens``
        (the grid every prompt's chunks lie on, and what a peer must prefill on to be bit-exact)."""
        return min(self.prefill_chunk, self.max_batch_tokens)

    def kv_first_blocks(self) -> int:
        """Blocks the KV pool allocates at start (the null block included); it grows from there."""
        return -(-KV_FIRST_CHUNK_TOKENS // self.block_size) + 1

    def kv_budget_bytes(self, memory_bytes: int) -> float:
        """The KV pool's byte budget on a machine with ``memory_bytes`` of memory."""
        if self.cache_gb is not None:
            return self.cache_gb * GiB
        if self.cache_fraction is not None:
            return self.cache_fraction * memory_bytes
        return min(DEFAULT_CACHE_GB_CAP * GiB, DEFAULT_CACHE_FRACTION * memory_bytes)


def _memory_bytes() -> int:
    from mlx_engine.backend import total_memory_bytes

    return total_memory_bytes()


__all__ = ["EngineConfig", "MAX_MEMORY_FRACTION"]

"""The options every command that loads a model shares: the model and engine flags (derived
from ``EngineConfig``'s fields, app/config_flags.py), the sampling flags, and the checks and
builders that turn them into an engine: ``engine_config``, ``sampling_params``,
``check_model_args``, ``use_fast_blas``, ``load_engine``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from app.config_flags import add_config_flags, config_values, flag
from app.peer_options import check_peer_args, peer_spec
from mlx_engine import defaults
from mlx_engine.config import EngineConfig
from mlx_engine.errors import ConfigError, RequestError

if TYPE_CHECKING:
    from mlx_engine.request import SamplingParams


# the EngineConfig fields every command that loads a model takes as flags (app/config_flags.py)
MODEL_FLAGS = (
    "context_length",
    "kv_bits",
    "kv_dtype",
    "cache_gb",
    "cache_fraction",
    "weights",
    "cpu_math",
    "speculative",
    "draft_model",
    "reasoning_format",
    "tool_format",
    "chat_template",
    "reasoning_budget",
)


# --- arguments ----------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    """``several``: --model may be repeated (``duet serve``: every model given is servable; none
    given: every local model is)."""
    if several:
        p.add_argument(
            "--model",
            "-m",
            action="append",
            default=None,
            help="GGUF file, HF/MLX model directory, Hugging Face repo id or REPO:QUANT to serve; repeat "
            "it to serve several (loaded on first use); once: loaded now and kept loaded; left out: "
            "every local model (`duet models`), loaded on first use",
        )
    else:
        p.add_argument(
            "--model",
            "-m",
            default=None,
            help="GGUF file, HF/MLX model directory, Hugging Face repo id or REPO:QUANT (default: the "
            "bundled SmolLM2-135M-Instruct)",
        )
    add_config_flags(p, EngineConfig, MODEL_FLAGS)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = defaults
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.MAX_TOKENS,
        help="most tokens to generate (default: until the model stops or its context is full)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=d.TEMPERATURE,
        help=f"sampling temperature, 0 = greedy (default {d.TEMPERATURE:g})",
    )
    p.add_argument(
        "--top-p", type=float, default=d.TOP_P, help=f"nucleus sampling mass, 1 = off (default {d.TOP_P:g})"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=d.TOP_K,
        help=f"sample from the k likeliest tokens, 0 = off (default {d.TOP_K})",
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=d.MIN_P,
        help=f"drop tokens below this fraction of the likeliest one's probability, 0 = off (default {d.MIN_P:g})",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=d.REPETITION_PENALTY,
        help=f"penalise tokens already in the prompt or output, 1 = off (default {d.REPETITION_PENALTY:g})",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="random seed, for the same output again (default: random)"
    )


# --- checks before anything loads ---------------------------------------------------------
def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The one place command-line arguments become an ``EngineConfig`` (generate, chat, serve),
    checked: a bad option raises ``ConfigError`` naming its flag."""
    from app.doctor import check_mlx_install

    check_mlx_install()  # before anything imports MLX: a missing Linux backend is one line
    check_peer_args(args)
    given = config_values(args, EngineConfig)
    if given.get("draft_model") is not None:
        given.setdefault("speculative", "draft")  # --draft-model alone: speculate with it
    config = EngineConfig(**given)
    config.validate(spell=flag)
    return config


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """Checked sampling options (``ConfigError`` naming the flag) and ``--max-tokens``."""
    from mlx_engine.request import SamplingParams

    if args.max_tokens is not None and args.max_tokens <= 0:
        raise ConfigError(
            f"--max-tokens must be a positive integer, not {args.max_tokens} "
            "(leave it out to generate until the model stops)",
            "max_tokens",
        )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    try:
        params.validate()
    except RequestError as e:
        value = getattr(args, e.param, None) if e.param else None
        raise ConfigError(f"{e} (got {flag(e.param)} {value})" if e.param else str(e), e.param) from None
    return params


def check_model_args(args: argparse.Namespace) -> None:
    from mlx_engine.loading.preflight import check_context, check_model

    for model in args.model if isinstance(args.model, list) else [args.model]:
        check_context(check_model(model), getattr(args, "context_length", None))
    if getattr(args, "draft_model", None) is not None:
        check_model(args.draft_model)


def use_fast_blas() -> None:
    """Re-execute once with OpenBLAS preloaded where that helps (returns if not needed); after the
    checks, so a bad argument fails at once."""
    from mlx_engine.blas import reexec_with_openblas

    reexec_with_openblas()


def load_engine(args: argparse.Namespace, config: EngineConfig):
    """The engine the options name, with its --peers connected (``app.launch.build_engine``)."""
    from app.launch import build_engine

    return build_engine(args.model, config, peer_spec(args))


def describe(engine) -> str:
    """One line on what an engine runs: model, backend, weights, BLAS, KV cache."""
    s = engine.stats()
    return (
        f"model {s.model} | {s.backend} | weights {s.weight_format} | BLAS {s.blas} | "
        f"KV {s.kv_blocks_total} blocks {s.kv_format}"
    )

"""``duet models``: the bundled model and the models in the local Hugging Face cache."""

from __future__ import annotations


def add_models_parser(sub) -> None:
    """``duet models``."""
    m = sub.add_parser(
        "models",
        help="list the bundled model and models in the local HF cache",
        description="List the bundled model and the models in the local Hugging Face cache.",
    )
    m.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from mlx_engine.loading.resolve import BUNDLED_NAME, bundled_model_path, cached_models

    try:
        print(f"{BUNDLED_NAME}  (bundled: {bundled_model_path()})")
    except FileNotFoundError as e:
        print(f"{BUNDLED_NAME}  (missing: {e})")
    for repo in cached_models():
        print(f"{repo}  (Hugging Face cache)")
    return 0

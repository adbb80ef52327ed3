"""What a Hugging Face model spec names, and which files of a repo it means. No network here.

Specs, as llama.cpp's ``-hf`` and Ollama take them::

    owner/repo                              an MLX/safetensors repo, or a GGUF repo (default quant)
    owner/repo:Q4_K_M                       a GGUF repo, the file of that quant (case-insensitive)
    hf.co/owner/repo:q8_0                   the same with Ollama's prefix (also huggingface.co/...,
    https://huggingface.co/owner/repo        and a URL; ``:latest`` means no quant, as in Ollama)

``choose_gguf`` picks a repo's GGUF file for a quant: the quant is matched as a whole token of the
file name (``Q4_K`` does not match ``Q4_K_M``, ``Q4_XS`` does not match ``IQ4_XS``); a split file
(``-00001-of-00003.gguf``) is one choice made of all its parts; ``mmproj`` files (vision
projectors) are never a model. With no quant: Q4_K_M, else Q4_0, else the smallest (or only) file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mlx_engine.errors import ModelLoadError, ModelNotFoundError

DEFAULT_QUANTS = ("Q4_K_M", "Q4_0")  # llama.cpp's and Ollama's default tag, then the older default
MLX_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt")  # a model dir's files

_PREFIXES = ("https://", "http://")
_HOSTS = ("hf.co/", "huggingface.co/", "www.huggingface.co/")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# a quant token in a file name: Q4_K_M, q8_0, IQ4_XS, IQ2_XXS, BF16, F16, MXFP4, TQ1_0 ...
_QUANT_TOKEN = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Za-z0-9]+)*|BF16|F16|F32|FP16|MXFP4)(?![A-Za-z0-9])", re.IGNORECASE
)


@dataclass(frozen=True)
class HubSpec:
    repo_id: str  # owner/name
    quant: str | None = None  # as typed (matched case-insensitively); None: the default

    @property
    def name(self) -> str:
        return f"{self.repo_id}:{self.quant}" if self.quant else self.repo_id


def parse_hub_spec(spec: str) -> HubSpec | None:
    """The repo and quant ``spec`` names, or None when it is not a hub spec (a path, a bare name)."""
    s = spec.strip()
    explicit = False
    for p in _PREFIXES:
        if s.lower().startswith(p):
            s, explicit = s[len(p) :], True
    for h in _HOSTS:
        if s.lower().startswith(h):
            s, explicit = s[len(h) :], True
            break
    if not explicit and s.startswith((".", "/", "~")):
        return None
    s = s.rstrip("/")
    quant: str | None = None
    if ":" in s:
        s, quant = s.rsplit(":", 1)
        if not quant or quant.lower() == "latest":
            quant = None
    parts = s.split("/")
    if len(parts) != 2 or not all(_NAME.match(p) for p in parts):
        return None
    if quant is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", quant):
        return None
    return HubSpec("/".join(parts), quant)


def is_mmproj(path: str) -> bool:
    return "mmproj" in path.rsplit("/", 1)[-1].lower()


def split_parts(path: str) -> tuple[int, int] | None:
    """(part, of) for a split GGUF's file name (``-00001-of-00003.gguf``), else None."""
    m = _SPLIT.search(path)
    return (int(m.group(1)), int(m.group(2))) if m else None


def quant_label(path: str) -> str | None:
    """The quant a GGUF file's name says (upper case), e.g. ``Q4_K_M``; None when it says none."""
    base = path.rsplit("/", 1)[-1]
    base = _SPLIT.sub("", base)
    base = re.sub(r"\.gguf$", "", base, flags=re.IGNORECASE)
    found = _QUANT_TOKEN.findall(base)
    return found[-1].upper() if found else None


@dataclass(frozen=True)
class GGUFChoice:
    """One model file of a GGUF repo: a single file, or every part of a split one (first part first)."""

    files: tuple[str, ...]
    size: int | None  # all parts together, when the listing gave sizes

    @property
    def first(self) -> str:
        return self.files[0]

    @property
    def label(self) -> str:
        """The name's quant, else the file name without ``.gguf``: what ``owner/repo:LABEL`` takes."""
        stem = _SPLIT.sub("", self.first.rsplit("/", 1)[-1])
        return quant_label(self.first) or re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)

    @property
    def split(self) -> bool:
        parts = split_parts(self.first)
        return len(self.files) > 1 or (parts is not None and parts[1] > 1)


def gguf_choices(files: Mapping[str, int | None] | Iterable[str]) -> list[GGUFChoice]:
    """A repo's GGUF model files (path -> size, or paths), split parts grouped, mmproj left out."""
    sizes: Mapping[str, int | None] = files if isinstance(files, Mapping) else dict.fromkeys(files)
    groups: dict[str, list[str]] = {}
    for path in sorted(sizes):
        if not path.lower().endswith(".gguf") or is_mmproj(path):
            continue
        groups.setdefault(_SPLIT.sub("", path), []).append(path)
    out = []
    for parts in groups.values():
        known = [sizes[p] for p in parts]
        total = None if any(s is None for s in known) else sum(s or 0 for s in known)
        out.append(GGUFChoice(tuple(sorted(parts)), total))
    return out


def _matching(choices: list[GGUFChoice], quant: str) -> list[GGUFChoice]:
    token = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9]|_[A-Za-z0-9])", re.IGNORECASE)
    return [c for c in choices if token.search(_SPLIT.sub("", c.first.rsplit("/", 1)[-1]))]


def _listing(choices: list[GGUFChoice]) -> str:
    return ", ".join(sorted({c.label for c in choices}))


def choose_gguf(repo_id: str, choices: list[GGUFChoice], quant: str | None) -> GGUFChoice:
    """The file ``quant`` names in a repo's GGUF ``choices`` (None: the default), or a one-line
    ``ModelNotFoundError`` saying what there is. A split file is refused (``ModelLoadError``):
    Duet's GGUF reader takes one file."""
    if not choices:
        raise ModelNotFoundError(f"{repo_id} has no GGUF model files")
    if quant is not None:
        found = _matching(choices, quant)
        if not found:
            raise ModelNotFoundError(
                f"{repo_id} has no {quant} GGUF file; available quants: {_listing(choices)} "
                f"(e.g. {repo_id}:{choices[0].label})"
            )
        if len(found) > 1:
            raise ModelNotFoundError(
                f"{repo_id}:{quant} is ambiguous, it matches {len(found)} files: "
                f"{', '.join(c.first for c in found)}; name one by its full quant"
            )
        chosen = found[0]
    elif len(choices) == 1:
        chosen = choices[0]
    else:
        default: GGUFChoice | None = None
        for q in DEFAULT_QUANTS:
            found = _matching(choices, q)
            if len(found) == 1:
                default = found[0]
                break
            if found:
                raise ModelNotFoundError(
                    f"{repo_id} has several {q} files ({', '.join(c.first for c in found)}); "
                    f"name one: {repo_id}:QUANT with one of {_listing(choices)}"
                )
        if default is None:
            sized = sorted((c.size, c.first, c) for c in choices if c.size is not None)
            if len(sized) != len(choices) or (len(sized) > 1 and sized[0][0] == sized[1][0]):
                raise ModelNotFoundError(
                    f"{repo_id} has several GGUF files and no Q4_K_M or Q4_0; name one: "
                    f"{repo_id}:QUANT with one of {_listing(choices)}"
                )
            default = sized[0][2]
        chosen = default
    if chosen.split:
        raise ModelLoadError(
            f"{repo_id}:{chosen.label} is a split GGUF ({len(chosen.files)} parts, {chosen.first}...); "
            "Duet loads single-file GGUFs only: merge it with llama.cpp's `llama-gguf-split --merge` "
            f"or pick another quant ({_listing(choices)})"
        )
    return chosen

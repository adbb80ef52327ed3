"""Will a GGUF file load, and how will it be held? Answered from its header, without reading weights.

``check_gguf(path)`` reads the file's metadata and tensor table (``read_gguf``: bounds, types), builds
the family's mlx-lm model lazily (nothing is allocated), and checks every tensor against the
parameter it becomes: name, shape. It then builds the tokenizer (the vocabulary is metadata) and
estimates the memory the weights take as Duet holds them (``HELD_BITS``). A file that would fail
to load fails here with the same ``GGUFError`` text; ``duet doctor MODEL.gguf`` prints the result.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from mlx_engine.errors import GGUFError
from mlx_engine.loading import gguf_loader
from mlx_engine.loading.gguf_file import TensorInfo, read_gguf
from mlx_engine.loading.gguf_tensors import read_tensors

# how each GGUF type is held when weights stay quantized: (MLX bits per code, exactness). Affine
# groups of 32 add a scale and a bias, float16 on the CPU kernels (cpu_kernels/scales.py: 1 bit per
# weight; float32 elsewhere, 2 bits); MXFP4 one byte per 32 weights.
HELD_BITS: dict[str, tuple[int, str]] = {
    "Q4_0": (4, "exact"), "Q4_1": (4, "exact"), "Q4_K": (4, "exact"), "Q5_0": (5, "exact"),
    "Q5_1": (5, "exact"), "Q5_K": (5, "exact"), "Q8_0": (8, "exact"), "Q3_K": (8, "exact"),
    "Q6_K": (8, "exact where it can be, else within 1/8 of a step"),  # MLX's kernels; the CPU's: Q6K_CPU
    "Q2_K": (8, "rounded to 256 levels per group"),
    "IQ4_NL": (8, "exact"), "IQ4_XS": (8, "exact"), "IQ2_XXS": (8, "exact"),
    "IQ3_XXS": (6, "exact"), "IQ3_S": (4, "exact"), "IQ1_S": (2, "exact"),
    "MXFP4": (4, "exact (MLX mxfp4)"),
}  # fmt: skip
# types whose bias is a fixed multiple of the scale (-zero * d): the CPU kernels store no biases
# (cpu_kernels/scales.py, implicit_biases)
SYMMETRIC = {"Q4_0", "Q5_0", "Q8_0", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_XXS"}
_FLOAT_BITS = {"F32": 32, "F16": 16, "BF16": 16}
# Q6_K on the CPU kernels: as the file holds it (gguf_tensors, q6k), 6-bit codes in groups of 16 and
# per 256 weights a float16 step and 16 int8 multiples
Q6K_CPU = "6-bit in groups of 16 as the file holds it, exact (the CPU kernels; MLX's: 8-bit, group 32, {})"


@dataclass
class GGUFCheck:
    path: Path
    loads: bool
    reason: str | None = None
    architecture: str | None = None
    model_class: str | None = None  # mlx_lm.models.<module>
    name: str | None = None
    context_length: int | None = None
    parameters: int = 0
    active_parameters: int | None = None  # per token, for a mixture of experts
    tensor_types: dict[str, int] = field(default_factory=dict)  # GGUF type -> tensors
    held_as: dict[str, str] = field(default_factory=dict)  # GGUF type -> how Duet holds it
    file_gb: float = 0.0
    memory_gb: float = 0.0  # the weights as held, quantized
    tokenizer: str | None = None
    chat_template: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


class _Shape:
    """A tensor's shape (rows first) standing in for its values while the model is built."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape


def _logical_shape(t: TensorInfo) -> tuple[int, ...]:
    return tuple(reversed(t.shape))


def held_bytes(t: TensorInfo, scale_bits: int = 16) -> float:
    """Bytes the tensor takes as Duet holds it with weights kept quantized, its scales and biases
    ``scale_bits`` wide (16: the CPU kernels', which hold Q4_K's and Q5_K's in their two levels, a
    float16 step per 256 weights and a uint8 multiple per 32, Q6_K's as the file does, and store no
    biases for ``SYMMETRIC`` types: ``cpu_kernels.scales``)."""
    n = 1
    for d in t.shape:
        n *= d
    if t.ggml_type in _FLOAT_BITS or len(t.shape) < 2:
        return n * _FLOAT_BITS.get(t.ggml_type, 32) / 8
    bits, _ = HELD_BITS[t.ggml_type]
    if t.ggml_type == "MXFP4":
        overhead = 8 / 32
    elif t.ggml_type in ("Q4_K", "Q5_K") and scale_bits == 16:
        overhead = 2 * (8 / 32 + 16 / 256)
    elif t.ggml_type == "Q6_K" and scale_bits == 16:
        bits, overhead = 6, 8 / 16 + 16 / 256
    elif t.ggml_type in SYMMETRIC and scale_bits == 16:
        overhead = scale_bits / 32  # the bias is a fixed multiple of the scale: not stored
    else:
        overhead = 2 * scale_bits / 32
    return n * (bits + overhead) / 8


def _held_as(ggml_type: str) -> str:
    if ggml_type in _FLOAT_BITS:
        return f"{ggml_type} values"
    bits, exactness = HELD_BITS[ggml_type]
    if ggml_type == "Q6_K":
        return Q6K_CPU.format(exactness)
    kind = "mxfp4" if ggml_type == "MXFP4" else f"{bits}-bit affine"
    return f"{kind}, group 32, {exactness}"


def _check_parameters(path: Path, arch: str, md: dict, tensors: list[TensorInfo], report: GGUFCheck) -> None:
    config_tensors = [t for t in tensors if t.name in gguf_loader.CONFIG_TENSORS]
    shapes: dict[str, Any] = {t.name: _Shape(_logical_shape(t)) for t in tensors}
    shapes.update(read_tensors(path, config_tensors, dense=True))  # a few small F32 vectors
    spec, config, model = gguf_loader.build_model(path.name, arch, md, shapes)
    report.model_class = f"mlx_lm.models.{spec.module}"
    report.context_length = config["max_position_embeddings"]
    flat: Any = tree_flatten(model.parameters())
    want: dict[str, tuple[int, ...]] = {k: tuple(v.shape) for k, v in flat}
    seen: set[str] = set()
    for t in tensors:
        if t.name in gguf_loader.CONFIG_TENSORS:
            continue
        key = gguf_loader.parameter_name(t.name, spec)
        shape = _logical_shape(t)
        if key in want and shape != want[key] and tuple(d for d in shape if d != 1) != tuple(want[key]):
            raise GGUFError(
                f"{path.name}: tensor {t.name} has shape {shape}, but a {arch} model built from the "
                f"metadata needs {want[key]} for {key}"
            )
        if key not in want:
            raise GGUFError(f"{path.name}: tensor {t.name} has no place in a {arch} model ({key})")
        seen.add(key)
    missing = sorted(set(want) - seen)
    if missing:
        raise GGUFError(
            f"{path.name}: the file lacks {len(missing)} tensors a {arch} model needs, e.g. {missing[0]}"
        )
    report.parameters = sum(_count(shape) for shape in want.values())
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        used = config["num_experts_per_tok"]
        in_experts = sum(_count(s) for k, s in want.items() if ".switch_mlp." in k or ".experts." in k)
        report.active_parameters = report.parameters - in_experts + in_experts * used // experts


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_gguf(path: str | Path) -> GGUFCheck:
    """Whether ``path`` will load in Duet, and if not, why (the error loading would give)."""
    path = Path(path)
    report = GGUFCheck(path=path, loads=False)
    try:
        contents = read_gguf(path)
        md, tensors = contents.metadata, contents.tensors
        report.name = gguf_loader.py_value(md.get("general.name"))
        report.architecture = gguf_loader.py_value(md.get("general.architecture"))
        report.tensor_types = dict(Counter(t.ggml_type for t in tensors))
        report.held_as = {k: _held_as(k) for k in sorted(report.tensor_types)}
        report.file_gb = sum(t.nbytes for t in tensors) / 1e9
        report.memory_gb = sum(held_bytes(t) for t in tensors) / 1e9
        arch = gguf_loader.architecture(path.name, md)
        _check_parameters(path, arch, md, tensors, report)
        from mlx_engine.tokenization.gguf_tokenizer import tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(md)
        kind, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre")
        report.tokenizer = f"{kind}{f' (pre {pre})' if pre else ''}, {tokenizer.vocab_size} tokens"
        report.chat_template = bool(md.get("tokenizer.chat_template"))
    except GGUFError as e:
        report.reason = str(e)
        return report
    report.loads = True
    return report

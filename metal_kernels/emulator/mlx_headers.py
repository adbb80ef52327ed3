"""Take kernels verbatim from the Metal headers that ship inside the installed ``mlx`` wheel.

MLX's ``quantized.h`` is proven on Apple hardware, so running its ``qmv_fast`` through the emulator
and matching a float64 reference validates the emulator itself. The header is not self-contained (it
relies on other MLX headers for its matmul kernels), so only the top-level declarations that
``qmv_fast_impl`` needs are cut out of it, unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx

from metal_kernels.emulator.translate import strip_comments

QMV_FAST_DECLS = (
    "SIMD_SIZE",
    "get_pack_factor",
    "get_bytes_per_pack",
    "load_vector",
    "load_vector_safe",
    "qdot",
    "qdot_safe",
    "qmv_fast_impl",
)


def kernels_dir() -> Path:
    return Path(mx.__file__).resolve().parent / "include" / "mlx" / "backend" / "metal" / "kernels"


def top_level_chunks(text: str) -> list[str]:
    """Split C++ source into top-level declarations and preprocessor lines."""
    chunks: list[str] = []
    buf: list[str] = []
    depth = 0
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if depth == 0 and c == "#" and not "".join(buf).strip():
            end = text.find("\n", i)
            end = n if end < 0 else end
            while end > 0 and text[end - 1] == "\\" and end < n:
                nxt = text.find("\n", end + 1)
                end = n if nxt < 0 else nxt
            chunks.append(text[i:end].strip())
            buf = []
            i = end + 1
            continue
        buf.append(c)
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                rest = text[i + 1 :]
                m = re.match(r"\s*;", rest)
                if m:
                    buf.append(m.group(0))
                    i += len(m.group(0))
                chunks.append("".join(buf).strip())
                buf = []
        elif c == ";" and depth == 0:
            chunks.append("".join(buf).strip())
            buf = []
        i += 1
    tail = "".join(buf).strip()
    if tail:
        chunks.append(tail)
    return [c for c in chunks if c]


def declared_name(chunk: str) -> str | None:
    body = re.sub(r"^template\s*<[^{;]*?>\s*", "", chunk, flags=re.S)
    head = re.split(r"[({=]", body, maxsplit=1)[0]
    idents = re.findall(r"[A-Za-z_]\w*", head)
    return idents[-1] if idents else None


def function_constants(values: dict[str, bool | int]) -> str:
    """Function constants are set when a Metal pipeline is built; here they become constexprs."""
    lines = []
    for name, v in values.items():
        t, lit = ("bool", "true" if v else "false") if isinstance(v, bool) else ("int", str(v))
        lines.append(f"static constant constexpr {t} {name} = {lit};")
    return "\n".join(lines) + "\n"


def extract(header: str, names: Iterable[str]) -> str:
    """The preprocessor lines, ``using`` lines and the named declarations of ``header``, in order."""
    text = strip_comments((kernels_dir() / header).read_text())
    wanted = set(names)
    found: set[str] = set()
    keep: list[str] = []
    for chunk in top_level_chunks(text):
        if chunk.startswith("#define") or chunk.startswith("using "):
            keep.append(chunk)
            continue
        name = declared_name(chunk)
        if name in wanted:
            keep.append(chunk)
            found.add(name)
    missing = wanted - found
    if missing:
        raise LookupError(f"{header} lacks {sorted(missing)}; the installed MLX changed its layout")
    return "\n\n".join(keep) + "\n"


def qmv_fast_header() -> str:
    """The parts of the installed ``quantized.h`` that ``qmv_fast_impl`` uses, verbatim."""
    return "#include <metal_simdgroup>\n#include <metal_stdlib>\n" + extract("quantized.h", QMV_FAST_DECLS)


QMV_FAST_BODY = """
  qmv_fast_impl<T, group_size, bits>(
      w, scales, biases, x, y, in_vec_size, out_vec_size,
      threadgroup_position_in_grid, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);
"""
QMV_FAST_INPUTS = ("w", "scales", "biases", "x", "in_vec_size", "out_vec_size")


def qmv_fast_launch(m: int, n: int, k: int) -> dict[str, tuple[int, int, int]]:
    """Grid and threadgroup as MLX dispatches qmv_fast: 2 SIMD-groups of 32, 8 rows per group."""
    if n % 8 or k % 512:
        raise ValueError("qmv_fast needs N % 8 == 0 and K % 512 == 0")
    return {"grid": (32 * m, 2 * (n // 8), 1), "threadgroup": (32, 2, 1)}


SDPA_VECTOR_CONSTANTS: dict[str, bool | int] = {
    "has_mask": False,
    "query_transposed": False,
    "do_causal": False,
    "bool_mask": False,
    "float_mask": False,
    "has_sinks": False,
    "blocks": 1,
}


def sdpa_vector_header() -> str:
    """MLX's single-pass decode attention kernel ``sdpa_vector`` from the installed ``sdpa_vector.h``.

    It uses threadgroup memory and barriers (``qmv_fast`` has neither), so it validates those parts
    of the emulator. Its function constants are fixed to the unmasked, no-sink case.
    """
    return (
        "#include <metal_simdgroup>\n"
        + function_constants(SDPA_VECTOR_CONSTANTS)
        + extract("sdpa_vector.h", ["sdpa_vector"])
    )


# Calls the [[kernel]] template as a function: fine for the emulator, which is all this is for.
SDPA_VECTOR_BODY = """
  sdpa_vector<T, D>(
      queries, keys, values, out, gqa_factor, N, k_head_stride, k_seq_stride, v_head_stride,
      v_seq_stride, scale, nullptr, nullptr, gqa_factor, gqa_factor, gqa_factor, nullptr, gqa_factor,
      threadgroup_position_in_grid, threadgroups_per_grid, simdgroup_index_in_threadgroup,
      thread_index_in_simdgroup);
"""
SDPA_VECTOR_INPUTS = (
    "queries",
    "keys",
    "values",
    "gqa_factor",
    "N",
    "k_head_stride",
    "k_seq_stride",
    "v_head_stride",
    "v_seq_stride",
    "scale",
)

"""Generate a custom kernel's full Metal source exactly as ``mx.fast.metal_kernel`` does.

MLX builds the kernel text in ``mlx/backend/common/metal_kernel.cpp``: the user's header, an optional
``template <...>`` line, a ``[[kernel]] void custom_kernel_<name>...(...)`` signature generated from
the inputs and outputs, the user's body, and for templated kernels an explicit instantiation with a
``host_name``. This module reproduces that text; ``tests/test_emulator_signature.py`` checks it
character for character against what the installed MLX prints with ``verbose=True``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

# Inputs with fewer elements than this are bound in the `constant` address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, MSL type) in the fixed order MLX emits them; each is added when its name occurs in
# the kernel body as a substring.
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
}

TemplateValue = int | bool | mx.Dtype


def type_string(dtype: mx.Dtype) -> str:
    """MSL spelling of an MLX dtype (MLX's ``get_type_string``)."""
    try:
        return _TYPE_STRINGS[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no Metal type") from None


@dataclass(frozen=True)
class InputMeta:
    """What the generated signature depends on for one input."""

    dtype: mx.Dtype
    ndim: int
    size: int

    @property
    def location(self) -> str:
        return "constant" if self.size < MAX_CONSTANT_ARRAY_SIZE else "device"


@dataclass(frozen=True)
class ShapeInfo:
    shape: bool
    strides: bool
    ndim: bool


def shape_infos(source: str, input_names: Sequence[str]) -> list[ShapeInfo]:
    return [
        ShapeInfo(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes(source: str) -> list[tuple[str, str]]:
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def _template_value(v: TemplateValue) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, mx.Dtype):
        return type_string(v)
    raise TypeError(f"template argument {v!r} must be int, bool or mx.Dtype")


def _template_param(v: TemplateValue) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    return "typename"


def write_template(template: Sequence[tuple[str, TemplateValue]]) -> str:
    """``<float, 4, 1>``: the template argument list as MLX prints it."""
    return "<" + ", ".join(_template_value(v) for _, v in template) + ">"


def kernel_name(
    name: str,
    template: Sequence[tuple[str, TemplateValue]],
    inputs: Sequence[InputMeta],
    output_dtypes: Sequence[mx.Dtype],
) -> str:
    out = "custom_kernel_" + name
    if template:
        out += "_" + re.sub(r"<|>|(, )", "_", write_template(template))[:-1]
    for meta in inputs:
        out += "_" + type_string(meta.dtype)
        if meta.ndim == 0:
            out += "s"
        elif meta.size < MAX_CONSTANT_ARRAY_SIZE:
            out += "c"
    for dt in output_dtypes:
        out += "_" + type_string(dt)
    return out


def write_signature(
    func_name: str,
    header: str,
    source: str,
    input_names: Sequence[str],
    inputs: Sequence[InputMeta],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, TemplateValue]],
    attrs: Sequence[tuple[str, str]],
    infos: Sequence[ShapeInfo],
    atomic_outputs: bool,
) -> str:
    parts = [header]
    if template:
        parts.append("template <" + ", ".join(f"{_template_param(v)} {n}" for n, v in template) + ">\n")
    parts.append(f"[[kernel]] void {func_name}(\n")
    index = 0
    for name, meta, info in zip(input_names, inputs, infos, strict=True):
        ref = "&" if meta.ndim == 0 else "*"
        parts.append(f"  const {meta.location} {type_string(meta.dtype)}{ref} {name} [[buffer({index})]],\n")
        index += 1
        if meta.ndim > 0:
            if info.shape:
                parts.append(f"  const constant int* {name}_shape [[buffer({index})]],\n")
                index += 1
            if info.strides:
                parts.append(f"  const constant int64_t* {name}_strides [[buffer({index})]],\n")
                index += 1
            if info.ndim:
                parts.append(f"  const constant int& {name}_ndim [[buffer({index})]],\n")
                index += 1
    for name, dt in zip(output_names, output_dtypes, strict=True):
        t = type_string(dt)
        if atomic_outputs:
            t = f"atomic<{t}>"
        parts.append(f"  device {t}* {name} [[buffer({index})]]")
        # MLX's quirk: the separator test compares the running buffer index with the number of
        # inputs plus outputs, so shape buffers can end the list early; reproduce it exactly.
        if index < len(inputs) + len(output_names) - 1 or attrs:
            parts.append(",\n")
        else:
            parts.append(") {\n")
        index += 1
    for i, (attr, t) in enumerate(attrs):
        parts.append(f"  {t} {attr} [[{attr}]]")
        parts.append(",\n" if i < len(attrs) - 1 else ") {\n")
    parts.append(source)
    parts.append("\n}\n")
    return "".join(parts)


def generate_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[InputMeta],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, TemplateValue]],
    atomic_outputs: bool,
) -> tuple[str, str]:
    """Return ``(kernel_name, full_metal_source)`` as MLX would build them."""
    kname = kernel_name(name, template, inputs, output_dtypes)
    text = write_signature(
        kname,
        header,
        source,
        input_names,
        inputs,
        output_names,
        output_dtypes,
        template,
        attributes(source),
        shape_infos(source, input_names),
        atomic_outputs,
    )
    if template:
        tdef = kname + write_template(template)
        text += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return kname, text

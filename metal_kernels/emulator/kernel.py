"""``metal_kernel``: the emulator's drop-in for ``mx.fast.metal_kernel``.

The returned callable takes the same keyword arguments as MLX's (``inputs``, ``output_shapes``,
``output_dtypes``, ``grid``, ``threadgroup``, ``template``, ``init_value``, ``verbose``, ``stream``)
and returns MLX arrays. It generates the exact Metal text MLX would compile, translates it to C++,
compiles it with the host compiler and runs every Metal thread on the CPU (see ``msl_runtime.h``).

Checks done on every launch: unwritten outputs stay NaN-poisoned (0xFF bytes) unless ``init_value``
is given; every buffer sits between poisoned red zones, so small out-of-bounds reads return NaN and
out-of-bounds writes raise; inputs must not be modified; threadgroup memory is poisoned, limited to
32 KB; at most 1024 threads per threadgroup; faults inside the kernel raise ``EmulatorError``.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal_kernels.emulator.build import load_library
from metal_kernels.emulator.signature import (
    InputMeta,
    TemplateValue,
    attributes,
    generate_source,
    shape_infos,
    type_string,
    write_template,
)
from metal_kernels.emulator.translate import translate

ORDERS = ("forward", "reverse", "random")
REDZONE = 4096
TG_MEM_LIMIT = 32 * 1024


class EmulatorError(RuntimeError):
    """The kernel misbehaved under emulation (strict-mode violation, fault, out-of-bounds write...)."""


@dataclass(frozen=True)
class EmulatorOptions:
    order: str = "forward"
    seed: int = 0
    strict: bool = False
    tg_mem_limit: int = TG_MEM_LIMIT
    stack_size: int = 128 * 1024


_DEFAULT_OPTIONS = EmulatorOptions()
_options: contextvars.ContextVar[EmulatorOptions | None] = contextvars.ContextVar(
    "metal_emulator_options", default=None
)


@contextlib.contextmanager
def options(**changes: object) -> Iterator[EmulatorOptions]:
    """Temporarily change how emulated kernels run, e.g. ``options(order="reverse", strict=True)``."""
    new = replace(current_options(), **changes)  # type: ignore[arg-type]
    if new.order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}")
    token = _options.set(new)
    try:
        yield new
    finally:
        _options.reset(token)


def current_options() -> EmulatorOptions:
    return _options.get() or _DEFAULT_OPTIONS


class _LaunchParams(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_int64 * 3),
        ("threadgroup", ctypes.c_int64 * 3),
        ("order", ctypes.c_int32),
        ("strict", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("tg_mem_limit", ctypes.c_int64),
        ("stack_size", ctypes.c_int64),
    ]


_NP_DTYPES = {
    mx.bool_: np.bool_,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # raw bits
    mx.float32: np.float32,
}


def _to_numpy(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16))
    return np.array(x)


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


class _Buffer:
    """A byte buffer with 0xFF red zones on both sides."""

    def __init__(self, nbytes: int, fill: bytes | None = None) -> None:
        self.nbytes = nbytes
        self.raw = np.full(nbytes + 2 * REDZONE, 0xFF, dtype=np.uint8)
        if fill is not None and nbytes:
            self.body[:] = np.frombuffer(fill, dtype=np.uint8)

    @property
    def body(self) -> np.ndarray:
        return self.raw[REDZONE : REDZONE + self.nbytes]

    @property
    def ptr(self) -> int:
        return self.raw.ctypes.data + REDZONE

    def redzones_intact(self) -> bool:
        return bool((self.raw[:REDZONE] == 0xFF).all() and (self.raw[REDZONE + self.nbytes :] == 0xFF).all())


def _as_array(x: object) -> mx.array:
    if isinstance(x, mx.array):
        return x
    if isinstance(x, np.ndarray):
        return mx.array(x)
    if isinstance(x, bool | int | float):
        return mx.array(x)
    raise TypeError(f"unsupported kernel input {type(x).__name__}")


class EmulatedKernel:
    """Callable returned by :func:`metal_kernel`."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
    ) -> None:
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self._shape_infos = shape_infos(source, self.input_names)
        self._attributes = attributes(source)
        self._lock = threading.Lock()

    # -- source generation -------------------------------------------------------------------------
    def metal_source(
        self,
        inputs: Sequence[mx.array],
        output_dtypes: Sequence[mx.Dtype],
        template: Sequence[tuple[str, TemplateValue]] = (),
    ) -> tuple[str, str]:
        """``(kernel_name, text)``: the Metal source MLX would compile for these arguments."""
        metas = [InputMeta(a.dtype, a.ndim, a.size) for a in inputs]
        return generate_source(
            self.name,
            self.input_names,
            self.output_names,
            self.source,
            self.header,
            metas,
            list(output_dtypes),
            list(template),
            self.atomic_outputs,
        )

    def cpp_source(
        self,
        inputs: Sequence[mx.array],
        output_dtypes: Sequence[mx.Dtype],
        template: Sequence[tuple[str, TemplateValue]] = (),
    ) -> str:
        kname, metal = self.metal_source(inputs, output_dtypes, template)
        body = translate(metal)
        args: list[str] = []
        k = 0
        for name, arr, info in zip(self.input_names, inputs, self._shape_infos, strict=True):
            t = type_string(arr.dtype)
            if arr.ndim == 0:
                args.append(f"*(const {t}*)emu_bufs[{k}]")
                k += 1
                continue
            args.append(f"(const {t}*)emu_bufs[{k}]")
            k += 1
            if info.shape:
                args.append(f"(const int*)emu_bufs[{k}]")
                k += 1
            if info.strides:
                args.append(f"(const int64_t*)emu_bufs[{k}]")
                k += 1
            if info.ndim:
                args.append(f"*(const int*)emu_bufs[{k}]")
                k += 1
            del name
        for dt in output_dtypes:
            t = type_string(dt)
            if self.atomic_outputs:
                t = f"atomic<{t}>"
            args.append(f"({t}*)emu_bufs[{k}]")
            k += 1
        for attr, _ in self._attributes:
            args.append(f"::emu::{attr}()")
        call = kname + (write_template(template) if template else "")
        joined = ",\n      ".join(args)
        return (
            '#include "msl_shim.h"\n'
            '#line 1 "kernel.metal"\n'
            f"{body}\n"
            "static void** emu_bufs;\n"
            "static void emu_body() {\n"
            f"  {call}(\n      {joined});\n"
            "}\n"
            'extern "C" __attribute__((visibility("default"))) int emu_run(void** bufs, const void* p, '
            "char* err, int errlen) {\n"
            "  emu_bufs = bufs;\n"
            "  return ::emu::launch(&emu_body, (const ::emu::LaunchParams*)p, err, errlen);\n"
            "}\n"
        )

    def library_source_path(
        self,
        inputs: Sequence[mx.array],
        output_dtypes: Sequence[mx.Dtype],
        template: Sequence[tuple[str, TemplateValue]] = (),
    ) -> Path:
        _, path = load_library(self.cpp_source(inputs, output_dtypes, template))
        return path

    # -- launch --------------------------------------------------------------------------------------
    def __call__(
        self,
        *,
        inputs: Sequence[object],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Sequence[tuple[str, TemplateValue]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream: object = None,
        order: str | None = None,
        seed: int | None = None,
        strict: bool | None = None,
    ) -> list[mx.array]:
        del stream
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} but got size {len(inputs)}."
            )
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(self.output_names):
            raise ValueError("[metal_kernel] output_shapes/output_dtypes must match output_names")
        opts = current_options()
        order = order or opts.order
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}")
        seed = opts.seed if seed is None else seed
        strict = opts.strict if strict is None else strict
        template = list(template or [])
        arrays = [_as_array(x) for x in inputs]
        mx.eval(arrays)
        if verbose:
            _, text = self.metal_source(arrays, output_dtypes, template)
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```", flush=True)
        lib, src_path = load_library(self.cpp_source(arrays, output_dtypes, template))

        keep: list[object] = []
        ptrs: list[int] = []
        in_bufs: list[tuple[_Buffer, np.ndarray]] = []
        for arr, info in zip(arrays, self._shape_infos, strict=True):
            data = np.ascontiguousarray(_to_numpy(arr))
            buf = _Buffer(data.nbytes, data.tobytes())
            in_bufs.append((buf, data))
            ptrs.append(buf.ptr)
            if arr.ndim > 0:
                if info.shape:
                    shp = np.asarray(arr.shape, dtype=np.int32)
                    keep.append(shp)
                    ptrs.append(shp.ctypes.data)
                if info.strides:
                    strides = np.asarray([s // data.itemsize for s in data.strides], dtype=np.int64)
                    keep.append(strides)
                    ptrs.append(strides.ctypes.data)
                if info.ndim:
                    nd = np.asarray(arr.ndim, dtype=np.int32)
                    keep.append(nd)
                    ptrs.append(nd.ctypes.data)
        out_bufs: list[_Buffer] = []
        for shape, dt in zip(output_shapes, output_dtypes, strict=True):
            npdt = np.dtype(_NP_DTYPES[dt])
            count = int(np.prod(shape)) if len(shape) else 1
            fill = None
            if init_value is not None:
                init = mx.full((count,), init_value, dtype=dt)
                fill = np.ascontiguousarray(_to_numpy(init)).tobytes()
            buf = _Buffer(count * npdt.itemsize, fill)
            out_bufs.append(buf)
            ptrs.append(buf.ptr)

        params = _LaunchParams(
            (ctypes.c_int64 * 3)(*grid),
            (ctypes.c_int64 * 3)(*threadgroup),
            ORDERS.index(order),
            int(strict),
            seed,
            opts.tg_mem_limit,
            opts.stack_size,
        )
        err = ctypes.create_string_buffer(1024)
        argv = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        with self._lock, _RUN_LOCK:
            rc = lib.emu_run(argv, ctypes.addressof(params), err, len(err))
        if rc != 0:
            raise EmulatorError(f"[{self.name}] {err.value.decode(errors='replace')} (source: {src_path})")
        for name, (buf, data) in zip(self.input_names, in_bufs, strict=True):
            if not buf.redzones_intact():
                raise EmulatorError(f"[{self.name}] out-of-bounds write around input '{name}'")
            if not np.array_equal(buf.body, data.reshape(-1).view(np.uint8)):
                raise EmulatorError(f"[{self.name}] kernel wrote into input '{name}'")
        results = []
        for name, buf, shape, dt in zip(
            self.output_names, out_bufs, output_shapes, output_dtypes, strict=True
        ):
            if not buf.redzones_intact():
                raise EmulatorError(f"[{self.name}] out-of-bounds write around output '{name}'")
            a = buf.body.view(_NP_DTYPES[dt]).reshape(tuple(shape)).copy()
            results.append(_from_numpy(a, dt))
        return results


# Libraries keep launch state in globals: one launch at a time per process.
_RUN_LOCK = threading.Lock()


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
) -> EmulatedKernel:
    """Same signature as ``mx.fast.metal_kernel``; runs the kernel on the CPU emulator."""
    return EmulatedKernel(
        name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs
    )

"""Check a GGUF file's structure and list its tensors before MLX reads it.

``mx.load`` trusts the file: some corrupt headers crash the process instead of raising, and a
tensor type it cannot convert fails with a bare "gguf_tensor_to_f16 failed". So we walk the header
first (magic, version, every key/value and tensor record, each tensor's bytes within the file) and
name the problem ourselves. ``read_gguf`` also decodes the metadata (into plain Python values) and
says where each tensor's bytes are, for the loader to read them from a memory map. (The ``gguf``
package's reader builds an object per array element and takes seconds on a 49k-token vocabulary.)

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.errors import GGUFError

# ggml tensor types we load: id -> (name, elements per block, bytes per block). The quantized ones are
# decoded by mlx_engine/loading/ggml_blocks.py.
SUPPORTED_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
    39: ("MXFP4", 32, 17),
    16: ("IQ2_XXS", 256, 66),
    18: ("IQ3_XXS", 256, 98),
    21: ("IQ3_S", 256, 110),
    19: ("IQ1_S", 256, 50),
}
# refused by name. IQ2_XS, IQ2_S and IQ1_M have a scale per 16 weights that one affine step per 32
# cannot hold exactly (docs/gguf.md)
_OTHER_TYPE_NAMES = {
    9: "Q8_1", 15: "Q8_K", 17: "IQ2_XS", 22: "IQ2_S", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 40: "NVFP4", 41: "Q1_0",
}  # fmt: skip

# metadata value types -> little-endian NumPy dtype (8: string and 9: array are variable)
_VALUE_DTYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8",
}  # fmt: skip
_VALUE_SIZES = {kind: np.dtype(dt).itemsize for kind, dt in _VALUE_DTYPES.items()}
_BOOL, _STRING, _ARRAY, _UINT32 = 7, 8, 9, 4


def type_name(ggml_type: int) -> str:
    if ggml_type in SUPPORTED_TYPES:
        return SUPPORTED_TYPES[ggml_type][0]
    return _OTHER_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first
    offset: int = 0  # where its bytes start in the file
    nbytes: int = 0

    @property
    def rows_cols(self) -> tuple[int, int]:
        """As a matrix: (product of the outer dimensions, the innermost one)."""
        rows = 1
        for d in self.shape[1:]:
            rows *= d
        return rows, self.shape[0]


@dataclass(frozen=True)
class GGUFContents:
    metadata: dict[str, Any]  # plain Python values: int, float, bool, str, or lists of them
    tensors: list[TensorInfo]


_U64 = struct.Struct("<Q")


class _Reader:
    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def skip(self, n: int) -> int:
        """Advance over ``n`` bytes that must lie inside the file; returns where they start."""
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise self.truncated(start)
        self.pos += n
        return start

    def truncated(self, at: int) -> GGUFError:
        return GGUFError(
            f"{self.path} is truncated or corrupt: the header runs past the end of the file "
            f"(at byte {at}, {len(self.data)} bytes in all)"
        )

    def u32(self) -> int:
        return struct.unpack_from("<I", self.data, self.skip(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.data, self.skip(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self.skip(n)
        try:
            return self.data[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path} is corrupt: a header string is not UTF-8") from e

    def strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings (a tokenizer's vocabulary and merges: ~10^5 of them, so one
        tight loop rather than a method call per field)."""
        data, pos, end = self.data, self.pos, len(self.data)
        length = _U64.unpack_from
        raw: list[bytes] = []
        for _ in range(count):
            if pos + 8 > end:
                break
            n = length(data, pos)[0]
            pos += 8
            if pos + n > end:
                break
            raw.append(data[pos : pos + n])
            pos += n
        else:
            self.pos = pos
            try:
                return [b.decode("utf-8") for b in raw]
            except UnicodeDecodeError as e:
                raise GGUFError(f"{self.path} is corrupt: a header string is not UTF-8") from e
        raise self.truncated(pos)

    def value(self, kind: int, key: str) -> Any:
        if kind in _VALUE_DTYPES:
            start = self.skip(_VALUE_SIZES[kind])
            value = np.frombuffer(self.data, _VALUE_DTYPES[kind], 1, start)[0].item()
            return bool(value) if kind == _BOOL else value
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _VALUE_DTYPES:
                start = self.skip(_VALUE_SIZES[item] * count)
                values = np.frombuffer(self.data, _VALUE_DTYPES[item], count, start)
                return values.astype(bool).tolist() if item == _BOOL else values.tolist()
            if item == _STRING:
                return self.strings(count)
            raise GGUFError(f"{self.path} is corrupt: metadata {key!r} is an array of unknown type {item}")
        raise GGUFError(f"{self.path} is corrupt: metadata {key!r} has unknown value type {kind}")


# The last read_tensor_table's whole parse, for the read_gguf of the same unchanged file that follows
# it (the model check, then the load): taken once, then dropped.
_handoff: tuple[tuple[str, int, int, int], GGUFContents] | None = None


def _file_key(path: Path) -> tuple[str, int, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def read_tensor_table(path: Path) -> list[TensorInfo]:
    """Validate ``path`` as a GGUF v2/v3 file and list its tensors. Raises ``GGUFError`` for a missing,
    truncated or corrupt file, or one holding tensor types we cannot load. The metadata is decoded too
    and kept for the next ``read_gguf`` of this file (a check is followed by a load)."""
    global _handoff
    contents = read_gguf(path)
    _handoff = (_file_key(path), contents)
    return contents.tensors


def read_gguf(path: Path) -> GGUFContents:
    """Validate ``path`` as ``read_tensor_table`` does, and decode its metadata."""
    global _handoff
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    handoff, _handoff = _handoff, None
    if handoff is not None and handoff[0] == _file_key(path):
        return handoff[1]
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise GGUFError(f"{path} is not a GGUF file (it is empty)") from e
    try:
        return _walk(data, path)
    finally:
        data.close()


def _walk(data: mmap.mmap, path: Path) -> GGUFContents:
    if data[:4] != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    r = _Reader(data, path)
    r.skip(4)
    version = r.u32()
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = r.u64(), r.u64()
    alignment = 32
    md: dict[str, Any] = {}
    for _ in range(n_kv):
        key, kind = r.string(), r.u32()
        start = r.pos
        md[key] = r.value(kind, key)
        if key == "general.alignment" and kind == _UINT32:
            alignment = struct.unpack_from("<I", data, start)[0]
    if alignment == 0 or alignment % 8:
        raise GGUFError(f"{path} is corrupt: general.alignment is {alignment}")
    records = []
    for _ in range(n_tensors):
        name, n_dims = r.string(), r.u32()
        if not 1 <= n_dims <= 4:
            raise GGUFError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
        shape = tuple(r.u64() for _ in range(n_dims))
        records.append((name, shape, r.u32(), r.u64()))
    data_start = -(-r.pos // alignment) * alignment
    unsupported: dict[str, list[str]] = {}
    tensors = []
    for name, shape, kind, offset in records:
        if kind not in SUPPORTED_TYPES:
            unsupported.setdefault(type_name(kind), []).append(name)
            continue
        _, block, block_bytes = SUPPORTED_TYPES[kind]
        count = 1
        for d in shape:
            count *= d
        if shape[0] % block:
            raise GGUFError(
                f"{path} is corrupt: tensor {name!r} has {shape[0]} columns, not whole blocks of {block}"
            )
        start, nbytes = data_start + offset, count // block * block_bytes
        if start + nbytes > len(data):
            raise GGUFError(
                f"{path} is truncated or corrupt: tensor {name!r} ends at byte {start + nbytes}, "
                f"past the end of the file ({len(data)} bytes); an incomplete download?"
            )
        tensors.append(TensorInfo(name, type_name(kind), shape, start, nbytes))
    if unsupported:
        found = "; ".join(f"{t} ({len(names)} tensors, e.g. {names[0]})" for t, names in unsupported.items())
        raise GGUFError(
            f"{path} holds tensor types we cannot load: {found}. "
            f"Supported types: {', '.join(t for t, _, _ in SUPPORTED_TYPES.values())} "
            "(re-quantize to one of them, e.g. Q4_K_M, with llama.cpp's llama-quantize, or use the HF model)"
        )
    return GGUFContents(md, tensors)

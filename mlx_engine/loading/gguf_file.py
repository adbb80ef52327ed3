"""Check a GGUF file's structure and list its tensors before MLX reads it.

``mx.load`` trusts the file: some corrupt headers crash the process instead of raising, and a
tensor type it cannot convert fails with a bare "gguf_tensor_to_f16 failed". So we walk the header
first (magic, version, every key/value and tensor record, each tensor's bytes within the file) and
name the problem ourselves. This only skips over the metadata values; ``mx.load`` decodes them.
(The ``gguf`` package's reader decodes every value and takes seconds on a 49k-token vocabulary.)

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.errors import GGUFError

# ggml tensor types mx.load reads correctly: id -> (name, elements per block, bytes per block).
# (It also converts some K-quants to float16, but gives wrong values for Q4_K, so we refuse those.)
SUPPORTED_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}
_OTHER_TYPE_NAMES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip

# metadata value types -> fixed size in bytes (8: string and 9: array are variable)
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def type_name(ggml_type: int) -> str:
    if ggml_type in SUPPORTED_TYPES:
        return SUPPORTED_TYPES[ggml_type][0]
    return _OTHER_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # as GGUF lists it: innermost dimension first


class _Reader:
    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def skip(self, n: int) -> int:
        """Advance over ``n`` bytes that must lie inside the file; returns where they start."""
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise GGUFError(
                f"{self.path} is truncated or corrupt: the header runs past the end of the file "
                f"(at byte {start}, {len(self.data)} bytes in all)"
            )
        self.pos += n
        return start

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

    def skip_value(self, kind: int, key: str) -> None:
        if kind in _VALUE_SIZES:
            self.skip(_VALUE_SIZES[kind])
        elif kind == _STRING:
            self.skip(self.u64())
        elif kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _VALUE_SIZES:
                self.skip(_VALUE_SIZES[item] * count)
            elif item == _STRING:
                for _ in range(count):
                    self.skip(self.u64())
            else:
                raise GGUFError(
                    f"{self.path} is corrupt: metadata {key!r} is an array of unknown type {item}"
                )
        else:
            raise GGUFError(f"{self.path} is corrupt: metadata {key!r} has unknown value type {kind}")


def read_tensor_table(path: Path) -> list[TensorInfo]:
    """Validate ``path`` as a GGUF v2/v3 file and list its tensors. Raises ``GGUFError`` for a missing,
    truncated or corrupt file, or one holding tensor types we cannot load."""
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise GGUFError(f"{path} is not a GGUF file (it is empty)") from e
    with data:
        if data[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        r = _Reader(data, path)
        r.skip(4)
        version = r.u32()
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = r.u64(), r.u64()
        alignment = 32
        for _ in range(n_kv):
            key, kind = r.string(), r.u32()
            start = r.pos
            r.skip_value(kind, key)
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
            end = data_start + offset + count // block * block_bytes
            if end > len(data):
                raise GGUFError(
                    f"{path} is truncated or corrupt: tensor {name!r} ends at byte {end}, "
                    f"past the end of the file ({len(data)} bytes); an incomplete download?"
                )
            tensors.append(TensorInfo(name, type_name(kind), shape))
        if unsupported:
            found = "; ".join(
                f"{t} ({len(names)} tensors, e.g. {names[0]})" for t, names in unsupported.items()
            )
            raise GGUFError(
                f"{path} holds tensor types we cannot load: {found}. "
                f"Supported types: {', '.join(t for t, _, _ in SUPPORTED_TYPES.values())} "
                "(re-quantize to Q8_0 or Q4_0, e.g. with llama.cpp's llama-quantize, or use the HF model)"
            )
        return tensors

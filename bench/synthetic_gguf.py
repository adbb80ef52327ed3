"""GGUF files at the shapes people run, with random weights, quantized by llama.cpp's own quantizer.

    .venv/bin/python bench/synthetic_gguf.py --shape moe-16x4 [--quant Q4_K_M]   # prints the path

Real 1B-30B weights cannot be downloaded here, and a benchmark's speed depends on the shapes and
the quantization, not on the values: so each shape below is written as an F16 GGUF of random
normal weights (std 0.02; norms 1) with the bundled SmolLM2's tokenizer (49,152 tokens), then
``llama_model_quantize`` (llama-cpp-python: ``make bench-deps``) makes the ``--quant`` file llama.cpp
itself would make. Files are cached under ``bench/out/synthetic/``.

It also prints what a decode step must read: every weight byte of a dense model; for a mixture of
experts the non-expert tensors plus ``k/E`` of the expert tensors (the active-parameter bound at
batch 1, with the router choosing experts uniformly, which random routers do).
"""

from __future__ import annotations

import argparse
import ctypes
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "synthetic"


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense FFN width (unused by an all-MoE model)
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0


SHAPES = {
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192),  # Llama-3.2-1B's body
    "llama-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192),  # Llama-3.2-3B's
    "llama-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336),  # Llama-3.1-8B's
    # a small Qwen3-MoE: Qwen3-30B-A3B's attention and expert width, 16 experts of which 4 active
    "moe-16x4": Shape("qwen3moe", 2048, 16, 32, 4, 128, 6144, 16, 4, 768),
    # Qwen3-30B-A3B's layer exactly (128 experts, 8 active), 8 of its 48 layers
    "qwen3-30b-a3b-8l": Shape("qwen3moe", 2048, 8, 32, 4, 128, 6144, 128, 8, 768),
}


def _tensors(s: Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """name -> numpy shape (outer dimension first), as llama.cpp's converter writes them."""
    t: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, s.hidden),
        "output_norm.weight": (s.hidden,),
    }
    t["output.weight"] = (vocab, s.hidden)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": (s.hidden,), b + "ffn_norm.weight": (s.hidden,)}
        t |= {b + "attn_q.weight": (q, s.hidden), b + "attn_k.weight": (kv, s.hidden)}
        t |= {b + "attn_v.weight": (kv, s.hidden), b + "attn_output.weight": (s.hidden, q)}
        if s.arch == "qwen3moe":
            t |= {b + "attn_q_norm.weight": (s.head_dim,), b + "attn_k_norm.weight": (s.head_dim,)}
            t[b + "ffn_gate_inp.weight"] = (s.experts, s.hidden)
            t[b + "ffn_gate_exps.weight"] = (s.experts, s.expert_ffn, s.hidden)
            t[b + "ffn_up_exps.weight"] = (s.experts, s.expert_ffn, s.hidden)
            t[b + "ffn_down_exps.weight"] = (s.experts, s.hidden, s.expert_ffn)
        else:
            t |= {b + "ffn_gate.weight": (s.ffn, s.hidden), b + "ffn_up.weight": (s.ffn, s.hidden)}
            t[b + "ffn_down.weight"] = (s.hidden, s.ffn)
    return t


def write_f16(path: Path, s: Shape) -> None:
    import gguf

    from mlx_engine.loading.resolve import bundled_model_path

    src = gguf.GGUFReader(bundled_model_path())
    writer = gguf.GGUFWriter(str(path), arch=s.arch)
    writer.add_name(f"synthetic {path.stem}")
    for field in src.fields.values():  # the tokenizer (and its chat template) of the bundled model
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub)
    vocab = len(src.get_field("tokenizer.ggml.tokens").data)
    writer.add_context_length(8192)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_ffn)
    rng = np.random.default_rng(0)
    for name, shape in _tensors(s, vocab).items():
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
        else:
            writer.add_tensor(name, (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def quantize(src: Path, dst: Path, quant: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed on {src}")
    tmp.rename(dst)


def decode_bytes(path: Path) -> dict[str, float]:
    """Bytes in the file's weight tensors, and what one batch-1 decode step reads of them: as the
    file holds them (llama.cpp reads these) and as Duet holds them (``gguf_check.held_bytes``)."""
    from mlx_engine.loading.gguf_check import held_bytes
    from mlx_engine.loading.gguf_file import read_gguf

    contents = read_gguf(path)
    md = contents.metadata
    arch = str(md["general.architecture"])
    experts = int(md.get(f"{arch}.expert_count", 0) or 0)
    used = int(md.get(f"{arch}.expert_used_count", 0) or 0)
    out = {"file_gb": sum(t.nbytes for t in contents.tensors) / 1e9}
    tied = not any(t.name == "output.weight" for t in contents.tensors)  # the embedding is the LM head
    for label, size in (("file", lambda t: t.nbytes), ("duet", held_bytes)):
        active = 0.0
        for t in contents.tensors:
            if t.name == "token_embd.weight" and not tied:
                continue  # a lookup: one row per token
            share = used / experts if experts and "_exps." in t.name else 1.0
            active += size(t) * share
        out[f"{label}_active_gb_per_token"] = active / 1e9
    return out


def build(shape: str, quant: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    dst = OUT / f"{shape}-{quant}.gguf"
    if not dst.exists():
        f16 = OUT / f"{shape}-F16.gguf"
        if not f16.exists():
            write_f16(f16, SHAPES[shape])
        quantize(f16, dst, quant)
        f16.unlink()  # several GB; the quantized file is what benchmarks read
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--quant", default="Q4_K_M", help="llama.cpp file type, e.g. Q4_K_M, Q8_0, IQ4_XS")
    args = ap.parse_args()
    path = build(args.shape, args.quant)
    print(json.dumps({"path": str(path)} | decode_bytes(path)))


if __name__ == "__main__":
    main()

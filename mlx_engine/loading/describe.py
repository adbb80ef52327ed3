"""What a model is, from its files' headers, without loading weights: ``duet show``.

``describe_model(name)`` takes a catalogue name or spec (``catalogue.find_model``) or a local
path, and reads a GGUF's metadata and tensor table, or a model directory's ``config.json``,
tokenizer files and safetensors headers. The reply format (think markers, tool-call syntax,
harmony) is the engine's own inference (``reply_parser.infer_reply_format``) from the chat template
and vocabulary.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

from mlx_engine.errors import ModelNotFoundError
from mlx_engine.loading.catalogue import (
    CatalogueEntry,
    config_context,
    config_quant,
    find_model,
    gguf_summary,
    read_config,
)

# chat template families, by a marker their templates write
_FAMILIES = (
    ("<|channel|>", "harmony (gpt-oss)"),
    ("<|start_header_id|>", "llama3"),
    ("<|im_start|>", "chatml"),
    ("<start_of_turn>", "gemma"),
    ("<｜User｜>", "deepseek"),
    ("[INST]", "mistral"),
    ("<|user|>", "phi/zephyr"),
    ("<|start_of_role|>", "granite"),
    ("<|turn>", "gemma4"),
)


def template_family(template: str | None) -> str | None:
    if not template:
        return None
    for marker, family in _FAMILIES:
        if marker in template:
            return family
    return "other"


def _reply_format(template: str | None, vocab: dict[str, int]) -> dict[str, Any]:
    from mlx_engine.tokenization.reply_parser import infer_reply_format

    fmt = infer_reply_format(template, vocab)
    if fmt.harmony:
        return {"reasoning_format": "harmony", "tool_format": "harmony", "thinking_switch": None}
    return {
        "reasoning_format": f"{fmt.think.start}...{fmt.think.end}" if fmt.think else None,
        "tool_format": fmt.tools.name if fmt.tools else "hermes (asked for in a system prompt)",
        "thinking_switch": fmt.thinking_kwarg,
    }


def _describe_gguf(path: Path) -> dict[str, Any]:
    from mlx_engine.loading.gguf_file import read_gguf

    contents = read_gguf(path)
    md = contents.metadata
    arch, ctx, ftype = gguf_summary(path)
    params = 0
    for t in contents.tensors:
        n = 1
        for d in t.shape:
            n *= d
        params += n
    template = md.get("tokenizer.chat_template")
    tokens = md.get("tokenizer.ggml.tokens") or []
    return {
        "architecture": arch,
        "model_name": md.get("general.name"),
        "parameters": params,
        "file_type": ftype,
        "tensor_types": dict(Counter(t.ggml_type for t in contents.tensors).most_common()),
        "context_length": ctx,
        "tokenizer": md.get("tokenizer.ggml.model"),
        "vocab_size": len(tokens),
        "chat_template": template_family(template if isinstance(template, str) else None),
        **_reply_format(
            template if isinstance(template, str) else None, {t: i for i, t in enumerate(tokens)}
        ),
    }


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header if isinstance(header, dict) else {}


def _describe_dir(path: Path) -> dict[str, Any]:
    cfg = read_config(path)
    quant = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else None
    bits = quant.get("bits") if quant else None
    params = 0
    dtypes: Counter[str] = Counter()
    for st in sorted(path.glob("*.safetensors")):
        for name, t in _safetensors_header(st).items():
            if name == "__metadata__" or not isinstance(t, dict):
                continue
            n = 1
            for d in t.get("shape", ()):
                n *= d
            if name.endswith((".scales", ".biases")) and quant:
                continue
            if t.get("dtype") == "U32" and isinstance(bits, int):
                n = n * 32 // bits  # packed quantized weights
            params += n
            dtypes[str(t.get("dtype"))] += 1
    template = None
    tc: dict[str, Any] = {}
    try:
        tc = json.loads((path / "tokenizer_config.json").read_text())
        template = tc.get("chat_template") if isinstance(tc.get("chat_template"), str) else None
    except (OSError, ValueError):
        pass
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    vocab: dict[str, int] = {}
    try:
        tok = json.loads((path / "tokenizer.json").read_text())
        v = tok.get("model", {}).get("vocab")
        vocab = dict(v) if isinstance(v, dict) else {}
        vocab.update({a["content"]: a["id"] for a in tok.get("added_tokens", []) if isinstance(a, dict)})
    except (OSError, ValueError, AttributeError):
        pass
    return {
        "architecture": cfg.get("model_type"),
        "model_name": None,
        "parameters": params,
        "file_type": config_quant(cfg),
        "tensor_types": dict(dtypes.most_common()),
        "context_length": config_context(cfg),
        "tokenizer": tc.get("tokenizer_class") if tc else None,
        "vocab_size": len(vocab) or cfg.get("vocab_size"),
        "chat_template": template_family(template),
        **_reply_format(template, vocab),
    }


def describe_model(name: str) -> dict[str, Any]:
    """``duet show``: a model's architecture, parameter count, quant mix (tensor types), context
    length, chat template family and reply format, plus its catalogue fields. ``name``: a catalogue
    name or spec (no network), or a path to a .gguf file or a model directory."""
    p = Path(name).expanduser()
    entry: CatalogueEntry | None = None
    if p.is_file() or p.is_dir():
        path, fmt = p, ("gguf" if p.is_file() else "dir")
        if p.is_file() and p.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{p} is not a .gguf file or a model directory")
    else:
        entry = find_model(name)
        path, fmt = entry.path, ("gguf" if entry.format == "gguf" else "dir")
    info = _describe_gguf(path) if fmt == "gguf" else _describe_dir(path)
    head = entry.as_dict() if entry else {"name": name, "path": str(path), "format": fmt}
    return {**head, **info}

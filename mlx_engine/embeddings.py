"""Embedding models on MLX: text in, one L2-normalized vector per input out.

Two kinds, read from an HF / sentence-transformers model directory:

- **BERT encoders** (``model_type: bert``: all-MiniLM, bge, e5, gte, nomic-style BERTs...): the
  encoder is written here on ``mlx.nn`` (about a hundred lines) and pooled as the directory's
  ``1_Pooling/config.json`` says (mean of the tokens by default, or the CLS token).
- **Decoder embedding models** (Qwen3-Embedding style: ``architectures`` ending in ``Model``, not
  ``ForCausalLM``, e.g. ``Qwen3Model``): mlx-lm's model classes run the transformer, and the last
  token's hidden state is the embedding. These are Matryoshka-trained, so ``dimensions`` may cut
  a vector short (it is normalized again).

Why not a package: mlx-lm runs decoders only, and ``mlx-embeddings`` pulls in mlx-vlm, mlx-audio,
datasets, opencv, pyarrow and sounddevice and pins an exact mlx version, for what is a small
encoder here. Inputs are batched (sorted by length, padded, at most ``max_batch_tokens`` per
forward pass); padding is masked out of attention and pooling, so a vector does not depend on
what it was batched with beyond float rounding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_engine.errors import ModelLoadError, RequestError


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None]
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings(mx.zeros_like(ids))
        return self.LayerNorm(x)


class _Dense(nn.Module):
    """``dense`` then, with ``norm``, a residual LayerNorm (BERT's output sublayers)."""

    def __init__(self, d_in: int, d_out: int, eps: float | None = None):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(d_out, eps=eps)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attn = _SelfAttention(c)  # "attention.self" in HF checkpoints
        self.output = _Dense(c.hidden_size, c.hidden_size, c.layer_norm_eps)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.num_attention_heads
        self.attention = _Attention(c)
        self.intermediate = _Dense(c.hidden_size, c.intermediate_size)
        self.output = _Dense(c.intermediate_size, c.hidden_size, c.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        a = self.attention.attn
        h = self.heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)

        q, k, v = split(a.query(x)), split(a.key(x)), split(a.value(x))
        ctx = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(d // h), mask=mask)
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b, n, d)
        out = self.attention.output
        x = out.LayerNorm(x + out.dense(ctx))
        y = self.output.dense(nn.gelu(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + y)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.embeddings = _Embeddings(c)
        self.layers = [_Layer(c) for _ in range(c.num_hidden_layers)]

    def __call__(self, ids: mx.array, valid: mx.array) -> mx.array:
        """Hidden states (B, L, D); ``valid`` (B, L) is 1 for real tokens, 0 for padding."""
        mask = mx.where(valid[:, None, None, :] > 0, 0.0, -1e9).astype(mx.float32)
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, mask.astype(x.dtype))
        return x


def bert_weight_name(hf: str) -> str | None:
    """Our parameter name for an HF BERT checkpoint's tensor (None: not used)."""
    name = hf.removeprefix("bert.").removeprefix("model.")
    if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
        return None
    name = name.replace("encoder.layer.", "layers.").replace(".attention.self.", ".attention.attn.")
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None


def _load_safetensors(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]
    return weights


class EmbeddingModel:
    """An embedding model loaded from a directory; ``embed`` runs on whichever thread MLX work
    belongs to (the server calls it on the engine's worker)."""

    def __init__(
        self,
        name: str,
        path: Path,
        tokenizer: Any,
        forward: Any,
        dim: int,
        pooling: str,
        max_tokens: int,
        vocab_size: int,
        matryoshka: bool,
        max_batch_tokens: int = 8192,
    ):
        self.name, self.path, self.tokenizer = name, path, tokenizer
        self._forward = forward
        self.dim, self.pooling, self.max_tokens = dim, pooling, max_tokens
        self.vocab_size, self.matryoshka = vocab_size, matryoshka
        self.max_batch_tokens = max_batch_tokens
        self.forward_passes = 0  # batches run, for tests and metrics

    # --- loading ---------------------------------------------------------------------------
    @staticmethod
    def is_embedding_dir(path: Path) -> bool:
        """A directory that holds an embedding model rather than a chat model."""
        cfg = _read_json(path / "config.json")
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") in ("bert",):
            return True
        if (path / "config_sentence_transformers.json").exists() or (path / "1_Pooling").is_dir():
            return True
        return bool(archs) and all(a.endswith("Model") for a in archs)

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> EmbeddingModel:
        from tokenizers import Tokenizer

        path = Path(path)
        cfg = _read_json(path / "config.json")
        if not cfg:
            raise ModelLoadError(f"{path}: no config.json: not an HF model directory")
        if not cls.is_embedding_dir(path):
            raise ModelLoadError(
                f"{path}: not an embedding model ({', '.join(cfg.get('architectures') or [cfg.get('model_type', '?')])}): "
                "expected a BERT or a sentence-transformers / *Model (not *ForCausalLM) directory"
            )
        if not (path / "tokenizer.json").exists():
            raise ModelLoadError(f"{path}: no tokenizer.json")
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.no_padding()
        tok.no_truncation()
        pool_cfg = _read_json(path / "1_Pooling" / "config.json")
        st_cfg = _read_json(path / "sentence_bert_config.json")
        name = name or path.name
        weights = _load_safetensors(path)
        if cfg.get("model_type") == "bert":
            c = BertConfig.from_dict(cfg)
            model = BertEncoder(c)
            mapped = {}
            for k, v in weights.items():
                ours = bert_weight_name(k)
                if ours is not None:
                    mapped[ours] = v
            try:
                model.load_weights(list(mapped.items()), strict=True)
            except ValueError as e:
                raise ModelLoadError(f"{path}: the BERT weights do not match config.json: {e}") from None
            pooling = "cls" if pool_cfg.get("pooling_mode_cls_token") else "mean"
            limit = min(
                c.max_position_embeddings, int(st_cfg.get("max_seq_length") or c.max_position_embeddings)
            )
            mx.eval(model.parameters())
            return cls(name, path, tok, model, c.hidden_size, pooling, limit, c.vocab_size, False)
        return cls._load_decoder(path, name, cfg, tok, weights, st_cfg)

    @classmethod
    def _load_decoder(
        cls, path: Path, name: str, cfg: dict, tok: Any, weights: dict, st_cfg: dict
    ) -> EmbeddingModel:
        from mlx_lm.utils import _get_classes

        try:
            model_cls, args_cls = _get_classes(cfg)
        except ValueError as e:
            raise ModelLoadError(f"{path}: unsupported embedding model: {e}") from None
        model = model_cls(args_cls.from_dict(cfg))
        # an embedding checkpoint (Qwen3Model) has the transformer's tensors without "model."
        named = [(k if k.startswith("model.") else "model." + k, v) for k, v in weights.items()]
        named = [(k, v) for k, v in named if not k.startswith("model.lm_head")]
        try:
            model.load_weights(named, strict=False)
        except ValueError as e:
            raise ModelLoadError(f"{path}: the weights do not match config.json: {e}") from None
        mx.eval(model.parameters())
        hidden = int(cfg["hidden_size"])
        limit = int(st_cfg.get("max_seq_length") or cfg.get("max_position_embeddings") or 8192)
        return cls(name, path, tok, model.model, hidden, "last", limit, int(cfg["vocab_size"]), True)

    # --- use ---------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]

    def check(self, ids: list[int], param: str) -> None:
        if not ids:
            raise RequestError("an input must not be empty", param)
        if len(ids) > self.max_tokens:
            raise RequestError(
                f"an input has {len(ids)} tokens, more than this embedding model's maximum of {self.max_tokens}",
                param,
            )
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"token ids must be inside the vocabulary (0..{self.vocab_size - 1})", param)

    def batches(self, inputs: list[list[int]]) -> list[list[int]]:
        """The inputs' indices in forward-pass batches: sorted by length (little padding), at
        most ``max_batch_tokens`` padded tokens a batch."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out = []
        start = 0
        while start < len(order):
            end = start + 1  # sorted by length: the batch is as long as its last input
            while end < len(order) and (end + 1 - start) * len(inputs[order[end]]) <= self.max_batch_tokens:
                end += 1
            out.append(order[start:end])
            start = end
        return out

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One normalized float32 vector per input (N, dim); inputs are checked token id lists."""
        out = np.zeros((len(inputs), self.dim), dtype=np.float32)
        for batch in self.batches(inputs):
            out[batch] = self.embed_batch([inputs[i] for i in batch])
        return out

    def embed_batch(self, batch: list[list[int]]) -> np.ndarray:
        """One forward pass: a normalized vector per input, in order."""
        self.forward_passes += 1
        n = max(len(x) for x in batch)
        ids = mx.array([x + [0] * (n - len(x)) for x in batch], dtype=mx.int32)
        lengths = mx.array([len(x) for x in batch])
        valid = (mx.arange(n)[None] < lengths[:, None]).astype(mx.float32)
        if self.pooling == "last":
            # causal attention: the padding on the right never reaches the real tokens
            hidden = self._forward(ids).astype(mx.float32)
            pooled = hidden[mx.arange(len(batch)), lengths - 1]
        else:
            hidden = self._forward(ids, valid).astype(mx.float32)
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                pooled = (hidden * valid[..., None]).sum(axis=1) / lengths[:, None].astype(mx.float32)
        pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return np.array(pooled, dtype=np.float32)

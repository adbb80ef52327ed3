"""What each GGUF architecture is in mlx-lm's terms: its model module, tensor names and config.

llama.cpp's converter (convert_hf_to_gguf.py) renames a Hugging Face model's tensors to its own
scheme (``blk.N.attn_q``, ``ffn_gate_exps``...), moves its config into ``<arch>.*`` metadata keys
and, for some families, changes the values. Each ``GGUFArch`` says how to undo that for one
``general.architecture``, onto mlx-lm's own model class (no forked model code):

- ``names``: the in-block GGUF tensor -> mlx-lm parameter path (under ``model.layers.N``);
- ``permuted_qk``: Q and K rows were permuted for ggml's interleaved RoPE (llama.cpp's
  ``LLAMA_ROPE_TYPE_NORM`` families converted through ``LlamaModel``: llama, granite);
- ``norm_offset``: norm weights were stored as ``w + offset`` (Gemma's ``1 + w``);
- ``config``: the family's config keys beyond the common ones, from its metadata (``Meta``).

The common keys (sizes, heads, RoPE base and scaling, norms' epsilon, tied head) are read by
``common_config`` in gguf_loader.py for every architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_engine.loading.gguf_file import GGUFError

__all__ = ["ARCHITECTURES", "GGUFArch", "Meta"]


class Meta:
    """A GGUF file's metadata under its architecture's prefix: ``meta.get("embedding_length")``
    reads ``<arch>.embedding_length``."""

    def __init__(self, arch: str, metadata: Mapping[str, Any]):
        self.arch = arch
        self._md = metadata

    def raw(self, key: str, default: Any = None) -> Any:
        value = self._md.get(f"{self.arch}.{key}", default)
        return value.tolist() if isinstance(value, mx.array) else value

    def get(self, key: str, default: Any = None) -> Any:
        """A value that must be the same for every layer (a per-layer list is refused)."""
        value = self.raw(key, default)
        if isinstance(value, list):
            raise GGUFError(
                f"{self.arch}.{key} varies per layer in this file; only uniform layers are supported"
            )
        return value

    def require(self, *keys: str) -> None:
        missing = [f"{self.arch}.{k}" for k in keys if self.get(k) is None]
        if missing:
            raise GGUFError(f"the GGUF metadata lacks {', '.join(missing)}")


Config = dict[str, Any]
Weights = Mapping[str, mx.array]


def _no_extra(meta: Meta, weights: Weights, common: Config) -> Config:
    return {}


@dataclass(frozen=True)
class GGUFArch:
    module: str  # mlx_lm.models.<module>
    names: Mapping[str, str]
    config: Callable[[Meta, Weights, Config], Config] = _no_extra
    permuted_qk: bool = False
    norm_offset: float = 0.0
    # which metadata keys must be present (beyond the common ones every architecture needs)
    required: tuple[str, ...] = ()
    # GGUF tensors stored with fewer dimensions than mlx-lm's parameter: name suffix -> new shape rule
    reshape: Mapping[str, Callable[[mx.array], mx.array]] = field(default_factory=dict)


_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# pre-norm blocks (llama, qwen, phi, granite...): attention norm, then the FFN norm
_PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
LLAMA_NAMES = _ATTENTION | _MLP | _PRE_NORMS
# Gemma 2/3: a norm before and after each of attention and the FFN
_SANDWICH_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_SWITCH_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",  # the router
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}


def _query_scale_dims(meta: Meta, common: Config, wide_model_layers: int) -> float:
    """Gemma's attention scale is 1/sqrt(query_pre_attn_scalar): the head size, except for the 27B
    models (hidden / heads), which llama.cpp recognises by their layer count (no metadata key)."""
    if common["num_hidden_layers"] == wide_model_layers:
        return common["hidden_size"] / common["num_attention_heads"]
    return float(common["head_dim"])


def _gemma2(meta: Meta, weights: Weights, common: Config) -> Config:
    return {
        "attn_logit_softcapping": meta.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.get("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": _query_scale_dims(meta, common, wide_model_layers=46),
    }


def _window_pattern(meta: Meta, default: int) -> int:
    """Every n-th layer global, the rest sliding: ``attention.sliding_window_pattern`` as that n, or
    as llama.cpp's per-layer flags (True: sliding); absent in older files (the family's default)."""
    pattern = meta.raw("attention.sliding_window_pattern")
    if pattern is None or isinstance(pattern, int):
        return pattern or default
    n = next((i + 1 for i, sliding in enumerate(pattern) if not sliding), len(pattern) + 1)
    if any(bool(sliding) != ((i + 1) % n != 0) for i, sliding in enumerate(pattern)):
        raise GGUFError(f"{meta.arch}'s sliding-window layers are not every {n}th layer global: {pattern}")
    return n


def _gemma3(meta: Meta, weights: Weights, common: Config) -> Config:
    return {
        "sliding_window": meta.get("attention.sliding_window", 512),
        "sliding_window_pattern": _window_pattern(meta, 6),
        "rope_local_base_freq": meta.get("rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": _query_scale_dims(meta, common, wide_model_layers=62),
    }


def _phi3(meta: Meta, weights: Weights, common: Config) -> Config:
    rope_dims = meta.get("rope.dimension_count") or common["head_dim"]
    out: Config = {"partial_rotary_factor": rope_dims / common["head_dim"]}
    original = meta.get("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in weights:
        out["rope_scaling"] = {
            "type": "longrope",
            "long_factor": weights["rope_factors_long.weight"].tolist(),
            "short_factor": weights["rope_factors_short.weight"].tolist(),
        }
        out["original_max_position_embeddings"] = original or common["max_position_embeddings"]
    return out


def _experts(meta: Meta, common: Config) -> Config:
    return {
        "num_experts": meta.get("expert_count"),
        "num_experts_per_tok": meta.get("expert_used_count"),
        "moe_intermediate_size": meta.get("expert_feed_forward_length"),
    }


def _qwen3moe(meta: Meta, weights: Weights, common: Config) -> Config:
    return _experts(meta, common) | {
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # llama.cpp's qwen3moe normalises the chosen experts' weights (Qwen3's norm_topk_prob)
        "norm_topk_prob": bool(meta.get("expert_weights_norm", True)),
        "intermediate_size": common["intermediate_size"] or meta.get("expert_feed_forward_length"),
    }


def _qwen2moe(meta: Meta, weights: Weights, common: Config) -> Config:
    return _experts(meta, common) | {
        "shared_expert_intermediate_size": meta.get("expert_shared_feed_forward_length"),
        "intermediate_size": common["intermediate_size"] or meta.get("expert_feed_forward_length"),
    }


def _olmo2(meta: Meta, weights: Weights, common: Config) -> Config:
    return {"attention_bias": False, "mlp_bias": False}


def _granite(meta: Meta, weights: Weights, common: Config) -> Config:
    return {
        "attention_multiplier": meta.get("attention.scale", common["head_dim"] ** -0.5),
        "embedding_multiplier": meta.get("embedding_scale", 1.0),
        "residual_multiplier": meta.get("residual_scale", 1.0),
        "logits_scaling": meta.get("logit_scale", 1.0),
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
    }


def _granitemoe(meta: Meta, weights: Weights, common: Config) -> Config:
    return _granite(meta, weights, common) | {
        "num_local_experts": meta.get("expert_count"),
        "num_experts_per_tok": meta.get("expert_used_count"),
        "intermediate_size": meta.get("expert_feed_forward_length") or common["intermediate_size"],
    }


def _olmoe(meta: Meta, weights: Weights, common: Config) -> Config:
    # llama.cpp's olmoe does not renormalise the chosen experts' weights (OLMoE's norm_topk_prob)
    out = _experts(meta, common) | {"norm_topk_prob": bool(meta.get("expert_weights_norm", False))}
    out.pop("moe_intermediate_size")  # OLMoE's experts are intermediate_size wide
    out["intermediate_size"] = meta.get("expert_feed_forward_length") or common["intermediate_size"]
    return out


def _gpt_oss(meta: Meta, weights: Weights, common: Config) -> Config:
    n_layers = common["num_hidden_layers"]
    out: Config = {
        "num_local_experts": meta.get("expert_count"),
        "num_experts_per_tok": meta.get("expert_used_count"),
        "intermediate_size": meta.get("expert_feed_forward_length"),
        "sliding_window": meta.get("attention.sliding_window", 128),
        # llama.cpp: even layers slide, odd layers are global (HF's layer_types, not in the metadata)
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
    }
    return out


def _mistral3(meta: Meta, weights: Weights, common: Config) -> Config:
    """Ministral 3: llama's body, YaRN, and Llama 4's query scaling by position
    (``1 + beta * log(1 + floor(pos / length))``, 1 below ``length``) in mlx-lm's ``rope_parameters``."""
    params: Config = {"rope_theta": common["rope_theta"], "rope_type": "default"}
    length = meta.get("attention.temperature_length")
    if meta.get("rope.scaling.type") == "yarn":
        original = meta.get("rope.scaling.original_context_length")
        if length and original and length != original:
            raise GGUFError(
                f"mistral3's YaRN context ({original}) and query-scaling length ({length}) differ; "
                "mlx-lm's ministral3 takes one original_max_position_embeddings"
            )
        length = length or original
        params |= {
            "rope_type": "yarn",
            "factor": meta.get("rope.scaling.factor"),
            "beta_fast": meta.get("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": meta.get("rope.scaling.yarn_beta_slow", 1.0),
            "mscale": 1.0,
            # llama.cpp's converter writes 0.1 * mscale_all_dim
            "mscale_all_dim": meta.get("rope.scaling.yarn_log_multiplier", 0.0) / 0.1,
        }
    params["original_max_position_embeddings"] = length or common["max_position_embeddings"]
    params["llama_4_scaling_beta"] = meta.get("attention.temperature_scale", 0.0)
    return {"rope_parameters": params, "rope_scaling": None}


def _as_row(x: mx.array) -> mx.array:
    return x.reshape(1, -1)


_MOE_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")

ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", LLAMA_NAMES, permuted_qk=True),
    "mistral3": GGUFArch("ministral3", LLAMA_NAMES, _mistral3, permuted_qk=True),
    "qwen2": GGUFArch("qwen2", LLAMA_NAMES),
    "qwen3": GGUFArch("qwen3", LLAMA_NAMES),
    "gemma": GGUFArch("gemma", LLAMA_NAMES, norm_offset=1.0),
    "gemma2": GGUFArch("gemma2", _ATTENTION | _MLP | _SANDWICH_NORMS, _gemma2, norm_offset=1.0),
    "gemma3": GGUFArch("gemma3_text", _ATTENTION | _MLP | _SANDWICH_NORMS, _gemma3, norm_offset=1.0),
    "phi3": GGUFArch(
        "phi3",
        _PRE_NORMS
        | {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj"}
        | {"ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},  # ffn_up holds gate then up
        _phi3,
    ),
    "qwen3moe": GGUFArch(
        "qwen3_moe", _ATTENTION | _PRE_NORMS | _SWITCH_EXPERTS, _qwen3moe, required=_MOE_KEYS
    ),
    "qwen2moe": GGUFArch(
        "qwen2_moe",
        _ATTENTION
        | _PRE_NORMS
        | _SWITCH_EXPERTS
        | {
            "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
            "ffn_up_shexp": "mlp.shared_expert.up_proj",
            "ffn_down_shexp": "mlp.shared_expert.down_proj",
            "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        },
        _qwen2moe,
        required=(*_MOE_KEYS, "expert_shared_feed_forward_length"),
        reshape={"ffn_gate_inp_shexp.weight": _as_row},  # GGUF keeps the shared gate as a vector
    ),
    "olmo2": GGUFArch(
        "olmo2",
        _ATTENTION
        | _MLP
        | {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        _olmo2,
    ),
    "granite": GGUFArch("granite", LLAMA_NAMES, _granite, permuted_qk=True),
    "granitemoe": GGUFArch(
        "granitemoe",
        _ATTENTION
        | _PRE_NORMS
        | {
            "ffn_gate_inp": "block_sparse_moe.router.layer",
            "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
            "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
            "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
        },
        _granitemoe,
        permuted_qk=True,
        required=("expert_count", "expert_used_count"),
    ),
    "olmoe": GGUFArch(
        "olmoe",
        _ATTENTION | _PRE_NORMS | _SWITCH_EXPERTS,
        _olmoe,
        required=("expert_count", "expert_used_count"),
    ),
    "gpt-oss": GGUFArch(
        "gpt_oss",
        _ATTENTION
        | {
            "attn_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "attn_sinks": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
            "ffn_gate_exps": "mlp.experts.gate_proj",
            "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj",
        },
        _gpt_oss,
        required=_MOE_KEYS,
    ),
}

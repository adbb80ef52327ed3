"""Tiny random GGUF files of every architecture family, written the way llama.cpp's converter writes
them, with the mlx-lm model whose logits a loaded file must reproduce.

The tensor names come from gguf-py's ``TensorNameMap`` (the table llama.cpp's convert_hf_to_gguf.py
renames Hugging Face tensors with), not from Duet's loader, and each family's converter quirks are
applied here as the converter applies them: llama/granite Q and K rows permuted for ggml's RoPE,
Gemma norms stored as ``1 + w``, gpt-oss's sinks named ``attn_sinks.weight``. The metadata keys are
written with ``GGUFWriter``'s own methods. So a loader that maps a family wrongly fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import mlx.nn as nn
import numpy as np
from gguf.constants import MODEL_ARCH

from tests.gguf_quantize import (
    MERGES,
    SPECIALS,
    TOKENS,
    tiny_config,
    tiny_model,
    write_model_tensors,
)

Q = gguf.GGMLQuantizationType

_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

# GGUF architecture -> (mlx-lm module, the family's tiny config beyond gguf_quantize's tiny_config)
FAMILIES: dict[str, tuple[str, dict]] = {
    "gemma2": ("gemma2", {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                          "query_pre_attn_scalar": 16.0}),
    "gemma3": ("gemma3_text", {"sliding_window": 8, "sliding_window_pattern": 2, "rope_theta": 1e6,
                               "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 16.0}),
    "phi3": ("phi3", {"tie_word_embeddings": False, "vocab_size": len(TOKENS) + 1}),
    "qwen3moe": ("qwen3_moe", _EXPERTS | {"decoder_sparse_step": 1, "mlp_only_layers": [],
                                          "norm_topk_prob": True, "tie_word_embeddings": False}),
    "qwen2moe": ("qwen2_moe", _EXPERTS | {"shared_expert_intermediate_size": 64, "tie_word_embeddings": False}),
    "olmo2": ("olmo2", {"tie_word_embeddings": False}),
    "granite": ("granite", {"logits_scaling": 4.0, "attention_multiplier": 0.2, "embedding_multiplier": 6.0,
                            "residual_multiplier": 0.5, "attention_bias": False, "mlp_bias": False,
                            "tie_word_embeddings": True}),
    "granitemoe": ("granitemoe", {"logits_scaling": 4.0, "attention_multiplier": 0.2,
                                  "embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_bias": False,
                                  "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": True}),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "num_key_value_heads": 4,
                        "tie_word_embeddings": False}),
    "mistral3": ("ministral3", {"tie_word_embeddings": False, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0, "llama_4_scaling_beta": 0.1}}),
    "gpt-oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                            "layer_types": ["sliding_attention", "full_attention"]}),
}  # fmt: skip
_GGUF_ARCH = {
    "gemma2": MODEL_ARCH.GEMMA2, "gemma3": MODEL_ARCH.GEMMA3, "phi3": MODEL_ARCH.PHI3,
    "qwen3moe": MODEL_ARCH.QWEN3MOE, "qwen2moe": MODEL_ARCH.QWEN2MOE, "olmo2": MODEL_ARCH.OLMO2,
    "granite": MODEL_ARCH.GRANITE, "gpt-oss": MODEL_ARCH.GPT_OSS, "granitemoe": MODEL_ARCH.GRANITE_MOE,
    "olmoe": MODEL_ARCH.OLMOE, "mistral3": MODEL_ARCH.MISTRAL3,
}  # fmt: skip


MOE_FAMILIES = {"qwen3moe", "qwen2moe", "gpt-oss", "granitemoe", "olmoe"}


def family_config(arch: str, **overrides) -> dict:
    module, extra = FAMILIES[arch]
    return tiny_config(module) | extra | overrides


def _gguf_tensor_name(tmap: gguf.TensorNameMap, key: str, arch: str) -> str:
    # mlx-lm keeps stacked experts under switch_mlp; Hugging Face's stacked name is mlp.experts
    key = key.replace(".block_sparse_moe.switch_mlp.", ".mlp.experts.")  # Granite MoE's, split
    name = tmap.get_name(key.replace(".switch_mlp.", ".experts."), try_suffixes=(".weight", ".bias"))
    assert name is not None, f"gguf-py maps no {arch} tensor to {key}"
    if arch == "gpt-oss" and name.endswith("attn_sinks"):
        name += ".weight"  # llama.cpp's gpt-oss converter names the sinks so
    return name


def _write_metadata(writer: gguf.GGUFWriter, arch: str, c: dict) -> None:
    writer.add_name("tiny random model")  # not "phi3": llama.cpp special-cases that name
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_rope_dimension_count(int(c["head_dim"] * c.get("partial_rotary_factor", 1.0)))
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        writer.add_sliding_window(4096)
    if arch == "gemma3":
        writer.add_sliding_window(c["sliding_window"])
        writer.add_sliding_window_pattern(c["sliding_window_pattern"])
        writer.add_rope_freq_base_swa(c["rope_local_base_freq"])
    if "num_experts" in c or "num_local_experts" in c:
        writer.add_expert_count(c.get("num_experts") or c["num_local_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
        width = (
            "moe_intermediate_size" if c["model_type"] in ("qwen3_moe", "qwen2_moe") else "intermediate_size"
        )
        writer.add_expert_feed_forward_length(c[width])
    if c["model_type"] == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if arch.startswith("granite"):
        writer.add_attention_scale(c["attention_multiplier"])
        writer.add_embedding_scale(c["embedding_multiplier"])
        writer.add_residual_scale(c["residual_multiplier"])
        writer.add_logit_scale(c["logits_scaling"])
    if arch == "gpt-oss":
        writer.add_sliding_window(c["sliding_window"])
    # llama.cpp looks Phi-3's end-of-turn token up by its text
    tokens = TOKENS + ["<|end|>"] * (c["vocab_size"] - len(TOKENS))
    if (scaling := c.get("rope_scaling")) and scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if (scaling := c.get("rope_scaling")) and scaling.get("type") == "longrope":  # Phi-3.5's LongRoPE
        writer.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
        ratio = c["max_position_embeddings"] / c["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(ratio) / np.log(c["original_max_position_embeddings"])))
        )
    if params := c.get("rope_parameters"):  # Ministral 3's YaRN and query scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        if params["mscale_all_dim"]:
            writer.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
        writer.add_attn_temperature_scale(params["llama_4_scaling_beta"])
        writer.add_attn_temperature_length(params["original_max_position_embeddings"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS or t == "<|end|>" else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def default_qtype(name: str, shape: tuple[int, ...]) -> Q:
    """Q8_0 for weight matrices, F32 for the rest (norms, biases, sinks) and for the routers, as
    llama.cpp's quantizer leaves them."""
    return Q.Q8_0 if len(shape) >= 2 and name.endswith(".weight") and ".ffn_gate_inp" not in name else Q.F32


def write_family_gguf(
    path: Path,
    arch: str,
    *,
    quantized: bool = True,
    qtype_of: Callable[[str, tuple[int, ...]], Q] = default_qtype,
    **overrides,
) -> nn.Module:
    """Write a tiny random ``arch`` GGUF at ``path``; returns the mlx-lm model (its weights the values
    the file's blocks decode to, by gguf-py's own dequantizer) the loaded file must reproduce.
    ``qtype_of(name, shape)`` picks each tensor's type when ``quantized``."""
    config = family_config(arch, **overrides)
    model = tiny_model(config["model_type"], config)
    if arch == "gemma3":  # Gemma 3 GGUFs tie the output layer to the embeddings (no output tensor)
        model.tie_word_embeddings = True
        model.pop("lm_head")
    tmap = gguf.get_tensor_name_map(_GGUF_ARCH[arch], config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch=arch)
    _write_metadata(writer, arch, config)

    return write_model_tensors(
        writer,
        model,
        name_of=lambda key: _gguf_tensor_name(tmap, key, arch),
        qtype_of=qtype_of if quantized else lambda _name, _shape: Q.F32,
        # llama.cpp stores Gemma's norms with the +1 folded in
        stored_values=lambda name, w: (
            w + 1.0 if arch.startswith("gemma") and name.endswith("norm.weight") else w
        ),
        permuted_heads=(config["num_attention_heads"], config["num_key_value_heads"])
        if arch.startswith("granite") or arch == "mistral3"
        else None,
    )

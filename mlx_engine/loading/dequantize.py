"""Turn a quantized mlx model back into a dense one.

MLX's own CPU quantized matmul is far slower than a dense float one. On CPU, quantized weights stay
quantized when Duet's CPU kernels are built (``weight_policy.keep_quantized``); without them, or with
``--weights dense``, they are expanded here once, at load time.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path, tree_unflatten

from mlx_engine.mlx_tree import flat_parameters


def _dense_weight(layer: nn.QuantizedLinear | nn.QuantizedEmbedding, dtype: mx.Dtype) -> mx.array:
    scales, biases = layer.scales, layer.get("biases")
    # Expand in float32 so fp16/bf16 scales lose nothing, then cast once.
    if mx.issubdtype(scales.dtype, mx.floating):
        scales = scales.astype(mx.float32)
    if biases is not None:
        biases = biases.astype(mx.float32)
    w = mx.dequantize(
        layer.weight,
        scales=scales,
        biases=biases,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )
    return w.astype(dtype)


def _dense_layer(layer: nn.Module, dtype: mx.Dtype) -> nn.Module:
    if isinstance(layer, nn.QuantizedLinear):
        bias = layer.get("bias")
        out_dims, in_dims = layer.weight.shape[0], layer.scales.shape[-1] * layer.group_size
        dense = nn.Linear(in_dims, out_dims, bias=bias is not None)
        dense.weight = _dense_weight(layer, dtype)
        if bias is not None:
            dense.bias = bias.astype(dtype)
        return dense
    if isinstance(layer, nn.QuantizedEmbedding):
        embedding = nn.Embedding(layer.num_embeddings, layer.dims)
        embedding.weight = _dense_weight(layer, dtype)
        return embedding
    return layer


def dequantize_model(model: nn.Module, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Replace every ``QuantizedLinear``/``QuantizedEmbedding`` in ``model`` with a dense layer of
    ``dtype`` (in place; the model is also returned). Every other floating-point parameter is cast to
    ``dtype`` too, so the whole model computes in one precision. Arrays are left lazy: ``mx.eval`` the
    parameters afterwards to pay the conversion once."""
    leaves = tree_map_with_path(
        lambda _path, m: _dense_layer(m, dtype), model.leaf_modules(), is_leaf=nn.Module.is_module
    )
    model.update_modules(leaves)
    params = [(k, v.astype(dtype)) for k, v in flat_parameters(model) if mx.issubdtype(v.dtype, mx.floating)]
    model.update(tree_unflatten(params))
    return model

"""Route a model's quantized layers through the CPU kernel.

``use_cpu_kernels(model)`` turns every ``QuantizedLinear`` whose format the kernel supports into a
:class:`CPUQuantizedLinear` and every such ``QuantizedEmbedding`` into a
:class:`CPUQuantizedEmbedding` (its ``as_linear``, the tied LM head, uses the kernel; the lookup stays
MLX's, or the kernel's dequantize for two-level scales and a table in 16-row panels), and every ``nn.RMSNorm`` into a :class:`CPURMSNorm` (one op instead of MLX's ~8-op CPU
fallback) and every ``nn.RoPE`` into a :class:`CPURoPE` (one op instead of ~25), and every mlx-lm MLP
that is exactly ``down_proj(swiglu(gate_proj(x), up_proj(x)))`` into a subclass whose activation is
the ``swiglu`` kernel (vectorised instead of a scalar exp per element), likewise the activation
of mlx-lm's ``SwitchGLU`` (a mixture of experts' ``SwiGLU`` module), mlx-lm's Qwen3-MoE block
into a subclass whose routing of a few tokens is one op (``route.moe_route``), and every mlx-lm
``QuantizedSwitchLinear`` (the experts of a mixture-of-experts layer) of a supported format into a
``CPUQuantizedSwitchLinear`` whose product is the ``gather_qmm`` kernel, only when the extension is
built. Only the class changes: parameters, names and ``nn.quantize``'s bookkeeping stay as they are,
so mlx-lm's model code and weight loading see the same modules.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

from cpu_kernels.gather_qmm import SPEC as GATHER_SPEC
from cpu_kernels.gather_qmm import gather_qmm
from cpu_kernels.norm import rms_norm
from cpu_kernels.qmm import (
    PANEL_ROWS,
    SPEC,
    dequantize_rows,
    int8_gemm,
    on_tiles,
    panel_form,
    quantized_matmul,
)
from cpu_kernels.rope import rope
from cpu_kernels.route import ROUTE_ROWS
from cpu_kernels.spec import FLOATS, available, extension, x_planes
from cpu_kernels.swiglu import swiglu


def _product(layer: nn.QuantizedLinear | nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    """``x @ dequantize(layer).T`` through the kernel. A few rows of x (decode: ~200 calls a step) go
    straight to the extension: ``use_cpu_kernels`` checked the layer's format when it switched it."""
    k = x.shape[-1]
    ext = extension()
    few = (
        x.size < dequantize_rows(layer["weight"], layer["scales"], layer.bits) * k
        or int8_gemm(layer.bits)
        or on_tiles(layer["weight"], layer["scales"], layer.bits)
    )
    if ext is not None and k and few and x.dtype in FLOATS:
        return ext.quantized_matmul(
            x,
            layer["weight"],
            layer["scales"],
            layer["biases"],
            layer.group_size,
            layer.bits,
            x_planes=x_planes(),
        )
    return quantized_matmul(
        x,
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        transpose=True,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )


class CPUQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = _product(self, x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class CPUQuantizedEmbedding(nn.QuantizedEmbedding):
    # set by ``scales.half_scales`` / ``two_level_scales`` / ``implicit_biases`` when they store the
    # scales in float16, two levels or without biases: the dtype the lookup's rows are computed in,
    # the model's (the tied LM head's product is float32 either way)
    lookup_dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        ratio = self["biases"] if self["biases"].size == 1 else None  # scales.implicit_biases
        if panel_form(self["weight"], self["scales"]):
            return self._panel_rows(x, ratio)
        scales = self["scales"][x]
        biases = self["biases"][x] if ratio is None else None
        ext = extension()
        if scales.dtype == mx.uint8 and ext is not None:
            # two levels (scales.two_level_scales) or Q6_K's own (biases the ratio): the kernel's dequantize
            rows = ext.dequantize(
                self["weight"][x].reshape(-1, self["weight"].shape[-1]),
                scales.reshape(-1, scales.shape[-1]),
                ratio if biases is None else biases.reshape(-1, biases.shape[-1]),
                self.group_size,
                self.bits,
            )
            return rows.reshape(*x.shape, rows.shape[-1]).astype(self.lookup_dtype or mx.float32)
        if self.lookup_dtype is not None:
            scales = scales.astype(self.lookup_dtype)
        if ratio is not None:  # a symmetric type: each bias is the ratio times its scale
            biases = scales * ratio.astype(scales.dtype)
        elif self.lookup_dtype is not None and biases is not None:
            biases = biases.astype(self.lookup_dtype)
        return mx.dequantize(
            self["weight"][x], scales, biases, group_size=self.group_size, bits=self.bits, mode=self.mode
        )

    def _panel_rows(self, x: mx.array, ratio: mx.array | None) -> mx.array:
        """The rows of a table in 16-row panels (``cpu_kernels.panels``: a tied LM head's, which the panel
        kernel reads): each id's whole panel dequantized by the kernel, then its row taken (16 rows for
        one, ~20 µs at a 2048-wide table: what decode looks up a step)."""
        ext = extension()
        assert ext is not None  # only the extension puts a table in panels
        ids = x.reshape(-1)
        panel = ids // PANEL_ROWS
        w, k = self["weight"], self["weight"].shape[-1]
        rows = ext.dequantize(
            w.reshape(w.shape[0] // PANEL_ROWS, -1)[panel].reshape(-1, k),
            self["scales"][panel],
            ratio if ratio is not None else self["biases"][panel],
            self.group_size,
            self.bits,
        )
        rows = rows.reshape(ids.size, PANEL_ROWS, -1)
        picked = mx.take_along_axis(rows, (ids % PANEL_ROWS).reshape(-1, 1, 1), axis=1)
        return picked.reshape(*x.shape, rows.shape[-1]).astype(self.lookup_dtype or mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return _product(self, x)


class CPURMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


class CPURoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return rope(
            x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset
        )


# An MLP class whose __call__ is exactly mlx-lm's ``down_proj(swiglu(gate_proj(x), up_proj(x)))``
# (Llama, Qwen, Mistral, SmolLM, ...) -> its subclass through the swiglu kernel; None: not that MLP.
_SWIGLU_MLPS: dict[type, type | None] = {}


def _swiglu_mlp(cls: type) -> type | None:
    if cls not in _SWIGLU_MLPS:
        code = getattr(cls.__call__, "__code__", None)
        module = sys.modules.get(cls.__module__)
        activations = sys.modules.get("mlx_lm.models.activations")
        plain = (
            code is not None
            and set(code.co_names) == {"down_proj", "swiglu", "gate_proj", "up_proj"}
            and activations is not None
            and getattr(module, "swiglu", None) is getattr(activations, "swiglu", False)
        )

        def __call__(self, x: mx.array) -> mx.array:
            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

        _SWIGLU_MLPS[cls] = type(f"CPU{cls.__name__}", (cls,), {"__call__": __call__}) if plain else None
    return _SWIGLU_MLPS[cls]


# mlx-lm's SwiGLU activation module (a mixture of experts' SwitchGLU: ``swiglu(gate, x)``, its
# ``mx.compile``d ``silu(gate) * x``) -> its subclass through the swiglu kernel; made on first use.
_SWITCH_SWIGLUS: dict[type, type] = {}


def _switch_swiglu(cls: type) -> type | None:
    """The kernel's subclass of ``cls`` when ``cls`` is exactly mlx-lm's ``switch_layers.SwiGLU`` and
    the ``swiglu`` it calls is mlx-lm's own."""
    module = sys.modules.get("mlx_lm.models.switch_layers")
    activations = sys.modules.get("mlx_lm.models.activations")
    if (
        module is None
        or activations is None
        or cls is not getattr(module, "SwiGLU", None)
        or getattr(module, "swiglu", None) is not getattr(activations, "swiglu", False)
    ):
        return None
    if cls not in _SWITCH_SWIGLUS:

        def __call__(self: nn.Module, x: mx.array, gate: mx.array) -> mx.array:
            return swiglu(gate, x)

        _SWITCH_SWIGLUS[cls] = type("CPUSwitchSwiGLU", (cls,), {"__call__": __call__})
    return _SWITCH_SWIGLUS[cls]


# mlx-lm's Qwen3-MoE block -> its subclass routing through the moe_route kernel; made on first use.
_MOE_BLOCKS: dict[type, type] = {}
# the names Qwen3MoeSparseMoeBlock.__call__ uses (mlx-lm 0.31): any other code keeps its own call
_QWEN3_MOE_CALL_NAMES = {
    "all_sum",
    "argpartition",
    "astype",
    "distributed",
    "dtype",
    "gate",
    "mx",
    "norm_topk_prob",
    "sharding_group",
    "softmax",
    "stop_gradient",
    "sum",
    "sum_gradients",
    "switch_mlp",
    "take_along_axis",
    "top_k",
}


def _moe_block(cls: type) -> type | None:
    """The kernel's subclass of ``cls`` when ``cls`` is exactly mlx-lm's ``Qwen3MoeSparseMoeBlock``
    with the ``__call__`` this was written against."""
    module = sys.modules.get("mlx_lm.models.qwen3_moe")
    code = getattr(cls.__call__, "__code__", None)
    if (
        module is None
        or cls is not getattr(module, "Qwen3MoeSparseMoeBlock", None)
        or code is None
        or set(code.co_names) != _QWEN3_MOE_CALL_NAMES
    ):
        return None
    if cls not in _MOE_BLOCKS:
        own = cls.__call__

        def __call__(self: nn.Module, x: mx.array) -> mx.array:
            """mlx-lm's block with the routing as one op, for a few tokens (decode) on one machine
            with a dense router; anything else (a prefill, a quantized or sharded router) its own."""
            ext = extension()
            gate = self.gate
            if (
                ext is None
                or self.sharding_group is not None
                or type(gate) is not nn.Linear
                or "bias" in gate
                or x.dtype not in FLOATS
                or x.size > ROUTE_ROWS * x.shape[-1]
            ):
                return own(self, x)
            inds, scores = ext.moe_route(x, gate["weight"], self.top_k, self.norm_topk_prob)
            y = self.switch_mlp(x, inds)
            return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)

        _MOE_BLOCKS[cls] = type(f"CPU{cls.__name__}", (cls,), {"__call__": __call__})
    return _MOE_BLOCKS[cls]


# mlx-lm's QuantizedSwitchLinear -> its subclass CPUQuantizedSwitchLinear. Made on first use from the
# class the model's own modules are (mlx-lm is not imported here: importing it pulls in transformers).
SWITCH_LINEARS: dict[type, type] = {}


def _switch_linear(cls: type) -> type | None:
    """The kernel's subclass of ``cls`` when ``cls`` is exactly mlx-lm's ``QuantizedSwitchLinear``."""
    module = sys.modules.get("mlx_lm.models.switch_layers")
    if module is None or cls is not getattr(module, "QuantizedSwitchLinear", None):
        return None
    if cls not in SWITCH_LINEARS:

        def __call__(
            self: nn.Module, x: mx.array, indices: mx.array, sorted_indices: bool = False
        ) -> mx.array:
            """mlx-lm's ``QuantizedSwitchLinear.__call__`` with the product through the kernel (the
            extension straight away for float x, as ``use_cpu_kernels`` checked the format)."""
            ext = extension()
            if ext is not None and x.dtype in FLOATS and x.ndim >= 2:
                y = ext.gather_quantized_matmul(
                    x,
                    self["weight"],
                    self["scales"],
                    self["biases"],
                    indices,
                    self.group_size,
                    self.bits,
                    x_planes=x_planes(),
                )
            else:
                y = gather_qmm(
                    x,
                    self["weight"],
                    self["scales"],
                    self.get("biases"),
                    rhs_indices=indices,
                    transpose=True,
                    group_size=self.group_size,
                    bits=self.bits,
                    mode=self.mode,
                    sorted_indices=sorted_indices,
                )
            if "bias" in self:
                y = y + mx.expand_dims(self["bias"][indices], -2)
            return y

        SWITCH_LINEARS[cls] = type("CPUQuantizedSwitchLinear", (cls,), {"__call__": __call__})
    return SWITCH_LINEARS[cls]


def _scales_dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype the kernels read a layer's scales as: Q6_K's own form (groups of 16, uint8: the
    loader's ``q6k``) is float32 steps times int8 multiples."""
    dtype = layer["scales"].dtype
    return mx.float32 if dtype == mx.uint8 and layer.group_size == 16 else dtype


def _switch_supported(layer: nn.Module) -> bool:
    return (
        layer.mode == "affine"
        and layer.get("biases") is not None
        and getattr(layer, "global_scale", None) is None
        and layer["weight"].ndim == 3
        and GATHER_SPEC.supports(bits=layer.bits, group_size=layer.group_size, dtype=_scales_dtype(layer))
    )


def _supported(layer: nn.QuantizedLinear | nn.QuantizedEmbedding) -> bool:
    return (
        layer.mode == "affine"
        and layer.get("biases") is not None
        and SPEC.supports(bits=layer.bits, group_size=layer.group_size, dtype=_scales_dtype(layer))
    )


_SUBCLASSES = (_swiglu_mlp, _moe_block, _switch_swiglu)


def is_kernel_layer(layer: nn.Module) -> bool:
    """Whether ``use_cpu_kernels`` switched this layer: its products are the CPU kernels'."""
    return (
        isinstance(layer, (CPUQuantizedLinear, CPUQuantizedEmbedding))
        or type(layer) in SWITCH_LINEARS.values()
    )


def use_cpu_kernels(model: nn.Module) -> int:
    """Switch the model's supported quantized layers (expert stacks included), its RMSNorms, RoPEs and
    SwiGLU MLPs to the CPU kernels (in place); returns how many layers were switched."""
    switched = 0
    norms = available()
    for _, layer in model.named_modules():
        if type(layer) is nn.RMSNorm and norms:
            layer.__class__ = CPURMSNorm
            switched += 1
            continue
        if type(layer) is nn.RoPE and norms:
            layer.__class__ = CPURoPE
            switched += 1
            continue
        # mlx-lm classes whose __call__ gets a kernel subclass: the MLP, the MoE block, its activation
        kernel_class = next((c for find in _SUBCLASSES if norms and (c := find(type(layer)))), None)
        if kernel_class is not None:
            layer.__class__ = kernel_class
            switched += 1
            continue
        switch = _switch_linear(type(layer)) if norms else None
        if switch is not None:
            if _switch_supported(layer):
                layer.__class__ = switch
                switched += 1
            continue
        if type(layer) is nn.QuantizedLinear and _supported(layer):
            layer.__class__ = CPUQuantizedLinear
            switched += 1
        elif type(layer) is nn.QuantizedEmbedding and _supported(layer):
            layer.__class__ = CPUQuantizedEmbedding
            switched += 1
    return switched

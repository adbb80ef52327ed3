"""The CPU kernels' weight layout: Q4_K, Q5_K and Q6_K layers in 16-row panels where the panel kernel runs.

``cpu_kernels.panels`` regroups a model's Q4_K, Q5_K and Q6_K layers for the panel kernel (about twice the
row kernel's rate at 1-16 rows of x on AVX-512 VNNI), which both maths use (exact math with x in three
int8 planes). The engine puts them there each time one is made (a model loaded before may have been
put back in rows by a caller).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_engine import heap
from mlx_engine.backend import backend_name


def use_panel_layout(model: nn.Module) -> int:
    """Put ``model``'s eligible layers in 16-row panels, the layout the CPU kernels read fastest on
    AVX-512 VNNI with either math; returns how many layers changed (0 off the CPU, without the kernels
    or the panel kernel, or with nothing to change). The new arrays are on small pages: the engine
    moves every weight onto huge pages once its layout is in place (``Engine``)."""
    if backend_name() != "cpu":
        return 0
    from cpu_kernels.panels import use_panels

    changed = use_panels(model, True)
    if changed:  # the replaced arrays go back to the system
        mx.clear_cache()
        heap.release_free()
    return len(changed)


def panel_types(model: nn.Module) -> list[str]:
    """The quant types of the model's layers in 16-row panels ("Q4_K", "Q5_K", "Q6_K"), in that order."""
    if backend_name() != "cpu":
        return []
    from cpu_kernels.panels import in_panels as layer_in_panels

    bits = {layer.bits for _, layer in model.named_modules() if layer_in_panels(layer)}
    return [name for b, name in ((4, "Q4_K"), (5, "Q5_K"), (6, "Q6_K")) if b in bits]

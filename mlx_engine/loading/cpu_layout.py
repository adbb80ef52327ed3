"""The CPU kernels' weight layout for the math in force: Q4_K layers in 16-row panels.

``cpu_kernels.panels`` regroups a model's 4-bit two-level layers for the int8 panel kernel (about
twice the row kernel's rate at 1-16 rows of x on AVX-512 VNNI). Exact math runs its linear layers on
the same kernel (x in three int8 planes), but its gather over a stack of experts reads panels only
through a conversion per call, so the engine fits the layout to the math each time one is made: every
eligible layer in panels when the process's math is int8, the linear layers alone when it is exact.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_engine import heap
from mlx_engine.backend import backend_name
from mlx_engine.huge_pages import use_huge_pages


def fit_layout_to_math(model: nn.Module) -> int:
    """Put ``model``'s eligible layers in the layout the CPU math in force reads fastest; returns how
    many layers changed (0 off the CPU, without the kernels, or with nothing to change)."""
    if backend_name() != "cpu":
        return 0
    from cpu_kernels.panels import use_panels
    from cpu_kernels.spec import int8_math

    changed = use_panels(model, True, stacks=int8_math())
    if changed:
        # the replaced arrays go back to the system; the new ones get huge pages as the loader's had
        mx.clear_cache()
        heap.release_free()
        use_huge_pages(layer[k] for layer in changed for k in ("weight", "scales", "biases"))
    return len(changed)


def in_panels(model: nn.Module) -> bool:
    """Whether any of the model's layers is in 16-row panels."""
    from cpu_kernels.panels import in_panels as layer_in_panels

    return any(layer_in_panels(layer) for _, layer in model.named_modules())

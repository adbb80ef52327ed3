"""Typed access to mlx's parameter trees.

``mlx.utils.tree_flatten`` is annotated as returning a list of pairs *or* a dict (it fills a dict when
given one as ``destination``); callers here always want the list.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def flat_parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    """``model``'s parameters as (dotted name, array) pairs, in ``tree_flatten`` order."""
    flat = tree_flatten(model.parameters())
    assert isinstance(flat, list)  # no ``destination`` dict given: tree_flatten returns a list
    return flat

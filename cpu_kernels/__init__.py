"""Duet's CPU kernels: quantized matrix products over MLX's affine layout, as an MLX C++ extension.

``spec.py`` holds one spec per kernel and the one backend switch (the built extension, or MLX's own
ops when it is missing); ``qmm.py`` is the quantized matmul; ``modules.py`` routes a model's
quantized layers through it; ``build.py`` builds ``_ext`` from ``src/`` (``make setup`` runs it).
"""

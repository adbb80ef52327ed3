"""Duet's CPU kernels, an MLX C++ extension: quantized matrix products over MLX's affine layout, and
fused RMSNorm and RoPE (one op each instead of MLX's composed CPU fallbacks).

``spec.py`` holds one spec per kernel and the one backend switch (the built extension, or MLX's own
ops when it is missing); ``qmm.py`` is the quantized matmul, ``gather_qmm.py`` its gather over stacked experts (mixture-of-experts layers), ``norm.py`` and ``rope.py`` the fused ops; ``modules.py``
routes a model's layers through them; ``build.py`` builds ``_ext`` from ``src/`` (``make setup`` runs it).
"""

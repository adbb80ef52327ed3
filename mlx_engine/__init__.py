"""Duet's MLX inference engine."""

__version__ = "0.1.0"

"""Import mlx-lm's model modules without running ``mlx_lm/__init__.py``.

``import mlx_lm.models.llama`` first runs the package's ``__init__``, which imports its
converter, generator and loader and through them ``transformers`` and ``huggingface_hub``: about
3 s of a 4-5 s cold start of ``duet generate`` on a GGUF, for modules a GGUF load never uses.
``install()`` puts the ``mlx_lm`` package in ``sys.modules`` without executing its ``__init__``:
submodules (``mlx_lm.models.*``, ``mlx_lm.generate``, ``mlx_lm.utils``) import as usual, each
pulling in what it needs itself, and the first attribute looked up on the package itself
(``mlx_lm.load``, ``from mlx_lm import generate``, ``mlx_lm.__version__``) runs the real
``__init__`` then, so every use of mlx-lm still sees the whole package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

PACKAGE = "mlx_lm"


def install() -> None:
    """Make ``mlx_lm`` a package whose ``__init__`` runs on first attribute use (no-op when it
    is imported already or not installed)."""
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    pkg = importlib.util.module_from_spec(spec)

    def __getattr__(name: str) -> object:
        # the real __init__, once: it fills this same module object (already in sys.modules)
        pkg.__dict__.pop("__getattr__", None)
        assert spec.loader is not None
        try:
            spec.loader.exec_module(pkg)
        except BaseException:
            sys.modules.pop(PACKAGE, None)  # a later import starts clean and raises the real error
            raise
        return getattr(pkg, name)

    pkg.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[PACKAGE] = pkg


def import_module(name: str) -> ModuleType:
    """``mlx_lm.<name>`` (e.g. ``models.llama``), without the package's ``__init__``."""
    install()
    return importlib.import_module(f"{PACKAGE}.{name}")

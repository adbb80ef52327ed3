"""mlx-lm's model modules load without the package's __init__ (and transformers), in a fresh process;
the package is whole as soon as anything uses it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
from mlx_engine.loading import mlx_lm_lazy

llama = mlx_lm_lazy.import_module("models.llama")
assert hasattr(llama, "Model")
assert "transformers" not in sys.modules, "the model module pulled in transformers"
assert "mlx_lm.utils" not in sys.modules and "mlx_lm.convert" not in sys.modules
import mlx_lm
from mlx_lm import load  # the first attribute runs the real __init__
assert callable(load) and mlx_lm.__version__ and callable(mlx_lm.generate)
assert "mlx_lm.utils" in sys.modules and "__getattr__" not in vars(mlx_lm)
try:
    mlx_lm.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("a missing attribute must still raise AttributeError")
print("ok")
"""


def test_model_modules_import_without_the_package_init():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

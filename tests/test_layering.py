"""The layout is the architecture: kernels <- mlx_engine <- peer <- app, one way.

import-linter checks the direction (``[tool.importlinter]`` in pyproject.toml; ``make test`` runs
``lint-imports`` too); this test runs the same contracts, and checks what import-linter does not:
no module imports another top-level package's private names (``from app.cli import _check_model``
ties two packages to an implementation detail).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "peer", "mlx_engine", "cpu_kernels", "metal_kernels")


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("import-linter is not installed: it is a dev requirement (pyproject.toml)")
    p = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout, p.stdout[-2000:]


def test_no_private_name_is_imported_across_packages():
    found = []
    for package, path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            target = node.module.split(".")[0]
            if target not in PACKAGES or target == package:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{alias.name}")
    assert not found, "\n".join(found)

"""Which BLAS MLX really calls, checked against the dynamic linker's own record of the binding.

Each case runs a fresh interpreter without LD_PRELOAD and with `LD_DEBUG=bindings`: glibc's loader
then logs which library it bound libmlx's `cblas_sgemm` to, the ground truth that `mlx_blas()`
must report and that `import mlx_engine` must make OpenBLAS.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlx_engine.blas_preload import ENV_DISABLE, openblas_path

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc dynamic linker (LD_DEBUG) only")

needs_openblas = pytest.mark.skipif(
    openblas_path() is None, reason="system OpenBLAS not installed (packaging/install_system_deps.sh)"
)

_BINDING = re.compile(
    r"binding file (\S*/libmlx\.so[.\d]*) \[\d+\] to (\S+) \[\d+\]: normal symbol `cblas_sgemm'"
)

_PROBE = """
import json
import mlx.core as mx
a = mx.ones((64, 64))
mx.eval(a @ a)  # an sgemm through MLX's CPU backend
from mlx_engine.blas import active_blas, mlx_blas
info = mlx_blas()
print(json.dumps({"name": info.name, "path": info.path, "active": active_blas()}))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "_DUET_REEXEC", ENV_DISABLE)}
    env.update(extra)
    return env


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _probe(tmp_path: Path, prelude: str, **env: str) -> tuple[dict, str]:
    """(what mlx_blas() says, the library ld.so bound libmlx's cblas_sgemm to)."""
    log = tmp_path / "ld"
    r = _run(prelude + _PROBE, _clean_env(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(log), **env))
    reported = json.loads(r.stdout.strip().splitlines()[-1])
    bound = None
    for file in sorted(tmp_path.glob("ld.*")):
        with open(file, errors="replace") as f:
            for line in f:
                m = _BINDING.search(line)
                if m:  # the first one is the relocation made when libmlx loaded
                    bound = os.path.realpath(m.group(2))
                    break
        if bound:
            break
    assert bound is not None, "ld.so logged no binding of libmlx's cblas_sgemm"
    return reported, bound


@needs_openblas
def test_import_mlx_engine_puts_mlx_on_openblas(tmp_path):
    reported, bound = _probe(tmp_path, "import mlx_engine\n")
    assert "openblas" in os.path.basename(bound).lower(), bound
    assert reported["path"] == bound
    assert reported["name"] == reported["active"] == "OpenBLAS"


def test_reference_blas_is_reported_as_such_when_disabled(tmp_path):
    # numpy's own OpenBLAS is mapped too: it must not be mistaken for MLX's
    reported, bound = _probe(tmp_path, "import numpy\nimport mlx_engine\n", **{ENV_DISABLE: "1"})
    assert reported["path"] == bound
    if os.path.basename(bound).startswith("libblas"):  # the mlx[cpu] wheel's netlib BLAS
        assert reported["name"] == "reference BLAS"
        assert reported["active"].startswith("reference BLAS (slow; unset DUET_NO_OPENBLAS")


@needs_openblas
def test_mlx_imported_first_keeps_its_blas_and_says_so(tmp_path):
    reported, bound = _probe(tmp_path, "import mlx.core\nimport mlx_engine\n")
    assert reported["path"] == bound
    assert reported["name"] != "OpenBLAS"  # too late to rebind: reported truthfully, not hoped for


_ENGINE_WARNINGS = """
import json, logging, sys
{prelude}
from mlx_engine import Engine
from mlx_engine.loading.loader import load_model

records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("mlx_engine").addHandler(handler)
loaded = load_model(sys.argv[1])
for _ in range(2):
    with Engine(loaded):
        pass
print(json.dumps([r.getMessage() for r in records if r.levelno >= logging.WARNING]))
"""


@needs_openblas
@pytest.mark.parametrize("mlx_first", [True, False], ids=["mlx-imported-first", "mlx_engine-first"])
def test_engine_warns_once_on_the_reference_blas(tiny_dirs, mlx_first):
    code = _ENGINE_WARNINGS.replace("{prelude}", "import mlx.core" if mlx_first else "")
    r = subprocess.run(
        [sys.executable, "-c", code, str(tiny_dirs("llama"))],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [w for w in json.loads(r.stdout.strip().splitlines()[-1]) if "BLAS" in w]
    if mlx_first:
        assert len(warnings) == 1, warnings  # two engines, one warning
        assert f"LD_PRELOAD={openblas_path()}" in warnings[0]
    else:
        assert warnings == []


_REEXEC = """
import os
{prelude}
from mlx_engine.blas import mlx_blas, reexec_with_openblas
reexec_with_openblas()
print(mlx_blas().name, os.environ.get("_DUET_REEXEC", "-"))
"""


@needs_openblas
@pytest.mark.parametrize(
    "prelude, expected",
    [("", "OpenBLAS -"), ("import mlx.core", "OpenBLAS 1")],
    ids=["loaded-in-process-no-reexec", "mlx-first-reexecs-with-ld-preload"],
)
def test_reexec_with_openblas_only_when_needed(prelude, expected):
    r = _run(_REEXEC.replace("{prelude}", prelude), _clean_env())
    assert r.stdout.strip().splitlines()[-1] == expected


AVX512 = {"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(
    "flags, environ, want",
    [
        (AVX512, {}, "SkylakeX"),  # an AVX-512 CPU, whatever its model number
        ({"avx2", "fma", "avx512f"}, {}, "Haswell"),  # AVX-512 without the rest SkylakeX's kernels use
        ({"sse4_2", "avx"}, {}, None),  # nothing to name: OpenBLAS's detection stands
        (AVX512, {"OPENBLAS_CORETYPE": "Zen"}, None),  # the user's choice is theirs
    ],
)
def test_openblas_core_is_named_by_the_cpus_instruction_sets(flags, environ, want):
    from mlx_engine.blas_preload import openblas_coretype

    if sys.platform != "linux" or os.uname().machine != "x86_64":
        want = None
    assert openblas_coretype(flags, environ) == want


def _named_core() -> str | None:
    """The core Duet names for this CPU when the user has named none."""
    from mlx_engine.blas_preload import openblas_coretype

    return openblas_coretype(environ={})


_CORENAME = """
import ctypes, json
from mlx_engine.blas_preload import preload_env
import mlx_engine  # loads OpenBLAS, naming its core where the CPU needs it
lib = ctypes.CDLL(preload_env()["LD_PRELOAD"].split(":")[0])
lib.openblas_get_corename.restype = ctypes.c_char_p
print(json.dumps({"core": lib.openblas_get_corename().decode(), "env": preload_env()}))
"""


@needs_openblas
@pytest.mark.skipif(
    _named_core() is None, reason="x86-64 with AVX2 only: elsewhere OpenBLAS's own detection is left alone"
)
def test_openblas_runs_the_kernels_of_the_cpus_instruction_sets(tmp_path):
    """Debian 12's OpenBLAS takes a CPU newer than itself (an Emerald Rapids Xeon) for a Prescott and
    runs SSE3 kernels, 6x slower: `import mlx_engine` names the core, and children get the same."""
    env = {k: v for k, v in _clean_env().items() if k != "OPENBLAS_CORETYPE"}
    got = json.loads(_run(_CORENAME, env).stdout.strip().splitlines()[-1])
    named = _named_core()
    assert got["core"] == named
    assert got["env"]["OPENBLAS_CORETYPE"] == named

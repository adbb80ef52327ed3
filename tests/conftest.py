from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

import mlx_engine  # noqa: E402, F401  (before anything imports mlx: it binds MLX to OpenBLAS)
from tests.tiny_models import make_tiny_model_dir  # noqa: E402

# Where Duet and the libraries it uses write per-user files. The suite points every one of them under
# pytest's session tmp dir, so a test run never leaves anything in the user's home directory
# (the Metal emulator's kernel builds alone are ~20 MB) and never depends on what is there.
_USER_DIRS = {
    "DUET_METAL_EMU_CACHE": "metal_emu",  # metal_kernels/emulator/build.py: compiled kernels
    "DUET_DATA_DIR": "duet_data",  # app/tui/store.py: conversations, input history
    "DUET_CONFIG_DIR": "duet_config",  # peer/keys.py: this machine's peer key and its paired peers
    "XDG_CACHE_HOME": "xdg_cache",  # platformdirs' user cache dir and everything else following XDG
    "XDG_DATA_HOME": "xdg_data",
    "XDG_CONFIG_HOME": "xdg_config",
    "XDG_STATE_HOME": "xdg_state",
    "HF_HOME": "hf_home",  # huggingface-hub's cache and token (offline: an empty cache)
    "MPLCONFIGDIR": "matplotlib",
}


@pytest.fixture(scope="session", autouse=True)
def _user_dirs_in_tmp(tmp_path_factory):
    """Set before any test runs, so in-process code and every subprocess a test starts inherit it."""
    root = tmp_path_factory.mktemp("user_dirs")
    with pytest.MonkeyPatch.context() as mp:
        for var, name in _USER_DIRS.items():
            (root / name).mkdir()
            mp.setenv(var, str(root / name))
        yield root


@pytest.fixture
def exact_math():
    """The CPU kernels' exact math (float32's accuracy, the reference of the kernel tests) for one test,
    then the default again (int16, or what DUET_CPU_MATH says): a test may switch math in between."""
    from cpu_kernels import spec

    spec.set_cpu_math("exact")
    yield
    spec.set_cpu_math()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """arch -> path of a tiny random-weight HF-style model directory."""
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, object] = {}

    def get(arch: str = "llama"):
        if arch not in cache:
            cache[arch] = make_tiny_model_dir(root / arch, arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def short_context_dir(tiny_dirs, tmp_path_factory):
    """The tiny llama with a 48-token context: replies and conversations that fill it."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("short") / "llama-48"
    shutil.copytree(tiny_dirs("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 48}))
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test shows the log and thread stacks of every `duet serve` it left running, so a
    hang seen only on CI says where the server was stuck."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when in ("call", "setup"):
        from tests.test_server_harness import ServerProcess

        for srv in list(ServerProcess.live):
            report.sections.append((f"duet serve on port {srv.port}", srv.diagnose()))

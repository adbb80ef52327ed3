from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.tiny_models import make_tiny_model_dir  # noqa: E402


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

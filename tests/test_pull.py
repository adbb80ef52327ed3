"""Pulling models from the Hugging Face hub (mlx_engine/loading/pull.py, hub_spec.py), against a
local hub (tests/hf_endpoint.py) on 127.0.0.1: never the real network."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mlx_engine.errors import ModelLoadError, ModelNotFoundError
from mlx_engine.loading import pull as pull_module
from mlx_engine.loading.hub_spec import HubSpec, choose_gguf, gguf_choices, parse_hub_spec, quant_label
from mlx_engine.loading.pull import PullProgress, pull, terminal_progress
from mlx_engine.loading.resolve import bundled_model_path, resolve_model
from tests.hf_endpoint import HubServer, point_hf_at, subprocess_env

REPO = "owner/smol-GGUF"
BIG = "smol.Q4_1.gguf"


@pytest.fixture(scope="module")
def bundled() -> Path:
    return bundled_model_path()


@pytest.fixture
def hub(bundled, monkeypatch, tmp_path):
    repos = {
        REPO: {
            BIG: bundled,
            "smol.Q8_0.gguf": b"GGUF-not-really" * 10,
            "mmproj-smol-F16.gguf": b"projector",
            "README.md": b"# smol\n",
        },
        "owner/ambiguous-GGUF": {
            "a-Q4_K_M.gguf": b"a" * 10,
            "b-Q4_K_M.gguf": b"b" * 20,
            "c-Q4_K_S.gguf": b"c",
        },
        "owner/split-GGUF": {"m-Q4_K_M-00001-of-00002.gguf": b"1", "m-Q4_K_M-00002-of-00002.gguf": b"2"},
        "owner/mlx-4bit": {
            "config.json": b'{"model_type": "llama", "quantization": {"bits": 4, "group_size": 64}}',
            "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
            "tokenizer.json": b"{}",
            "pytorch_model.bin": b"not for us",
        },
        "owner/gated-model": {"m.Q4_0.gguf": b"x"},
    }
    with HubServer(repos, gated=("owner/gated-model",)) as server:
        point_hf_at(monkeypatch, server, tmp_path / "hf")
        yield server


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- specs and the choice of file: no network -------------------------------------------------
@pytest.mark.parametrize(
    "spec, want",
    [
        ("owner/repo", HubSpec("owner/repo")),
        ("owner/repo:Q4_K_M", HubSpec("owner/repo", "Q4_K_M")),
        ("hf.co/owner/repo:q8_0", HubSpec("owner/repo", "q8_0")),
        ("huggingface.co/owner/repo", HubSpec("owner/repo")),
        ("https://huggingface.co/owner/repo/", HubSpec("owner/repo")),
        ("hf.co/owner/repo:latest", HubSpec("owner/repo")),
        ("./owner/repo", None),
        ("/abs/path", None),
        ("just-a-name", None),
        ("a/b/c", None),
    ],
)
def test_parse_hub_spec(spec, want):
    assert parse_hub_spec(spec) == want


def test_quant_is_a_whole_token_and_defaults_follow_llama_cpp():
    files = {"m-Q4_K_M.gguf": 5, "m-Q4_K.gguf": 4, "m-IQ4_XS.gguf": 3, "m-Q4_XS.gguf": 3, "m-BF16.gguf": 9}
    choices = gguf_choices(files)
    assert choose_gguf("o/r", choices, "q4_k").first == "m-Q4_K.gguf"
    assert choose_gguf("o/r", choices, "Q4_K_M").first == "m-Q4_K_M.gguf"
    assert choose_gguf("o/r", choices, "IQ4_XS").first == "m-IQ4_XS.gguf"
    assert choose_gguf("o/r", choices, "Q4_XS").first == "m-Q4_XS.gguf"
    assert choose_gguf("o/r", choices, "bf16").first == "m-BF16.gguf"
    assert choose_gguf("o/r", choices, None).first == "m-Q4_K_M.gguf"
    no_default = gguf_choices({"m-Q8_0.gguf": 8, "m-Q6_K.gguf": 6})
    assert choose_gguf("o/r", no_default, None).first == "m-Q6_K.gguf"  # the smallest
    assert quant_label("sub/Model-7B-IQ2_XXS-00001-of-00003.gguf") == "IQ2_XXS"
    with pytest.raises(ModelNotFoundError, match="available quants: .*Q4_K_M"):
        choose_gguf("o/r", choices, "Q5_K_M")


# --- pulls --------------------------------------------------------------------------------------
def test_pull_gguf_by_quant_with_progress(hub, bundled):
    events: list[PullProgress] = []
    bar = io.StringIO()
    draw = terminal_progress(bar)

    def both(p: PullProgress) -> None:
        events.append(p)
        draw(p)

    pulled = pull(f"hf.co/{REPO}:q4_1", progress=both)
    assert pulled.name == f"{REPO}:Q4_1" and pulled.kind == "gguf" and pulled.files == (BIG,)
    assert pulled.path.name == BIG and sha256(pulled.path) == hub.sha256(REPO, BIG)
    assert pulled.downloaded == bundled.stat().st_size
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    file_events = [e for e in events if e.file == BIG]
    assert file_events[-1].completed == file_events[-1].total == bundled.stat().st_size
    assert [e.completed for e in file_events] == sorted(e.completed for e in file_events)
    assert BIG in bar.getvalue() and "100%" in bar.getvalue() and "B/s" in bar.getvalue()
    # only the chosen file was fetched: not the other quant, not the projector
    fetched = {r.path for r in hub.requests if r.path.startswith(f"/{REPO}/resolve/")}
    assert fetched == {f"/{REPO}/resolve/{hub_commit()}/{BIG}"}
    # again: from the cache, nothing downloaded
    assert pull(f"{REPO}:Q4_1").downloaded == 0


def hub_commit() -> str:
    from tests.hf_endpoint import COMMIT

    return COMMIT


def test_killed_pull_resumes_with_a_range(hub, tmp_path, bundled):
    hub.stall_after[BIG] = 35 * 2**20  # > huggingface_hub's 10 MiB read chunks: some reach the disk
    env = subprocess_env(hub, tmp_path / "hf")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "pull", "-q", f"{REPO}:Q4_1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert hub.sent_event.setdefault(BIG, threading.Event()).wait(60)
        partial = pull_module._partial_path(REPO, hub.sha256(REPO, BIG))
        deadline = time.monotonic() + 60  # the client writes each 10 MiB chunk as it completes
        while not (partial.exists() and partial.stat().st_size >= 10 * 2**20):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    had = partial.stat().st_size
    hub.release()
    pulled = pull(f"{REPO}:Q4_1")
    ranges = hub.ranges(BIG)
    assert ranges[0] == "" and ranges[-1] == f"bytes={had}-", ranges
    assert pulled.downloaded == bundled.stat().st_size - had
    assert sha256(pulled.path) == hub.sha256(REPO, BIG) and not partial.exists()


def test_dropped_connection_resumes_in_the_same_pull(hub):
    hub.drop_after[BIG] = 25 * 2**20
    pulled = pull(f"{REPO}:Q4_1")
    ranges = hub.ranges(BIG)
    assert len(ranges) == 2 and ranges[1].startswith("bytes=") and not ranges[1].startswith("bytes=0-")
    assert sha256(pulled.path) == hub.sha256(REPO, BIG)


def test_unknown_repo_is_one_clear_line(hub):
    with pytest.raises(ModelNotFoundError, match="no such model repository.*owner/nothing-here"):
        pull("owner/nothing-here:Q4_0")


def test_gated_repo_says_to_accept_the_license_and_set_hf_token(hub):
    with pytest.raises(ModelNotFoundError, match="gated.*accept its license.*HF_TOKEN"):
        pull("owner/gated-model")


def test_stalled_hub_is_an_error_not_a_hang(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.3)
    hub.stall_api = True
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="stopped answering"):
        pull(f"{REPO}:Q4_1")
    assert time.monotonic() - t0 < 10


def test_unreachable_hub_is_a_clear_error(hub, monkeypatch):
    from huggingface_hub import constants

    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}"
    )
    with pytest.raises(ModelLoadError, match="cannot reach the Hugging Face hub"):
        pull(f"{REPO}:Q4_1")


def test_full_disk_is_refused_before_downloading(hub, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(pull_module.shutil, "disk_usage", lambda p: real(p)._replace(free=10 * 2**20))
    with pytest.raises(ModelLoadError, match="not enough disk space"):
        pull(f"{REPO}:Q4_1")
    assert not hub.ranges(BIG)


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="mounting a tmpfs needs root on Linux"
)
def test_full_tmpfs_is_refused_before_downloading(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(mnt / "hub"))
        with pytest.raises(ModelLoadError, match="not enough disk space"):
            pull(f"{REPO}:Q4_1")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_model_larger_than_memory_is_refused(hub, monkeypatch):
    monkeypatch.setattr(pull_module, "total_memory", lambda: 2**20)
    with pytest.raises(ModelLoadError, match="more than this machine's"):
        pull(f"{REPO}:Q4_1")


def test_a_quant_matching_two_files_lists_them(hub):
    with pytest.raises(ModelNotFoundError, match="ambiguous.*a-Q4_K_M.gguf, b-Q4_K_M.gguf"):
        pull("owner/ambiguous-GGUF:q4_k_m")
    with pytest.raises(ModelNotFoundError, match="several Q4_K_M files"):
        pull("owner/ambiguous-GGUF")
    with pytest.raises(ModelNotFoundError, match="available quants: Q4_K_M, Q4_K_S"):
        pull("owner/ambiguous-GGUF:Q6_K")


def test_split_gguf_is_refused_clearly(hub):
    with pytest.raises(ModelLoadError, match="split GGUF.*llama-gguf-split"):
        pull("owner/split-GGUF:Q4_K_M")


def test_mlx_repo_pulls_its_model_files_only(hub):
    pulled = pull("owner/mlx-4bit")
    assert pulled.kind == "hf_dir" and pulled.name == "owner/mlx-4bit"
    assert sorted(pulled.files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (pulled.path / "config.json").exists() and not (pulled.path / "pytorch_model.bin").exists()


def test_offline_uses_the_cache_and_names_what_is_missing(hub, monkeypatch):
    from huggingface_hub import constants

    pull(f"{REPO}:Q4_1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    n = len(hub.requests)
    src = resolve_model(f"hf.co/{REPO}:Q4_1")
    assert src.kind == "gguf" and src.name == f"{REPO}:Q4_1" and src.path.name == BIG
    assert len(hub.requests) == n  # no request went out
    with pytest.raises(ModelNotFoundError, match="owner/other.*not in the local Hugging Face cache"):
        pull("owner/other:Q4_0")
    with pytest.raises(ModelNotFoundError, match="no Q8_0 GGUF file"):
        pull(f"{REPO}:Q8_0")  # offline: only what the cache holds


def test_resolve_model_routes_hub_specs_through_pull(hub):
    src = resolve_model(f"{REPO}:Q4_1")
    assert (src.kind, src.name, src.path.name) == ("gguf", f"{REPO}:Q4_1", BIG)
    src = resolve_model("owner/mlx-4bit")
    assert src.kind == "hf_dir" and src.name == "owner/mlx-4bit"

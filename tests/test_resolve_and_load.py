"""Finding and loading models: every way a user names a model, and clear errors when it is wrong."""

from __future__ import annotations

import json

import pytest

from mlx_engine.loading.loader import ModelLoadError, load_model
from mlx_engine.loading.resolve import ModelNotFoundError, bundled_model_path, resolve_model


def test_default_is_the_bundled_gguf():
    src = resolve_model(None)
    assert src.kind == "gguf"
    assert src.path == bundled_model_path()
    assert src.path.stat().st_size > 50_000_000


def test_local_dir_and_gguf_file(tiny_dirs, tmp_path):
    src = resolve_model(str(tiny_dirs("llama")))
    assert src.kind == "hf_dir"
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert resolve_model(str(g)).kind == "gguf"
    assert resolve_model(str(tmp_path)).path == g  # a dir holding exactly one GGUF


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope" / "model.gguf"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="not a model directory"):
        resolve_model(str(empty))


def test_offline_hub_id_names_the_repo(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="someone/not-cached-model"):
        resolve_model("someone/not-cached-model")


def test_unknown_architecture_is_a_clear_error(tiny_dirs, tmp_path):
    import shutil

    d = tmp_path / "weird"
    shutil.copytree(tiny_dirs("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "definitely_not_a_model"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="definitely_not_a_model"):
        load_model(str(d))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma"])
def test_tiny_models_load_with_tokenizer_and_template(tiny_dirs, arch):
    m = load_model(str(tiny_dirs(arch)))
    assert m.num_layers == 2 and m.n_kv_heads == 2 and m.head_dim == 32
    text = m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = m.tokenizer.encode("Hello world 😀")
    assert m.tokenizer.decode(ids) == "Hello world 😀"
    assert m.tokenizer.eos_token_ids  # <|im_end|>

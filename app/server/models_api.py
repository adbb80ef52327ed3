"""The model routes of the OpenAI-style API: ``/v1/models`` (every servable model, with whether it is
loaded now and what it can do), ``/v1/models/{id}``, and loading and unloading by hand as llama.cpp's
router (``POST /models/load``, ``/models/unload``, body ``{"model": ...}``) and LM Studio
(``/api/v1/models/load|unload``) have them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from .errors import APIError
from .registry import Loaded, ModelRegistry, ServedModel, keep_alive_seconds


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    ttl: float | None = None  # LM Studio: seconds idle before it unloads
    keep_alive: float | str | None = None  # Ollama's spelling: "5m", seconds, -1 for ever


def model_card(registry: ModelRegistry, model: ServedModel, created: int) -> dict[str, Any]:
    """One model as /v1/models lists it, plus Duet's fields: ``loaded``, ``status`` (loaded,
    loading, unloaded or failed), what it can do, and what is known without loading it."""
    loaded = registry.get_loaded(model.name)
    status = "loaded" if loaded else "loading" if registry.is_loading(model.name) else "unloaded"
    if not loaded and model.name in registry.failures:
        status = "failed"
    card: dict[str, Any] = {
        "id": model.name,
        "object": "model",
        "created": int(loaded.loaded_at) if loaded else created,
        "owned_by": "duet",
        "capabilities": ["chat", "completions", "tools"],
        "loaded": loaded is not None,
        "status": status,
    }
    card.update({k: v for k, v in model.info.items() if k != "path" and v is not None})
    if loaded is not None:
        card.update(loaded_fields(registry, loaded))
    if status == "failed":
        card["error"] = registry.failures[model.name]
    return card


def loaded_fields(registry: ModelRegistry, loaded: Loaded) -> dict[str, Any]:
    """What a loaded model holds and how long it stays: memory, KV budget, context, idle time left."""
    s = loaded.state.engine.stats()
    left = registry.expires_in(loaded)
    return {
        "context_length": loaded.state.engine.context_length,
        "memory_bytes": loaded.footprint,
        "kv_budget_bytes": s.kv_blocks_total * s.kv_block_bytes,
        "running": s.running,
        "waiting": s.waiting,
        "pinned": loaded.model.pinned,
        "expires_in": None if left is None else round(left, 1),
        "expires_at": None if left is None else int(time.time() + left),
    }


def embedding_card(name: str, created: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "duet",
        "capabilities": ["embeddings"],
        "loaded": True,
        "status": "loaded",
    }


def _keep_alive(body: LoadRequest) -> float | None | object:
    if body.keep_alive is not None:
        return keep_alive_seconds(body.keep_alive)
    if body.ttl is not None:
        return keep_alive_seconds(body.ttl, "ttl")
    return ...


def install_model_routes(
    app: FastAPI, api: Callable[..., Any], registry: ModelRegistry, embedding_ids: tuple[str, ...]
) -> None:
    """Add the model routes (``api``: create_app's registrar, /v1 and bare paths)."""
    created = int(time.time())

    def card(model: ServedModel) -> dict[str, Any]:
        return model_card(registry, model, created)

    @api("GET", "/v1/models")  # before /v1/models/{model}, which "/v1/models/" would match
    async def list_models() -> dict:
        await registry.refresh()
        data = [card(m) for m in registry.available()]
        if embedding_ids:
            data.append(embedding_card(embedding_ids[0], created))
        return {"object": "list", "data": data}

    async def load(body: LoadRequest) -> JSONResponse:
        await registry.refresh()
        loaded = await registry.load(body.model, _keep_alive(body))
        return JSONResponse({"success": True, "status": "loaded", **card(loaded.model)})

    async def unload(body: LoadRequest) -> JSONResponse:
        model = registry.require(body.model)
        result = await registry.unload(model.name)
        return JSONResponse({"success": True, "status": result, "id": model.name})

    for path in ("/v1/models/load", "/api/v1/models/load"):
        api("POST", path)(load)
    for path in ("/v1/models/unload", "/api/v1/models/unload"):
        api("POST", path)(unload)

    @api("GET", "/v1/models/{model:path}", slash=False)  # the path parameter takes any slash
    async def get_model(model: str) -> JSONResponse:
        await registry.refresh()
        model = model.removesuffix("/")
        if model in embedding_ids and registry.lookup(model) is None:
            return JSONResponse(embedding_card(embedding_ids[0], created))
        found = registry.lookup(model)
        if found is None:
            raise APIError(
                404,
                f"The model `{model}` does not exist. Available models: "
                + ", ".join(f"`{m.name}`" for m in registry.available())
                + ".",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(card(found))

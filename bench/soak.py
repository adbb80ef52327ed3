"""Soak test: N concurrent clients for T seconds against a real `duet serve`, every API mixed (issue 30).

    .venv/bin/python bench/soak.py [--clients 32] [--seconds 120] [--seed 0] [--port 0]
                                   [--model PATH] [--cache-gb 0.25] [--json OUT]

The server is a `duet serve` subprocess on 127.0.0.1 (the bundled SmolLM2-135M Q4_1 GGUF unless
--model), started and stopped with the test suite's own harness (``tests/test_server_harness.py``).
Each client has its own HTTP connection and sends one request after another, chosen at random:

- OpenAI chat completions, streamed and not, with ``n`` > 1 (streamed and not) and with a
  ``response_format`` JSON schema; text completions, streamed and not;
- Anthropic Messages, streamed and not;
- Responses, streamed and not, and a two-turn chain (``previous_response_id``);
- a tenth of all requests malformed: bad JSON, wrong types or values, a body over the server's
  --max-body-mb (with a Content-Length and chunked), a prompt longer than the context (by a little,
  and a 2 MB one, under the body limit), a ``previous_response_id`` that does not exist;
- a quarter of the streamed requests dropped: the client closes the connection after 1-3 events.

``max_tokens`` is 8-32, so many requests complete. A separate process polls ``/health`` four times a
second (a fresh connection each time) and samples the server's VmRSS from /proc; /metrics gives the
KV blocks. The KV pool grows as blocks are needed, up to its budget (--cache-gb), and keeps freed
blocks for prefix reuse, so under load it reaches the budget and stays there: that growth is by
design, and bounded, so the first part of the run, until /metrics shows the pool at its budget
(at most 120 s), is the warm-up, and the T seconds are counted from there (the warm-up's requests
are checked as all others). The warm-up also starts with a primer: 4 clients at once each send
the largest requests (a 2 MB prompt, an over-limit chunked body, ...) first, so that the code
paths they take have run once before the window. Tokenizing a 2 MB prompt takes ~280 MB for a
moment; glibc kept that in its heaps, in holes a later long prompt did not always reuse (it lands
on another worker thread's arena, or the hole was split meanwhile), so the RSS climbed in steps of
~100-150 MB through the whole run, not to a high-water mark the primer reached (+17% in 10 minutes
at 64 clients, malloc's bytes in use and MLX's memory flat); the server now gives freed heap memory
back after such a prompt (mlx_engine/heap.py), and the RSS check below holds it to that. Afterwards,
every one of these must hold, or the run exits 1:

- every well-formed request that was not dropped got a complete reply: HTTP 200, a finish/stop
  reason for every choice, a stream that ended with its API's terminal event (``[DONE]``,
  ``message_stop``, ``response.completed``/``response.incomplete``), and a JSON-schema reply that
  stopped by itself parses as the schema's object;
- every malformed request got a 4xx; no 5xx at any time, from any route;
- ``/health`` answered 200 within 1 s every time, throughout the run and the drain after it;
- after the run the server drains: running and waiting requests back to 0 and the KV blocks
  held by requests (``duet_kv_blocks_used``; the prefix cache's blocks are not held) back to
  what they were before it;
- the server's RSS grew by less than 10% from the first third of the T seconds to the last (means);
- /metrics always answered; the server's log has no traceback; and (the command line only) it shuts
  down on SIGTERM (exit 0, or uvicorn's re-raised SIGTERM, not the harness's SIGKILL 30 s later).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import multiprocessing.synchronize
import os
import random
import signal
import ssl
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.test_server_harness import ServerProcess  # noqa: E402

OUT = ROOT / "bench" / "out"
HEALTH_LIMIT_S = 1.0
RSS_GROWTH_LIMIT = 0.10
MALFORMED_SHARE = 0.10
DROP_SHARE = 0.25
HEALTH_INTERVAL_S = 0.25
RSS_INTERVAL_S = 0.5
METRICS_INTERVAL_S = 1.0
DRAIN_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 300.0  # a well-formed request still unanswered after this is a hang
OVERSIZE_MB = 9  # above `duet serve`'s default --max-body-mb (8)
CONTEXT_WORDS = 9000  # a prompt of this many words is longer than SmolLM2's 8192-token context
HUGE_PROMPT_MB = 2  # a prompt far over any context, in a body well under the limit

WORDS = (
    "river stone light garden north window paper music seven quiet engine orange market forest silver "
    "winter letter morning bridge number story yellow doctor island harbor candle meadow thunder copper"
).split()
SYSTEMS = (
    "You are a concise assistant. Answer in one short sentence.",
    "You are a helpful guide for travellers. Keep every answer brief and friendly.",
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}

# well-formed request kinds and their weights
KINDS: dict[str, int] = {
    "chat": 10,
    "chat_stream": 12,
    "chat_n": 6,
    "chat_n_stream": 6,
    "chat_json": 8,
    "completions": 6,
    "completions_stream": 6,
    "messages": 8,
    "messages_stream": 10,
    "responses": 8,
    "responses_stream": 10,
    "responses_chain": 8,  # two records: responses_chain_first, then responses_chain_next (maybe streamed)
}
MALFORMED = (
    "bad_json",
    "wrong_type",
    "bad_value",
    "oversize_body",
    "oversize_chunked",
    "oversize_prompt",
    "huge_prompt",
    "unknown_previous",
)
# the warm-up's primer (see ``primer``): the largest bodies, from this many clients at once
PRIMER = ("huge_prompt", "oversize_chunked", "oversize_prompt", "oversize_body")
PRIMER_CLIENTS = 4
ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
JSON_HEADERS = {"content-type": "application/json"}


@dataclasses.dataclass
class Record:
    kind: str  # a KINDS key, responses_chain_first/_next, or "malformed:<variant>:<api>"
    stream: bool
    t_start: float  # time.monotonic()
    status: int | None = None
    outcome: str = "fail"  # complete | dropped | rejected | fail
    detail: str = ""
    latency_s: float | None = None
    ttft_s: float | None = None

    @property
    def malformed(self) -> bool:
        return self.kind.startswith("malformed:")


# --- request bodies -------------------------------------------------------------------------------


class Bodies:
    """Random request bodies for one client."""

    def __init__(self, rng: random.Random, model: str):
        self.rng, self.model = rng, model

    def prompt(self) -> str:
        words = " ".join(self.rng.choices(WORDS, k=self.rng.randint(6, 24)))
        return self.rng.choice(
            (
                f"Write one sentence about {words}.",
                f"What do these words have in common: {words}?",
                f"Continue the list: {words}",
            )
        )

    def max_tokens(self) -> int:
        return self.rng.randint(8, 32)

    def temperature(self) -> float:
        return self.rng.choice((0.0, 0.0, 0.7, 1.0))

    def messages(self) -> list[dict]:
        msgs = [{"role": "user", "content": self.prompt()}]
        if self.rng.random() < 0.5:  # a shared system prompt: prefix-cache hits
            msgs.insert(0, {"role": "system", "content": self.rng.choice(SYSTEMS)})
        return msgs

    def chat(self, stream: bool, n: int = 1, schema: bool = False) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_tokens": self.max_tokens(),
            "temperature": self.temperature() if n == 1 else 0.8,
            "stream": stream,
        }
        if n > 1:
            body["n"] = n
        if schema:
            body["messages"][-1]["content"] += " Reply in JSON with an answer and ok."
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True},
            }
            body["max_tokens"] = 32
        return body

    def completions(self, stream: bool) -> dict:
        return {
            "model": self.model,
            "prompt": self.prompt(),
            "max_tokens": self.max_tokens(),
            "temperature": self.temperature(),
            "stream": stream,
        }

    def anthropic(self, stream: bool) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens(),
            "messages": [{"role": "user", "content": self.prompt()}],
            "temperature": self.rng.choice((0.0, 0.5, 1.0)),
            "stream": stream,
        }
        if self.rng.random() < 0.5:
            body["system"] = self.rng.choice(SYSTEMS)
        return body

    def responses(self, stream: bool, previous: str | None = None) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "input": self.prompt(),
            "max_output_tokens": self.max_tokens(),
            "temperature": self.temperature(),
            "stream": stream,
        }
        if previous is not None:
            body["previous_response_id"] = previous
        elif self.rng.random() < 0.5:
            body["instructions"] = self.rng.choice(SYSTEMS)
        return body

    def valid(self, api: str, stream: bool = False) -> dict:
        return {
            "chat": self.chat,
            "completions": self.completions,
            "messages": self.anthropic,
            "responses": self.responses,
        }[api](stream)


def _oversize_chunks() -> Callable[[], AsyncIterator[bytes]]:
    """A factory of chunked bodies (no Content-Length) over the body limit."""
    chunk = b"x" * 2**20

    async def gen() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "messages": "'
        for _ in range(OVERSIZE_MB):
            yield chunk
        yield b'"}'

    return gen


OVERSIZE = b'{"model": "m", "prompt": "' + b"x" * (OVERSIZE_MB * 2**20) + b'"}'
CHUNKED = _oversize_chunks()
HUGE_PROMPT = " ".join(WORDS * (HUGE_PROMPT_MB * 2**20 // len(" ".join(WORDS))))


def malformed_request(b: Bodies, api: str, variant: str) -> tuple[bytes | AsyncIterator[bytes], bool]:
    """(body, whether the body asks to stream) for a malformed request to ``api``."""
    rng = b.rng
    stream = rng.random() < 0.5
    body = b.valid(api, stream)
    if variant == "bad_json":
        text = json.dumps(body)
        return text[: rng.randint(1, len(text) - 1)].encode(), stream
    if variant == "oversize_body":
        return OVERSIZE, False
    if variant == "oversize_chunked":
        return CHUNKED(), False
    if variant == "wrong_type":
        field, value = {
            "chat": ("messages", "hello"),
            "completions": ("prompt", {"text": 1}),
            "messages": ("max_tokens", "ten"),
            "responses": ("input", 42),
        }[api]
        body[field] = value
    elif variant == "bad_value":
        field, value = {
            "chat": ("n", -1),
            "completions": ("max_tokens", -5),
            "messages": ("temperature", 7),
            "responses": ("temperature", -1),
        }[api]
        body[field] = value
    elif variant in ("oversize_prompt", "huge_prompt"):
        long = " ".join(rng.choices(WORDS, k=CONTEXT_WORDS)) if variant == "oversize_prompt" else HUGE_PROMPT
        if api == "completions":
            body["prompt"] = long
        elif api == "responses":
            body["input"] = long
        else:
            body["messages"] = [{"role": "user", "content": long}]
    elif variant == "unknown_previous":
        body = b.responses(stream, previous=f"resp_{rng.getrandbits(96):024x}")
    return json.dumps(body).encode(), stream


# --- checking replies -----------------------------------------------------------------------------


def check_json_reply(content: str | None) -> str | None:
    try:
        value = json.loads(content or "")
    except json.JSONDecodeError:
        return f"a JSON-schema reply that stopped is not JSON: {content!r}"
    if not (
        isinstance(value, dict)
        and set(value) == {"answer", "ok"}
        and isinstance(value["answer"], str)
        and isinstance(value["ok"], bool)
    ):
        return f"a JSON-schema reply does not follow the schema: {content!r}"
    return None


def check_reply(api: str, reply: Any, n: int = 1, schema: bool = False) -> str | None:
    """Why a non-streamed reply is not complete (None: it is)."""
    if not isinstance(reply, dict):
        return "not a JSON object"
    if api in ("chat", "completions"):
        choices = reply.get("choices") or []
        if sorted(c.get("index") for c in choices) != list(range(n)):
            return f"{len(choices)} choices for n={n}"
        if not all(c.get("finish_reason") for c in choices):
            return "a choice without a finish_reason"
        if schema:
            for c in choices:
                if c["finish_reason"] == "stop" and (why := check_json_reply(c["message"]["content"])):
                    return why
        return None
    if api == "messages":
        if reply.get("type") != "message" or not reply.get("stop_reason"):
            return f"type {reply.get('type')!r}, stop_reason {reply.get('stop_reason')!r}"
        return None
    if reply.get("object") != "response" or reply.get("status") not in ("completed", "incomplete"):
        return f"object {reply.get('object')!r}, status {reply.get('status')!r}"
    return None


def has_text(api: str, event: dict) -> bool:
    """Whether a stream's event carries reply text (the first one's arrival is the TTFT)."""
    if api == "chat":
        return any((c.get("delta") or {}).get("content") for c in event.get("choices", []))
    if api == "completions":
        return any(c.get("text") for c in event.get("choices", []))
    if api == "messages":
        return event.get("type") == "content_block_delta"
    return event.get("type") == "response.output_text.delta"


def check_stream(api: str, events: list[dict], done: bool, n: int = 1) -> str | None:
    """Why a whole stream is not a complete reply (None: it is)."""
    if not events:
        return "no events"
    if api in ("chat", "completions"):
        if any("error" in e for e in events):
            return f"an error event: {next(e for e in events if 'error' in e)}"
        if not done:
            return "no [DONE]"
        finished = {c.get("index") for e in events for c in e.get("choices", []) if c.get("finish_reason")}
        if finished != set(range(n)):
            return f"finish_reason for choices {sorted(finished)} of n={n}"
        return None
    kinds = [e.get("type") for e in events]
    if api == "messages":
        if kinds[0] != "message_start" or kinds[-1] != "message_stop" or "error" in kinds:
            return f"events {kinds[0]} .. {kinds[-1]}, error {'error' in kinds}"
        if not any(e.get("type") == "message_delta" and e["delta"].get("stop_reason") for e in events):
            return "no message_delta with a stop_reason"
        return None
    if kinds[0] != "response.created" or kinds[-1] not in ("response.completed", "response.incomplete"):
        return f"events {kinds[0]} .. {kinds[-1]}"
    if [e.get("sequence_number") for e in events] != list(range(len(events))):
        return "sequence numbers not 0, 1, 2, ..."
    return None


# --- one request ----------------------------------------------------------------------------------


def settle(rec: Record, why: str | None) -> bool:
    """Record a whole reply as complete, or why it is not (``why``); whether it is."""
    if why:
        rec.detail = why
        return False
    rec.outcome, rec.latency_s = "complete", time.monotonic() - rec.t_start
    return True


async def send_json(
    http: httpx.AsyncClient, rec: Record, api: str, body: dict, n: int = 1, schema: bool = False
) -> dict | None:
    """A non-streamed well-formed request; the reply when complete."""
    try:
        r = await http.post(ROUTES[api], content=json.dumps(body).encode(), headers=JSON_HEADERS)
    except httpx.HTTPError as e:
        rec.detail = f"{type(e).__name__}: {e}"
        return None
    rec.status = r.status_code
    if r.status_code != 200:
        rec.detail = f"HTTP {r.status_code}: {r.text[:200]}"
        return None
    try:
        reply = r.json()
    except json.JSONDecodeError:
        rec.detail = f"not JSON: {r.text[:200]}"
        return None
    return reply if settle(rec, check_reply(api, reply, n, schema)) else None


async def send_stream(
    http: httpx.AsyncClient, rec: Record, api: str, body: dict, drop_after: int | None, n: int = 1
) -> dict | None:
    """A streamed well-formed request, dropped after ``drop_after`` events when given; the final
    Responses object when it completed."""
    events: list[dict] = []
    done = False
    try:
        async with http.stream(
            "POST", ROUTES[api], content=json.dumps(body).encode(), headers=JSON_HEADERS
        ) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                rec.detail = f"HTTP {r.status_code}: {r.text[:200]}"
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                events.append(json.loads(line[6:]))
                if rec.ttft_s is None and has_text(api, events[-1]):
                    rec.ttft_s = time.monotonic() - rec.t_start
                if drop_after is not None and len(events) >= drop_after:
                    rec.outcome = "dropped"  # leaving the block closes the connection mid-stream
                    return None
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.detail = f"{type(e).__name__}: {e} (after {len(events)} events)"
        return None
    if not settle(rec, check_stream(api, events, done, n)):
        return None
    return events[-1].get("response") if api == "responses" else None


async def send_malformed(http: httpx.AsyncClient, rec: Record, api: str, content: Any) -> None:
    try:
        r = await http.post(ROUTES[api], content=content, headers=JSON_HEADERS)
    except httpx.HTTPError as e:
        rec.detail = f"{type(e).__name__}: {e}"
        return
    rec.status, rec.latency_s = r.status_code, time.monotonic() - rec.t_start
    if 400 <= r.status_code < 500:
        rec.outcome = "rejected"
    else:
        rec.detail = f"a malformed request got HTTP {r.status_code}: {r.text[:200]}"


async def one_turn(http: httpx.AsyncClient, b: Bodies, records: list[Record]) -> None:
    rng = b.rng

    def record(kind: str, stream: bool) -> Record:
        rec = Record(kind, stream, time.monotonic())
        records.append(rec)
        return rec

    def drop() -> int | None:
        return rng.randint(1, 3) if rng.random() < DROP_SHARE else None

    if rng.random() < MALFORMED_SHARE:
        variant = rng.choice(MALFORMED)
        api = "responses" if variant == "unknown_previous" else rng.choice(list(ROUTES))
        content, stream = malformed_request(b, api, variant)
        await send_malformed(http, record(f"malformed:{variant}:{api}", stream), api, content)
        return
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    stream = kind.endswith("_stream")
    if kind in ("chat", "chat_stream"):
        body = b.chat(stream)
        rec = record(kind, stream)
        await (send_stream(http, rec, "chat", body, drop()) if stream else send_json(http, rec, "chat", body))
    elif kind in ("chat_n", "chat_n_stream"):
        n = rng.randint(2, 3)
        body = b.chat(stream, n=n)
        rec = record(kind, stream)
        if stream:
            await send_stream(http, rec, "chat", body, drop(), n)
        else:
            await send_json(http, rec, "chat", body, n)
    elif kind == "chat_json":
        await send_json(http, record(kind, False), "chat", b.chat(False, schema=True), schema=True)
    elif kind == "responses_chain":
        first = await send_json(http, record("responses_chain_first", False), "responses", b.responses(False))
        if first is not None:
            stream = rng.random() < 0.5
            body = b.responses(stream, previous=first["id"])
            rec = record("responses_chain_next", stream)
            if stream:
                await send_stream(http, rec, "responses", body, drop())
            else:
                await send_json(http, rec, "responses", body)
    else:
        api = kind.removesuffix("_stream")
        body = b.valid(api, stream)
        rec = record(kind, stream)
        await (send_stream(http, rec, api, body, drop()) if stream else send_json(http, rec, api, body))


@dataclasses.dataclass
class Load:
    records: list[Record]
    t_load: float  # the clients started
    t0: float  # the measured window started: the KV pool had grown to its budget (or the warm-up cap)
    t1: float  # the window ended: the clients send nothing more
    t_end: float  # the last request was answered
    pool_full: bool  # the KV pool reached its budget before the window started
    loop_lag_max_s: float  # the clients' own event loop at its slowest (their latencies include it)
    loop_lag_at_s: float  # when that was, from t_load


async def pool_full(http: httpx.AsyncClient) -> bool:
    m = parse_metrics((await http.get("/metrics")).text)
    return m["duet_kv_cache_bytes"] >= m["duet_kv_cache_budget_bytes"]


async def primer(http: httpx.AsyncClient, b: Bodies, records: list[Record]) -> None:
    """The largest requests, one of each (to a random API), from PRIMER_CLIENTS clients at once at
    the start: their transient peak (~280 MB for a 2 MB prompt) comes before the measured window;
    the server gives it back afterwards (mlx_engine/heap.py), which the RSS check holds it to."""
    for variant in PRIMER:
        api = b.rng.choice(list(ROUTES))
        content, stream = malformed_request(b, api, variant)
        rec = Record(f"malformed:{variant}:{api}", stream, time.monotonic())
        records.append(rec)
        await send_malformed(http, rec, api, content)


async def run_clients(
    base: str, model: str, clients: int, seconds: float, seed: int, warmup_cap: float
) -> Load:
    """``clients`` clients, each sending one request after another until ``seconds`` after the
    warm-up: the KV pool has grown to its budget (or ``warmup_cap`` seconds have passed) and the
    primer is done; each finishes the request it is in (it is not cut)."""
    records: list[Record] = []
    stop = asyncio.Event()
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30)
    # made before the clock starts, with one TLS context (never used: plain HTTP) for them all:
    # httpx builds one per client otherwise, ~25 ms each, blocking the loop (seconds at 64 clients)
    tls = ssl.create_default_context()
    https = [httpx.AsyncClient(base_url=base, timeout=timeout, verify=tls) for _ in range(clients + 1)]

    primed = [min(PRIMER_CLIENTS, clients)]  # clients still sending their primer
    primer_done = asyncio.Event()

    async def client(i: int) -> None:
        b = Bodies(random.Random(f"{seed}-{i}"), model)
        async with https[i] as http:
            if i < PRIMER_CLIENTS:
                await primer(http, b, records)
                primed[0] -= 1
                if not primed[0]:
                    primer_done.set()
            while not stop.is_set():
                await one_turn(http, b, records)

    async def window() -> tuple[float, float, bool]:
        """The warm-up: the pool's growth to its budget and the primer's peak, by design, not leaks."""
        full = False
        async with https[clients] as http:
            while time.monotonic() < t_load + warmup_cap:
                if full := await pool_full(http):
                    break
                await asyncio.sleep(0.5)
        await primer_done.wait()
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        stop.set()
        return t0, time.monotonic(), full

    lag = [0.0, 0.0]  # the most, and when (from the start)

    async def lag_monitor() -> None:
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.1)
            if (late := time.monotonic() - t - 0.1) > lag[0]:
                lag[:] = [late, t - t_load]

    t_load = time.monotonic()
    monitor = asyncio.create_task(lag_monitor())
    timing = asyncio.create_task(window())
    await asyncio.gather(timing, *(client(i) for i in range(clients)))
    await monitor
    t0, t1, full = timing.result()
    return Load(records, t_load, t0, t1, time.monotonic(), full, lag[0], lag[1])


# --- the poller (its own process, so the clients' event loop cannot delay it) ---------------------


def parse_metrics(text: str) -> dict[str, float]:
    """The samples by name; a labelled one as ``name{label=value,...}``."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def read_rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def poll(base: str, pid: int, stop: multiprocessing.synchronize.Event, out: Any) -> None:
    """Until ``stop``: GET /health (fresh connection each time), the server's VmRSS and /metrics;
    puts {"health": [(t, latency, status, error)], "rss": [(t, kB)], "metrics": [(t, {...})]}."""
    health: list[tuple[float, float, int | None, str]] = []
    rss: list[tuple[float, int]] = []
    metrics: list[tuple[float, dict[str, float]]] = []
    metrics_failed: list[str] = []
    next_rss = next_metrics = 0.0
    while not stop.is_set():
        t = time.monotonic()
        try:
            r = httpx.get(base + "/health", timeout=10)
            health.append((t, time.monotonic() - t, r.status_code, ""))
        except httpx.HTTPError as e:
            health.append((t, time.monotonic() - t, None, f"{type(e).__name__}: {e}"))
        if t >= next_rss:
            kb = read_rss_kb(pid)
            if kb is not None:
                rss.append((t, kb))
            next_rss = t + RSS_INTERVAL_S
        if t >= next_metrics:
            next_metrics = t + METRICS_INTERVAL_S
            try:
                r = httpx.get(base + "/metrics", timeout=10)
            except httpx.HTTPError as e:
                metrics_failed.append(f"{type(e).__name__}: {e}")
            else:
                if r.status_code != 200:
                    metrics_failed.append(f"HTTP {r.status_code}: {r.text[:200]}")
                else:
                    m = parse_metrics(r.text)
                    kept = {
                        k: v for k, v in m.items() if k.startswith(("duet_kv", "duet_requests_", "duet_mlx"))
                    }
                    metrics.append((t, kept))
        stop.wait(max(0.0, HEALTH_INTERVAL_S - (time.monotonic() - t)))
    out.put({"health": health, "rss": rss, "metrics": metrics, "metrics_failed": metrics_failed})


# --- the run --------------------------------------------------------------------------------------


def pct(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else None


def get_metrics(srv: ServerProcess) -> dict[str, float]:
    return parse_metrics(httpx.get(srv.base + "/metrics", headers=srv.headers, timeout=30).text)


def drain(srv: ServerProcess, baseline_used: float, timeout: float) -> tuple[bool, float, dict[str, float]]:
    """Wait for running and waiting to reach 0 and the held KV blocks their baseline; (drained,
    seconds it took, the last metrics)."""
    t0 = time.monotonic()
    while True:
        m = get_metrics(srv)
        if (
            m["duet_requests_running"] == 0
            and m["duet_requests_waiting"] == 0
            and m["duet_kv_blocks_used"] <= baseline_used
        ):
            return True, time.monotonic() - t0, m
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0, m
        time.sleep(0.2)


def log_tracebacks(srv: ServerProcess) -> list[str]:
    text = srv.log_path.read_text(errors="replace")
    lines = text.splitlines()
    return ["\n".join(lines[i : i + 30]) for i, line in enumerate(lines) if line.startswith("Traceback")]


def soak(
    srv: ServerProcess, clients: int, seconds: float, seed: int = 0, warmup_cap: float = 120.0
) -> dict[str, Any]:
    """Run the load against a started server and measure; the report (``violations`` empty: passed)."""
    model = httpx.get(srv.base + "/v1/models", headers=srv.headers, timeout=30).json()["data"][0]["id"]
    before = get_metrics(srv)
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    poller = ctx.Process(target=poll, args=(srv.base, srv.proc.pid, stop, out), daemon=True)
    poller.start()
    try:
        load = asyncio.run(run_clients(srv.base, model, clients, seconds, seed, warmup_cap))
        drained, drain_s, after = drain(srv, before["duet_kv_blocks_used"], DRAIN_TIMEOUT_S)
    finally:
        stop.set()
        polled = out.get(timeout=60)
        poller.join(30)
    return build_report(
        load, polled, before, after, drained, drain_s, clients, seconds, seed, log_tracebacks(srv)
    )


def build_report(
    load: Load,
    polled: dict[str, Any],
    before: dict[str, float],
    after: dict[str, float],
    drained: bool,
    drain_s: float,
    clients: int,
    seconds: float,
    seed: int,
    tracebacks: list[str],
) -> dict[str, Any]:
    records, t0, t1 = load.records, load.t0, load.t1
    violations: list[str] = []
    by_kind: dict[str, Counter[str]] = {}
    lat: dict[str, list[float]] = {}
    for r in records:
        group = r.kind.split(":")[0] + (":" + r.kind.split(":")[1] if r.malformed else "")
        by_kind.setdefault(group, Counter())[r.outcome] += 1
        if r.latency_s is not None and r.outcome in ("complete", "rejected"):
            lat.setdefault(group, []).append(r.latency_s)
    fails = [r for r in records if r.outcome == "fail"]
    server_errors = [r for r in records if r.status is not None and r.status >= 500]
    if fails:
        shown = "; ".join(f"{r.kind}{' (stream)' if r.stream else ''}: {r.detail}" for r in fails[:5])
        violations.append(f"{len(fails)} requests without a complete reply or a 4xx: {shown}")
    if server_errors:
        violations.append(f"{len(server_errors)} requests answered 5xx: {server_errors[0].detail}")

    health = polled["health"]
    health_lat = [h[1] for h in health]
    slow = [h for h in health if h[2] != 200 or h[1] > HEALTH_LIMIT_S]
    if not health:
        violations.append("/health was never polled")
    if slow:
        worst = max(slow, key=lambda h: h[1])
        violations.append(
            f"/health failed or took over {HEALTH_LIMIT_S:g} s {len(slow)} times of {len(health)} "
            f"(worst {worst[1]:.2f} s at +{worst[0] - load.t_load:.0f} s, status {worst[2]} {worst[3]})"
        )

    if polled["metrics_failed"]:
        violations.append(
            f"/metrics failed {len(polled['metrics_failed'])} times: {polled['metrics_failed'][0]}"
        )

    third = (t1 - t0) / 3
    rss = polled["rss"]
    first = [kb for t, kb in rss if t0 <= t <= t0 + third]
    last = [kb for t, kb in rss if t1 - third <= t <= t1]
    rss_first = statistics.fmean(first) / 1024 if first else None
    rss_last = statistics.fmean(last) / 1024 if last else None
    growth = rss_last / rss_first - 1 if rss_first and rss_last else None

    def mlx_mb(name: str, lo: float, hi: float) -> float | None:
        xs = [m[name] for t, m in polled["metrics"] if lo <= t <= hi and name in m]
        return statistics.fmean(xs) / 2**20 if xs else None

    mlx = {  # MLX's share of the RSS: arrays held, and freed buffers kept for reuse
        f"{what}_{part}": mlx_mb(f"duet_mlx_{what}_bytes", lo, hi)
        for what in ("active", "cache")
        for part, (lo, hi) in (("first_third", (t0, t0 + third)), ("last_third", (t1 - third, t1)))
    }
    mlx["peak_after"] = after.get("duet_mlx_peak_bytes", 0.0) / 2**20
    if growth is None:
        violations.append("too few RSS samples")
    elif growth >= RSS_GROWTH_LIMIT:
        violations.append(
            f"RSS grew {growth:.1%} from the first third to the last (limit {RSS_GROWTH_LIMIT:.0%})"
        )

    if not drained:
        violations.append(
            f"not drained {drain_s:.0f} s after the run: running {after['duet_requests_running']:g}, "
            f"waiting {after['duet_requests_waiting']:g}, KV blocks held {after['duet_kv_blocks_used']:g} "
            f"(before: {before['duet_kv_blocks_used']:g})"
        )
    if tracebacks:
        violations.append(f"the server logged {len(tracebacks)} tracebacks; the first:\n{tracebacks[0]}")

    streams = [r for r in records if r.stream and not r.malformed]
    peak = {
        k: max((m.get(k, 0.0) for _, m in polled["metrics"]), default=0.0)
        for k in ("duet_requests_running", "duet_requests_waiting", "duet_kv_blocks_used")
    }
    ms = [r.latency_s for r in records if r.outcome == "complete" and r.latency_s is not None]
    ttft = [r.ttft_s for r in records if r.outcome == "complete" and r.ttft_s is not None]
    finished = {
        k.removeprefix("duet_requests_total"): after[k] - before.get(k, 0.0)
        for k in sorted(after)
        if k.startswith("duet_requests_total{") and after[k] - before.get(k, 0.0)
    }
    gen_tokens = after.get("duet_generation_tokens_total", 0) - before.get("duet_generation_tokens_total", 0)
    return {
        "clients": clients,
        "seconds": seconds,
        "seed": seed,
        "load_s": load.t_end - load.t_load,
        "warmup_s": t0 - load.t_load,
        "measured_s": t1 - t0,
        "pool_full": load.pool_full,
        "client_loop_lag_max_s": load.loop_lag_max_s,
        "client_loop_lag_at_s": load.loop_lag_at_s,
        "requests": len(records),
        "requests_per_s": len(records) / (load.t_end - load.t_load),
        "generated_tokens": gen_tokens,
        "tokens_per_s": gen_tokens / (load.t_end - load.t_load),
        "outcomes": dict(Counter(r.outcome for r in records)),
        "malformed_share": sum(r.malformed for r in records) / max(1, len(records)),
        "dropped_share_of_streams": sum(r.outcome == "dropped" for r in streams) / max(1, len(streams)),
        "by_kind": {
            k: {
                **dict(c),
                "p50_s": pct(lat.get(k, []), 50),
                "p95_s": pct(lat.get(k, []), 95),
            }
            for k, c in sorted(by_kind.items())
        },
        "latency_p50_s": pct(ms, 50),
        "latency_p95_s": pct(ms, 95),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p95_s": pct(ttft, 95),
        "status_counts": dict(Counter(str(r.status) for r in records)),
        "health": {
            "polls": len(health),
            "max_s": max(health_lat, default=None),
            "p99_s": pct(health_lat, 99),
            "failed_or_slow": len(slow),
        },
        "rss_mb": {
            "first_third": rss_first,
            "last_third": rss_last,
            "growth": growth,
            "samples": len(rss),
            # (seconds from the start, MB) every 5 s: where it grew, warm-up included
            "series": [
                (round(t - load.t_load, 1), round(kb / 1024, 1)) for t, kb in rss[:: int(5 / RSS_INTERVAL_S)]
            ],
        },
        "mlx_mb": mlx,
        "kv_blocks": {
            "total": after.get("duet_kv_blocks_total"),
            "used_before": before.get("duet_kv_blocks_used"),
            "used_after": after.get("duet_kv_blocks_used"),
            "cached_before": before.get("duet_kv_blocks_cached"),
            "cached_after": after.get("duet_kv_blocks_cached"),
            "peak_used": peak["duet_kv_blocks_used"],
        },
        "peak_running": peak["duet_requests_running"],
        "peak_waiting": peak["duet_requests_waiting"],
        "running_after": after.get("duet_requests_running"),
        "waiting_after": after.get("duet_requests_waiting"),
        "server_finished": finished,
        "preemptions": after.get("duet_preemptions_total", 0) - before.get("duet_preemptions_total", 0),
        "drained": drained,
        "drain_s": drain_s,
        "server_tracebacks": len(tracebacks),
        "failures": [dataclasses.asdict(r) for r in fails[:50]],
        "violations": violations,
    }


def _s(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else (f"{x * 1000:.0f} ms" if unit == "ms" else f"{x:.2f} s")


def _pair(d: dict[str, float | None], what: str) -> str:
    a, b = d[f"{what}_first_third"], d[f"{what}_last_third"]
    return "-" if a is None or b is None else f"{a:.0f} -> {b:.0f}"


def format_report(rep: dict[str, Any]) -> str:
    out = [
        f"soak: {rep['clients']} clients, {rep['load_s']:.0f} s (warm-up {rep['warmup_s']:.0f} s until the KV "
        f"pool {'reached its budget' if rep['pool_full'] else 'had grown for the warm-up cap'}, then "
        f"{rep['measured_s']:.0f} s measured), seed {rep['seed']}:",
        f"  {rep['requests']} requests "
        f"({rep['requests_per_s']:.1f}/s), {rep['generated_tokens']:.0f} tokens generated "
        f"({rep['tokens_per_s']:.1f}/s)",
        f"  malformed {rep['malformed_share']:.1%} of requests, dropped {rep['dropped_share_of_streams']:.1%} "
        f"of streams; HTTP statuses {rep['status_counts']}",
        "",
        f"  {'kind':<34}{'complete':>9}{'dropped':>9}{'rejected':>9}{'fail':>6}{'p50':>10}{'p95':>10}",
    ]
    for kind, c in rep["by_kind"].items():
        out.append(
            f"  {kind:<34}{c.get('complete', 0):>9}{c.get('dropped', 0):>9}{c.get('rejected', 0):>9}"
            f"{c.get('fail', 0):>6}{_s(c['p50_s']):>10}{_s(c['p95_s']):>10}"
        )
    h, rss, kv = rep["health"], rep["rss_mb"], rep["kv_blocks"]
    growth = (
        "-"
        if rss["growth"] is None
        else f"{rss['growth']:+.1%}, {rss['last_third'] - rss['first_third']:+.0f} MB"
    )
    first = "-" if rss["first_third"] is None else f"{rss['first_third']:.0f}"
    last = "-" if rss["last_third"] is None else f"{rss['last_third']:.0f}"
    out += [
        "",
        f"  complete replies: latency p50 {_s(rep['latency_p50_s'])}, p95 {_s(rep['latency_p95_s'])}; "
        f"streams' first text (TTFT) p50 {_s(rep['ttft_p50_s'])}, p95 {_s(rep['ttft_p95_s'])} "
        f"(the clients' own event loop lagged up to {_s(rep['client_loop_lag_max_s'], 'ms')}, "
        f"at +{rep['client_loop_lag_at_s']:.0f} s)",
        f"  /health: {h['polls']} polls, max {_s(h['max_s'], 'ms')}, p99 {_s(h['p99_s'], 'ms')}, "
        f"{h['failed_or_slow']} failed or over {HEALTH_LIMIT_S:g} s",
        f"  RSS (MB): first third {first}, last third {last} ({growth}; {rss['samples']} samples)",
        "  MLX (MB): arrays held "
        + _pair(rep["mlx_mb"], "active")
        + ", freed buffers kept "
        + _pair(rep["mlx_mb"], "cache")
        + f", peak {rep['mlx_mb']['peak_after']:.0f}",
        f"  KV blocks held by requests: before {kv['used_before']:g}, peak {kv['peak_used']:g}, after "
        f"{kv['used_after']:g} of {kv['total']:g}; cached for prefix reuse {kv['cached_before']:g} -> "
        f"{kv['cached_after']:g}",
        f"  peak running {rep['peak_running']:g}, waiting {rep['peak_waiting']:g}; preemptions "
        f"{rep['preemptions']:g}; after the run running {rep['running_after']:g}, waiting "
        f"{rep['waiting_after']:g} (drained in {rep['drain_s']:.1f} s: {rep['drained']})",
        "  server's duet_requests_total: "
        + ", ".join(f"{k.strip('{}')}: {v:g}" for k, v in rep["server_finished"].items()),
        f"  server log tracebacks: {rep['server_tracebacks']}",
        "",
    ]
    if rep["violations"]:
        out += ["FAILED:", *(f"  - {v}" for v in rep["violations"])]
    else:
        out.append("PASSED: every check held")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="the server's port (default 0: a free one)")
    p.add_argument(
        "--model", default=None, help="what `duet serve --model` takes (default: the bundled model)"
    )
    p.add_argument("--cache-gb", type=float, default=0.25, help="the server's KV cache budget (default 0.25)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report here as JSON")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / f"soak_server_{args.clients}c.log"
    srv = ServerProcess(
        args.model, log, "--cache-gb", str(args.cache_gb), port=args.port or None, timeout=300
    )
    try:
        rep = soak(srv, args.clients, args.seconds, args.seed)
    finally:
        rc = srv.stop()
    rep["server_exit_code"] = rc
    rep["server_log"] = str(log)
    rep["machine"] = {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    if rc not in (0, -signal.SIGTERM):  # uvicorn re-raises SIGTERM once it has shut down cleanly
        rep["violations"].append(f"the server exited {rc} on SIGTERM (log: {log})")
    print(format_report(rep))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=1))
    return 1 if rep["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""What today's agent clients send, replayed: the first requests (and a tool-result follow-up) of
Claude Code, Codex, opencode, Continue's CLI and aider, recorded from the real clients pointed at
`duet serve` (``tests/capture_agent_requests.py``) and kept, prose neutralized, as fixtures
(``tests/data/agent_requests/``, ``tests/agent_fixtures.py``).

Each is sent as recorded (method, path, query, headers, body) to the server on a tiny random model
that tokenizes as the bundled SmolLM2 does, so the prompts are their real size in tokens, with a
64K context that holds them and ``--max-tokens 8`` so a random model's reply stays short. Each must
get a 200 and, when streamed, a stream that parses to its API's end event; the model must be shown
exactly the client's own function tools (namespaces flattened, hosted tools left out).

The slow set runs the real ``claude -p`` and ``codex exec`` against `duet serve` when they are
installed (skipped, saying so, when not), on a tiny model scripted to answer every chat with a
greeting and end its turn (``make_scripted_model_dir``): the client must exit 0 and print it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from app.server.app import create_app
from mlx_engine.config import EngineConfig
from mlx_engine.engine import Engine
from tests import agent_fixtures
from tests.route_fuzz import sse_data
from tests.test_server_harness import TOOLS_TEMPLATE, ServerProcess
from tests.tiny_models import bundled_tokenizer, make_scripted_model_dir, make_tiny_model_dir

CONTEXT = 65536
REPLY_CAP = 8
RECORDED_MODEL = "SmolLM2-135M-Instruct-Q4_1"
GREETING = "Hi! How can I help?"
FIXTURES = agent_fixtures.names()
HOSTED = {"web_search", "file_search", "code_interpreter", "computer_use_preview", "image_generation", "mcp"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agents") / "tiny-agent"
    return make_tiny_model_dir(path, tokenizer=bundled_tokenizer(TOOLS_TEMPLATE), context=CONTEXT)


@pytest.fixture(scope="module")
def engine(model_dir):
    e = Engine.load(str(model_dir), config=EngineConfig(cache_gb=0.5, max_running=4))
    yield e
    e.shutdown()


@pytest.fixture
def seen(engine, monkeypatch) -> list:
    """The requests the engine tokenized (each with the tools the template was given)."""
    calls: list = []
    real = engine.prepare_prompt
    monkeypatch.setattr(engine, "prepare_prompt", lambda req: calls.append(req) or real(req))
    return calls


def declared_tools(fixture: dict) -> list[str]:
    """The function tools a request declares, as the model must see them: Anthropic client tools,
    Responses function tools and the functions of its namespaces, chat function tools."""
    names: list[str] = []
    for t in fixture["body"].get("tools") or []:
        kind = t.get("type")
        if fixture["path"].endswith("/messages"):
            if kind in (None, "custom"):
                names.append(t["name"])
        elif kind == "namespace":
            names += [x["name"] for x in t["tools"] if x.get("type", "function") == "function"]
        elif kind == "function":
            names.append(t["function"]["name"] if "function" in t else t["name"])
    return names


async def replay(engine, fixture: dict) -> httpx.Response:
    # the clients were pointed at the bundled model: its id is an alias of the tiny one here
    app = create_app(engine, max_tokens=REPLY_CAP, aliases=(RECORDED_MODEL,))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=600) as c:
        body = fixture["body"]
        content = json.dumps(body).encode() if body is not None else None
        url = fixture["path"] + (f"?{fixture['query']}" if fixture["query"] else "")
        headers = {k: v for k, v in fixture["headers"].items() if k != "content-length"}
        return await c.request(fixture["method"], url, content=content, headers=headers)


def check_stream(path: str, text: str) -> None:
    """The stream parses, event by event, and ends as its API ends one."""
    events = sse_data(text.replace("data: [DONE]", ""))
    assert events, text[:500]
    if path.endswith("/messages"):
        kinds = [e["type"] for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        assert "error" not in kinds
    elif path.endswith("/responses"):
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created", kinds
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    else:
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]
        assert all("choices" in e for e in events), events[:3]
        assert any(c.get("finish_reason") for e in events for c in e["choices"])


def test_every_client_is_recorded():
    clients = {agent_fixtures.load(n)["client"] for n in FIXTURES}
    assert {"claude-code", "codex", "opencode", "continue", "aider"} <= clients, clients
    follow_ups = {agent_fixtures.load(n)["client"] for n in FIXTURES if "tool-result" in n}
    assert {"claude-code", "codex", "opencode"} <= follow_ups, follow_ups


@pytest.mark.parametrize("name", FIXTURES)
async def test_recorded_request_is_served(engine, seen, name):
    fixture = agent_fixtures.load(name)
    r = await replay(engine, fixture)
    assert r.status_code == 200, r.text[:2000]
    if fixture["method"] == "HEAD":
        return
    if fixture["method"] == "GET":
        assert r.text
        return
    if fixture["body"].get("stream"):
        check_stream(fixture["path"], r.text)
    else:
        r.json()
    if fixture["path"].endswith("count_tokens"):
        return
    rendered = [req for req in seen if req.messages is not None]  # the chat the template was given
    assert len(rendered) == 1, rendered
    shown = [t["function"]["name"] for t in rendered[0].tools or []]
    expected = declared_tools(fixture)
    assert sorted(shown) == sorted(expected), (shown, expected)  # each once, nothing hosted
    assert not HOSTED & set(shown)


async def test_a_namespace_call_comes_back_under_its_namespace(engine):
    """A call the model makes to a tool inside a namespace is a function_call item with the
    function's own name and its namespace, as Codex reads it; sent back, it reads as the model
    wrote it."""
    fixture = agent_fixtures.load(next(n for n in FIXTURES if n.startswith("codex") and "first" in n))
    body = dict(fixture["body"], stream=False)
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    inner = namespace["tools"][0]["name"]
    body["tool_choice"] = {"type": "function", "name": inner, "namespace": namespace["name"]}
    r = await replay(engine, dict(fixture, body=body))
    assert r.status_code == 200, r.text[:1000]
    calls = [x for x in r.json()["output"] if x["type"] == "function_call"]
    assert calls and calls[0]["name"] == inner and calls[0]["namespace"] == namespace["name"], calls


def test_claude_codes_late_system_message_is_a_system_turn_in_place(engine):
    """Claude Code sends its agent and skill lists as a system message after the user's; a
    template that renders any role keeps it there (system_turns)."""
    fixture = agent_fixtures.load(next(n for n in FIXTURES if n.startswith("claude-code") and "first" in n))
    roles = [m["role"] for m in fixture["body"]["messages"]]
    assert "system" in roles[1:], roles
    from app.server.anthropic import chat_fields
    from app.server.anthropic_protocol import MessagesRequest

    messages = chat_fields(MessagesRequest.model_validate(fixture["body"]))["messages"]
    text = engine.tokenizer.apply_chat_template(messages)
    late = messages[[m["role"] for m in messages].index("user") + 1]
    assert late["role"] == "system"
    assert text.index("<|im_start|>user") < text.rindex("<|im_start|>system\n" + late["content"][:40])


# --- the real clients, when installed ------------------------------------------------------------


def _installed(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (npm install -g {package})")
    return path


@pytest.fixture
def claude() -> str:
    return _installed("claude", "@anthropic-ai/claude-code")


@pytest.fixture
def codex() -> str:
    return _installed("codex", "@openai/codex")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`duet serve` on a tiny model that answers every chat with GREETING and ends its turn."""
    root = tmp_path_factory.mktemp("agent-serve")
    path = make_scripted_model_dir(root / "scripted", GREETING)
    srv = ServerProcess(path, root / "server.log", "--cache-gb", "0.5")
    yield srv
    srv.stop()


@pytest.mark.slow
def test_claude_code_says_hi(claude, served, tmp_path):
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": served.base,
        "ANTHROPIC_AUTH_TOKEN": "unused",
        "ANTHROPIC_MODEL": "scripted",  # the model directory's name is the served id
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "scripted",
        # tests talk to loopback only: no telemetry, error reports or update checks
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    p = subprocess.run(
        [claude, "-p", "say hi"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert GREETING in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])


@pytest.mark.slow
def test_codex_exec_says_hi(codex, served, tmp_path):
    home = tmp_path / "codex"
    home.mkdir()
    # tests talk to loopback only: no analytics or update checks (top-level keys before the tables)
    (home / "config.toml").write_text(
        'model = "scripted"\nmodel_provider = "duet"\ncheck_for_update_on_startup = false\n\n'
        f'[model_providers.duet]\nname = "Duet"\nbase_url = "{served.base}/v1"\nwire_api = "responses"\n\n'
        "[analytics]\nenabled = false\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    env = {**os.environ, "CODEX_HOME": str(home)}
    p = subprocess.run(
        [codex, "exec", "say hi"],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert GREETING in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
    assert "ERROR" not in p.stderr, p.stderr[-2000:]

"""`duet serve` start-up decisions: loopback detection, model aliases, the API key and its sources,
refusing a public bind without a key, taking the port before the model loads, the serve options."""

from __future__ import annotations

import argparse
import logging
import socket
from argparse import Namespace

import pytest

from app.cli import build_parser
from app.server import main
from app.server.main import add_serve_args, api_key, is_loopback, listen, model_aliases, security_policy
from mlx_engine.errors import ConfigError


@pytest.mark.parametrize(
    "host, loop",
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("192.168.1.2", False),
        ("::", False),
        ("example.org", False),
    ],
)
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


def test_model_aliases(tmp_path):
    f = tmp_path / "My-Model.Q4_0.gguf"
    aliases = model_aliases(str(f))
    assert str(f) in aliases and "My-Model.Q4_0.gguf" in aliases and "My-Model.Q4_0" in aliases
    assert model_aliases(None) == ("default",)


def serve_args(*argv: str) -> Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_serve_options_are_defined_once_with_help():
    p = argparse.ArgumentParser()
    add_serve_args(p)
    options = {a.dest: a for a in p._actions if a.dest != "help"}
    assert set(options) == {
        "host",
        "port",
        "api_key",
        "api_key_file",
        "cache_isolation",
        "allowed_hosts",
        "allowed_origins",
        "max_body_mb",
        "docs",
        "insecure_no_key",
        "max_queue",
        "max_running",
        "max_tokens",
        "embedding_model",
        "keep_alive",
        "max_loaded",
        "max_loaded_gb",
    }
    assert all(a.help for a in options.values())
    args = serve_args("--allowed-hosts", "a.lan,b.lan", "--allowed-hosts", "c.lan", "--docs")
    assert args.allowed_hosts == ["a.lan,b.lan", "c.lan"] and args.docs and args.max_body_mb == 8
    assert args.max_tokens is None and args.context_length is None
    args = serve_args("--max-tokens", "64", "-c", "32768")
    assert args.max_tokens == 64 and args.context_length == 32768


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("DUET_API_KEY", raising=False)
    assert api_key(serve_args()) is None
    monkeypatch.setenv("DUET_API_KEY", "")
    assert api_key(serve_args()) is None  # empty means no key, not "an empty bearer"
    monkeypatch.setenv("DUET_API_KEY", "from-env")
    assert api_key(serve_args()) == "from-env"
    assert api_key(serve_args("--api-key", "from-flag")) == "from-flag"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert api_key(serve_args("--api-key-file", str(f))) == "from-file"
    with pytest.raises(ConfigError, match="not both"):
        api_key(serve_args("--api-key-file", str(f), "--api-key", "x"))
    f.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        api_key(serve_args("--api-key-file", str(f)))
    with pytest.raises(ConfigError, match="cannot read"):
        api_key(serve_args("--api-key-file", str(tmp_path / "missing")))


def test_public_bind_needs_a_key_or_an_explicit_opt_out(monkeypatch, caplog):
    monkeypatch.delenv("DUET_API_KEY", raising=False)
    for host in ("0.0.0.0", "::", "192.168.1.2"):
        with pytest.raises(ConfigError, match="without an API key") as e:
            security_policy(serve_args("--host", host))
        assert "\n" not in str(e.value)
    assert security_policy(serve_args("--host", "0.0.0.0", "--api-key", "k")).api_key == "k"
    with caplog.at_level(logging.WARNING, logger="duet.server"):
        assert security_policy(serve_args("--host", "0.0.0.0", "--insecure-no-key")).api_key is None
    assert "without an API key" in caplog.text
    assert security_policy(serve_args("--host", "127.0.0.1")).api_key is None


@pytest.mark.parametrize(
    "argv, match",
    [
        (("--allowed-hosts", "http://x.lan"), "not a host name"),
        (("--allowed-origins", "localhost:3000"), "not an origin"),
        (("--max-body-mb", "0"), "must be positive"),
        (("--max-queue", "0"), "at least 1"),
        (("--max-running", "-2"), "at least 1"),
    ],
)
def test_bad_security_options_are_one_line_config_errors(argv, match, monkeypatch):
    monkeypatch.delenv("DUET_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=match) as e:
        security_policy(serve_args(*argv))
    assert "\n" not in str(e.value)


def test_listen_reports_a_taken_port_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="already in use") as e:
            listen("127.0.0.1", port)
        assert "\n" not in str(e.value) and e.value.option == "port"
    with pytest.raises(ConfigError, match="between 0 and 65535"):
        listen("127.0.0.1", 70000)
    sock = listen("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname(), timeout=5):
            pass  # it listens
    finally:
        sock.close()


def test_serve_takes_the_port_before_loading_the_model(monkeypatch):
    """The port is listening while the model loads; a bad option stops serve before either."""
    monkeypatch.delenv("DUET_API_KEY", raising=False)
    seen = {}

    class Stop(Exception):
        pass

    def fake_load(args, *_):
        with socket.create_connection(("127.0.0.1", args.port), timeout=5):
            seen["listening"] = True
        raise Stop

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(main, "build_registry", fake_load)
    with pytest.raises(Stop):
        main.serve(serve_args("--port", str(port)))
    assert seen == {"listening": True}
    # the socket was closed again after the failed load: the port is free
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))

    monkeypatch.setattr(main, "build_registry", lambda *_: pytest.fail("the model must not load"))
    with pytest.raises(ConfigError):
        main.serve(serve_args("--host", "0.0.0.0"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="already in use"):
            main.serve(serve_args("--port", str(taken.getsockname()[1])))


def test_serve_builds_the_grammar_tokenizer_before_serving(monkeypatch, tiny_dirs):
    """llguidance's tokenizer holds the GIL for its whole build (~0.3 s for the bundled model's 49k
    vocabulary, more on a loaded machine): built in the first JSON-schema request, on a worker
    thread even, it stalled the event loop, and /health with it, past 1 s in bench/soak.py's first
    burst of 64 clients. So does the tokenizer's copy that reads control-token text as text
    (~0.2 s). `duet serve` builds both before it serves."""
    from mlx_engine.sampling.constraints import GrammarFactory
    from mlx_engine.tokenization.tokenizer import Tokenizer

    monkeypatch.delenv("DUET_API_KEY", raising=False)
    calls: list[str] = []
    real_prepare = GrammarFactory.prepare

    def prepare(self):
        calls.append("prepare")
        real_prepare(self)

    monkeypatch.setattr(GrammarFactory, "prepare", prepare)
    real_tokenizer_prepare = Tokenizer.prepare

    def tokenizer_prepare(self):
        calls.append("tokenizer")
        real_tokenizer_prepare(self)

    monkeypatch.setattr(Tokenizer, "prepare", tokenizer_prepare)
    monkeypatch.setattr(main._Server, "run", lambda self, sockets=None: calls.append("run"))
    main.serve(serve_args("--model", str(tiny_dirs("llama")), "--port", "0", "--cache-gb", "0.01"))
    assert calls == ["prepare", "tokenizer", "run"]

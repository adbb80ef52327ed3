"""`duet serve` start-up decisions: loopback detection, model aliases, the public-bind warning."""

from __future__ import annotations

import logging
from argparse import Namespace

import pytest

from app.server import main
from app.server.main import is_loopback, model_aliases


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


def test_warns_when_public_without_key(monkeypatch, caplog):
    class Stop(Exception):
        pass

    def no_load(args):
        raise Stop

    monkeypatch.setattr(main, "_load", no_load)
    for host, key, warned in [("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="duet.server"), pytest.raises(Stop):
            main.serve(Namespace(host=host, port=0, api_key=key, model=None))
        assert ("without an API key" in caplog.text) is warned

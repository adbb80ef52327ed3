"""Peers in `duet chat`: the status bar says where the last prefill ran (a real prefill peer over
loopback: `PeerServer` over an `Engine`, as `duet peer serve` runs it), the peers panel lists the chat's
prefill peers, the paired machines and the peers advertised over mDNS (on loopback), and `/peers`
shows or hides it, pairs with a one-time code (against a real `duet peer pair` side) and unpairs."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import socket
import threading
from functools import partial

import pytest
from rich.console import Console

from app.tui.app import ChatApp
from app.tui.backends import LocalBackend
from app.tui.peers import PeerDirectory
from app.tui.widgets import seconds
from mlx_engine.engine import Engine, EngineConfig
from peer.discovery import Advertiser
from peer.identity import local_hello
from peer.server import EngineBackend, PeerServer
from peer.trust.keys import PairedPeers, load_identity
from peer.trust.pairing import PairingCode, PairingError, serve_pairing
from tests.test_tui import (  # noqa: F401 (count_handled_lines: an autouse fixture type_and_send needs)
    count_handled_lines,
    loaded,
    reply_done,
    type_and_send,
    until,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("chat_dirs")]
WAIT = 120.0  # a deadline for hangs only


@pytest.fixture
def prefill_peer(tiny_dirs, chat_dirs):
    """A prefill peer on 127.0.0.1 (what `duet peer serve --port 0` runs: loopback connections
    authenticated by this test's local peer secret); yields its HOST:PORT."""
    from peer.trust.link_security import security_for

    engine = Engine.load(str(tiny_dirs("llama")), config=EngineConfig(cache_gb=0.02))
    hello = engine.run_on_worker(lambda: local_hello(engine), WAIT)
    server = PeerServer(EngineBackend(engine), hello, security=security_for("127.0.0.1")).start()
    yield f"127.0.0.1:{server.port}"
    server.close()
    engine.shutdown()


@pytest.fixture
def chat_dirs(tmp_path, monkeypatch):
    """Conversations, input history, this machine's peer key and paired peers: per test (the suite's
    are shared by every test)."""
    monkeypatch.setenv("DUET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("DUET_CONFIG_DIR", str(tmp_path / "duet_config"))
    monkeypatch.delenv("DUET_NO_HISTORY", raising=False)


@pytest.fixture
def notes(monkeypatch):
    """Every notification the chat shows (toasts expire; a slow machine must not miss one)."""
    seen: list[tuple[str, str]] = []
    real = ChatApp.notify

    def spy(self, message, *args, **kw):
        seen.append((str(message), kw.get("severity", "information")))
        return real(self, message, *args, **kw)

    monkeypatch.setattr(ChatApp, "notify", spy)
    return seen


def said(notes, text: str, severity: str | None = None) -> bool:
    return any(text in m and (severity is None or s == severity) for m, s in notes)


def peer_app(model, peers: list[str], mode: str | None, directory: PeerDirectory | None = None) -> ChatApp:
    from app.peer_options import peer_spec

    spec = peer_spec(argparse.Namespace(peers=peers, remote_prefill=mode, interface=[]))
    return ChatApp(
        str(model),
        load_backend=partial(LocalBackend.load, config=EngineConfig(cache_gb=0.02), peers=spec),
        peers=directory,
    )


def panel_text(app: ChatApp) -> str:
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(app.peers_panel.body)
    return console.file.getvalue()


async def chat_once(pilot, text: str) -> None:
    for cmd in ("/temp 0", "/max 8", text):
        await type_and_send(pilot, cmd)
    await reply_done(pilot)


async def test_status_bar_shows_remote_prefill_and_the_panel_the_peer(tiny_dirs, prefill_peer):
    replies = {}
    for mode in ("always", "never"):
        app = peer_app(tiny_dirs("llama"), [prefill_peer], mode)
        async with app.run_test(size=(160, 40)) as pilot:
            await loaded(pilot)
            await chat_once(pilot, "Tell me about peers")
            replies[mode] = app.conv.messages[-1].content
            status = str(app.status_bar.render())
            usage = app.last_usage
            if mode == "always":
                assert usage.prefill_location == f"remote:{prefill_peer}"
                assert usage.remote_tokens == usage.prompt_tokens - 1
                assert f"prefill remote:{prefill_peer} " in status
                assert "(wait " in status and ", xfer " in status, status
                assert "planner: offload (--remote-prefill always)" in app.status_bar.tooltip
                # measured once: the planner now predicts the remote path, shown next to the measured TTFT
                await chat_once(pilot, "And a second question, a little longer than the first one was")
                status, tooltip = str(app.status_bar.render()), app.status_bar.tooltip
                plan = app.last_prefill["plan"]
                predicted, measured = plan["predicted_remote_ttft_s"], plan["measured_ttft_s"]
                assert measured == pytest.approx(app.last_usage.ttft_s, abs=1e-3)
                assert f"plan {seconds(predicted)})" in status, status
                assert "predicted TTFT: " in tooltip and f"remote {seconds(predicted)}; " in tooltip, tooltip
                assert f"; measured {seconds(measured)}" in tooltip, tooltip
                assert "remote:" in app.status_bar.tooltip and "of KV" in app.status_bar.tooltip
                await until(pilot, lambda p=app.peers_panel: p.display, what="the peers panel")
                (row,) = app.peer_rows
                assert (row.name, row.address, row.backend) == (prefill_peer, prefill_peer, "cpu")
                assert row.attached and row.connected and row.healthy and row.paired is None
                assert row.measured and row.prefill_tps > 0, "no prefill rate measured from the reply"
                text = panel_text(app)
                assert prefill_peer in text and "connected, healthy" in text and "loopback" in text
                assert "tok/s" in text
            else:
                assert usage.prefill_location == "local" and usage.remote_tokens == 0
                assert "prefill local " in status and "wait" not in status
                assert app.peer_rows == [] and not app.peers_panel.display
    assert replies["always"] == replies["never"], "remote prefill changed the greedy reply"


async def test_panel_stays_hidden_without_peers_and_peers_toggles_it(tiny_dirs, notes):
    app = peer_app(tiny_dirs("llama"), [], None)
    async with app.run_test() as pilot:
        await loaded(pilot)
        app.refresh_status()
        assert app.peer_rows == [] and not app.peers_panel.display
        await type_and_send(pilot, "/peers")
        assert app.peers_panel.display and "No peers yet" in panel_text(app)
        assert said(notes, "No peers yet")
        await type_and_send(pilot, "/peers")
        app.refresh_status()
        assert not app.peers_panel.display
        await type_and_send(pilot, "/peers frobnicate")
        assert said(notes, "Unknown /peers frobnicate", "error")


async def test_peers_hides_the_panel_of_a_connected_peer(tiny_dirs, prefill_peer):
    app = peer_app(tiny_dirs("llama"), [prefill_peer], "always")
    async with app.run_test() as pilot:
        await loaded(pilot)
        await until(pilot, lambda: app.peers_panel.display, what="the peers panel")
        await type_and_send(pilot, "/peers")
        app.refresh_status()  # the periodic refresh keeps it hidden
        assert not app.peers_panel.display and app.peer_rows
        await type_and_send(pilot, "/peers show")
        assert app.peers_panel.display


def other_code(code: str) -> str:
    digits = code.replace("-", "")
    wrong = f"{(int(digits) + 1) % 10**8:08d}"
    return f"{wrong[:4]}-{wrong[4:]}"


async def test_pair_with_a_code_then_unpair(tiny_dirs, tmp_path, notes):
    """The other machine runs `duet peer pair`'s side (serve_pairing) on loopback; the chat types its
    code. A wrong code is refused with a clear error and pairs nothing; the right one pairs, the panel
    shows the machine, and /peers unpair forgets it."""
    box_dir = tmp_path / "gpu_box"
    box_id = load_identity(box_dir, name="gpu-box")
    code = PairingCode()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    failures: list[PairingError] = []
    result: dict = {}

    def box() -> None:
        try:
            result["peer"] = serve_pairing(
                listener, code, box_id, PairedPeers(box_dir), on_attempt_failed=failures.append
            )
        except PairingError as e:
            result["error"] = e

    shower = threading.Thread(target=box, daemon=True)
    shower.start()
    app = peer_app(tiny_dirs("llama"), [], None)
    try:
        async with app.run_test(size=(120, 30)) as pilot:
            await loaded(pilot)
            assert not app.peers_panel.display

            for bad, message in (
                ("/peers pair", "Usage: /peers pair NNNN-NNNN HOST[:PORT]"),
                (f"/peers pair 1234 127.0.0.1:{port}", "is not NNNN-NNNN"),
                (f"/peers pair {code.code} 127.0.0.1:99999", "is not HOST[:PORT]"),
            ):
                await type_and_send(pilot, bad)
                await until(pilot, lambda m=message: said(notes, m, "error"), what=message)
            await type_and_send(pilot, f"/peers pair {other_code(code.code)} 127.0.0.1:{port}")
            await until(
                pilot, lambda: said(notes, "Pairing failed: wrong pairing code", "error"), what="the refusal"
            )
            assert PairedPeers().load() == {} and failures and failures[0].reason == "wrong_code"
            app.refresh_status()
            assert not app.peers_panel.display, "a refused pairing showed a peer"

            await type_and_send(pilot, f"/peers pair {code.code} 127.0.0.1:{port}")
            await until(pilot, lambda: said(notes, "Paired with gpu-box"), what="the pairing")
            shower.join(WAIT)
            assert set(PairedPeers().load()) == {"gpu-box"}
            assert result["peer"].fingerprint == load_identity().fingerprint  # the box knows this machine
            assert app.peers_panel.display
            (row,) = app.peer_rows
            assert (row.name, row.paired, row.state, row.attached) == ("gpu-box", True, "not seen", False)
            assert "gpu-box" in panel_text(app) and "paired" in panel_text(app)

            await type_and_send(pilot, "/peers unpair nosuch")
            assert said(notes, "Cannot unpair: no paired peer named 'nosuch' (paired: gpu-box)", "error")
            await type_and_send(pilot, "/peers unpair gpu-box")
            assert said(notes, "Unpaired gpu-box")
            assert PairedPeers().load() == {} and app.peer_rows == [] and not app.peers_panel.display
    finally:
        listener.close()
        shower.join(WAIT)


async def test_panel_lists_peers_advertised_over_mdns(tiny_dirs, tmp_path):
    """`--peers auto` browses mDNS (here on loopback only): an advertised paired machine shows under
    its paired name with its backend and advertised rate; an unpaired one shows as unpaired."""
    box_id = load_identity(tmp_path / "box", name="gpu-box")
    PairedPeers().add("gpu-box", box_id.cert_pem)
    tag = f"h3-{os.getpid()}"
    paired_txt = {"v": "1", "role": "prefill", "backend": "cuda", "tps": "1850", "id": box_id.short_id}
    stranger_txt = {"v": "1", "role": "prefill", "backend": "metal", "id": "0123456789abcdef"}
    directory = PeerDirectory(["127.0.0.1"])
    app = peer_app(tiny_dirs("llama"), [], None, directory)
    # made off the test's event loop: zeroconf's sync API would run on (and block) a running loop
    ads: list[Advertiser] = []
    try:
        for name, port, txt in ((f"{tag}-box", 7611, paired_txt), (f"{tag}-stranger", 7612, stranger_txt)):
            ads.append(await asyncio.to_thread(Advertiser, name, port, txt, ["127.0.0.1"]))
        async with app.run_test(size=(140, 30)) as pilot:
            await loaded(pilot)
            seen = lambda: {r.name for r in app.peer_rows if r.discovered}  # noqa: E731
            # (the paired machine has a row from the start: wait until the browser has seen it)
            await until(
                pilot,
                lambda: app.refresh_peers() or {"gpu-box", f"{tag}-stranger"} <= seen(),
                what="both advertised peers",
            )
            rows = {r.name: r for r in app.peer_rows}
            box, stranger = rows["gpu-box"], rows[f"{tag}-stranger"]
            assert (box.address, box.backend, box.paired, box.state) == (
                "127.0.0.1:7611",
                "cuda",
                True,
                "advertised",
            )
            assert box.prefill_tps == 1850 and not box.measured
            assert (stranger.backend, stranger.paired, stranger.prefill_tps) == ("metal", False, None)
            assert f"{tag}-box" not in rows, "the paired machine is listed twice"
            text = panel_text(app)
            assert "1,850 tok/s (adv.)" in text and "unpaired" in text
    finally:
        for ad in ads:
            await asyncio.to_thread(ad.close)
    assert directory.browser is None, "the browser outlived the chat"


async def test_an_unreadable_paired_peers_file_is_one_warning(tiny_dirs, tmp_path, notes):
    from peer.trust.keys import PEERS_FILE

    store = tmp_path / "duet_config" / PEERS_FILE  # the chat_dirs fixture's config dir
    store.parent.mkdir(parents=True)
    store.write_text("{not json")
    app = peer_app(tiny_dirs("llama"), [], None)
    async with app.run_test() as pilot:
        await loaded(pilot)
        await until(pilot, lambda: said(notes, "is unreadable", "warning"), what="the warning")
        app.refresh_status()
        assert app.peer_rows == [] and not app.peers_panel.display
        (warning,) = [m for m, _ in notes if "is unreadable" in m]  # once, not at every refresh
        assert warning.startswith(f"Peers: paired peers file {store} is unreadable: ") and "\n" not in warning
        await chat_once(pilot, "Still chatting")
        assert "reply tok" in app.conv.messages[-1].meta, "the chat stopped working"


def test_duet_chat_passes_its_peer_options_to_the_chat(tiny_dirs, tmp_path, prefill_peer):
    """`duet chat --peers HOST:PORT --remote-prefill always` gives the chat's engine that peer with
    that policy; `--peers auto --interface IP` makes the panel browse mDNS on that interface only."""
    from app import cli
    from app.tui.main import build_app
    from peer.attach import sources_of

    model = str(tiny_dirs("llama"))
    parse = cli.build_parser().parse_args
    app = build_app(parse(["chat", "--model", model, "--peers", prefill_peer, "--remote-prefill", "always"]))
    assert app.peer_dir.browse_on is None
    backend = app.load_backend(model)
    try:
        (src,) = sources_of(backend.engine)
        assert (src.name, src.policy, src.healthy) == (prefill_peer, "always", True)
    finally:
        backend.close()

    PairedPeers().add("gpu-box", load_identity(tmp_path / "box", name="gpu-box").cert_pem)
    auto = build_app(parse(["chat", "--model", model, "--peers", "auto", "--interface", "127.0.0.1"]))
    assert auto.peer_dir.browse_on == ["127.0.0.1"]


async def test_an_unreachable_peer_shows_as_not_connected_and_prefill_falls_back(tiny_dirs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        where = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    app = peer_app(tiny_dirs("llama"), [where], "always")
    async with app.run_test(size=(160, 40)) as pilot:
        await loaded(pilot)
        await until(pilot, lambda: app.peers_panel.display, what="the peers panel")
        (row,) = app.peer_rows
        assert (row.name, row.attached, row.connected, row.healthy) == (where, True, False, False)
        assert row.state == "not connected" and "cannot connect" in row.error
        assert "○ not connected" in panel_text(app) and "cannot connect" in app.peers_panel.tooltip
        await chat_once(pilot, "Anyone there?")
        status = str(app.status_bar.render())
        assert app.last_usage.prefill_location == "local"
        assert "prefill local " in status and "(fell back)" in status, status
        assert f"fallback: {where}: " in app.status_bar.tooltip

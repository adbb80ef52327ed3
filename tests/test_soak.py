"""The soak test (``bench/soak.py``, issue 30), short: 12 clients mixing every API against a real
`duet serve` on the bundled model, malformed bodies and dropped streams among them, for 45 s after
the KV pool has grown to its budget (a small one, 0.05 GiB, so that warm-up is short) and the
primer (the largest requests, 4 clients at once) is done.

Every check of the soak must hold: complete replies to every well-formed request not dropped, a 4xx
to every malformed one, no 5xx, /health within 1 s throughout, the server drained afterwards
(running, waiting and the KV blocks held by requests back to 0) and its RSS flat (< 10%) from the
first third of the window to the last. The window is the soak's fixed duration; every wait in it
(a reply, the drain) is on the server's own answer, with deadlines far above what they take.
"""

from __future__ import annotations

import pytest

from bench import soak
from tests.test_server_harness import ServerProcess

CLIENTS = 12
SECONDS = 45


@pytest.mark.slow
@pytest.mark.soak  # `make soak-test`: its short window's RSS check is not yet steady (docs/BENCHMARKS.md)
def test_soak(tmp_path):
    srv = ServerProcess(None, tmp_path / "server.log", "--cache-gb", "0.05", timeout=300)
    try:
        report = soak.soak(srv, CLIENTS, SECONDS, seed=30)
    finally:
        srv.stop()
    text = soak.format_report(report)
    print(text)
    assert not report["violations"], text
    # the mix was what it says: every API and malformation seen, streams dropped
    kinds = set(report["by_kind"])
    assert {k for k in soak.KINDS if k != "responses_chain"} <= kinds, kinds
    assert {"responses_chain_first", "responses_chain_next"} <= kinds, kinds
    assert report["outcomes"].get("dropped", 0) > 0 and report["outcomes"].get("rejected", 0) > 0
    assert report["pool_full"], "the KV pool never reached its budget: the RSS window began early"

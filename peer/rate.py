"""A prefill peer's measured prefill rate, for its mDNS TXT record (``tps``) and the decoders'
planning: measured once with one synthetic prompt when ``duet peer serve`` starts, then cached per
model fingerprint, backend and device in ``prefill_rates.json`` in the config directory (so a
restart does not pay for it again)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from mlx_engine.private_files import private_dir, write_private
from peer.trust.keys import config_dir, dir_lock

RATES_FILE = "prefill_rates.json"
PROBE_TOKENS = 512
log = logging.getLogger("duet.peer")


def _key(fingerprint: str, backend: str, device: str) -> str:
    return f"{fingerprint}|{backend}|{device}"


def cached_rate(fingerprint: str, backend: str, device: str, directory: Path | None = None) -> float | None:
    path = (directory or config_dir()) / RATES_FILE
    try:
        rates = json.loads(path.read_text())
        rate = rates.get(_key(fingerprint, backend, device))
    except (OSError, ValueError, AttributeError):
        return None
    return float(rate) if isinstance(rate, int | float) and rate > 0 else None


def store_rate(
    fingerprint: str, backend: str, device: str, rate: float, directory: Path | None = None
) -> None:
    d = private_dir(directory or config_dir())
    path = d / RATES_FILE
    with dir_lock(d):
        try:
            rates = json.loads(path.read_text())
            if not isinstance(rates, dict):
                rates = {}
        except (OSError, ValueError):
            rates = {}
        rates[_key(fingerprint, backend, device)] = round(float(rate), 1)
        write_private(path, (json.dumps(rates, indent=2, sort_keys=True) + "\n").encode(), durable=True)


async def _probe(engine: Any, n_tokens: int) -> None:
    from mlx_engine.request import GenerationRequest, SamplingParams

    ids = [(7 * i + 3) % 97 + 1 for i in range(n_tokens)]  # small ids: inside any vocabulary
    req = GenerationRequest(
        prompt=ids,
        max_tokens=1,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        cache_salt="duet-prefill-rate-probe",  # never shares cached blocks with real prompts
    )
    async for _ in engine.generate(req):
        pass


def prefill_rate(
    engine: Any, fingerprint: str, backend: str, device: str, *, directory: Path | None = None
) -> float | None:
    """This engine's prefill tokens/s: the cached value for (model, backend, device), else measured
    now with one prompt of up to ``PROBE_TOKENS`` tokens and cached. None when it cannot be measured
    (logged; the peer serves anyway)."""
    rate = cached_rate(fingerprint, backend, device, directory)
    if rate is not None:
        return rate
    n = max(16, min(PROBE_TOKENS, int(getattr(engine, "context_length", PROBE_TOKENS)) - 2))
    try:
        asyncio.run(_probe(engine, n))
        measured = engine.local_prefill_rate()
    except Exception as e:  # a failed probe must not stop the peer from serving
        log.warning("peer: could not measure the prefill rate: %s", e)
        return None
    if not measured:
        return None
    store_rate(fingerprint, backend, device, measured, directory)
    return float(measured)

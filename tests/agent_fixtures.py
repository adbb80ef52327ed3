"""The recorded requests of real agent clients, as fixtures (``tests/data/agent_requests/``).

    python tests/agent_fixtures.py --from /tmp/claude.jsonl --client claude-code --version 2.1.197

turns the lines ``tests/capture_agent_requests.py`` wrote into one JSON file per request, named
``<client>-<n>-<what>.json``: the method, path, query and headers as sent, and the body with its
structure and every field kept, but its prose (system prompts, tool and parameter descriptions,
message text: strings of ``PROSE_CHARS`` characters or more) replaced by neutral text of the same
length and line count, so the fixtures carry no vendor's prompt text yet tokenize to a prompt of
the same size. Names, ids, types, enum values and short strings stay as they were.

``load(name)`` reads a fixture back for ``tests/test_agent_clients.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parent / "data" / "agent_requests"
PROSE_CHARS = 80
# keys whose values are identifiers, never prose, whatever their length
_KEEP_KEYS = {"name", "type", "model", "id", "call_id", "tool_use_id", "namespace", "role", "pattern"}
_WORDS = (
    "the quiet river runs past old stone walls and green fields where a small boat waits "
    "for morning light while birds call from tall trees near the open road"
).split()


def neutral(text: str) -> str:
    """Neutral words of ``text``'s length, line for line (the same seed gives the same words)."""
    lines = []
    for n, line in enumerate(text.split("\n")):
        seed = int.from_bytes(hashlib.sha256(f"{n}:{len(line)}".encode()).digest()[:4], "big")
        words: list[str] = []
        size = 0
        i = seed
        while size < len(line):
            w = _WORDS[i % len(_WORDS)]
            words.append(w)
            size += len(w) + 1
            i = i * 1103515245 + 12345
        lines.append(" ".join(words)[: len(line)])
    return "\n".join(lines)


def scrub(value: Any, key: str | None = None) -> Any:
    """``value`` with its prose replaced (``neutral``), structure and short strings kept."""
    if isinstance(value, dict):
        return {k: scrub(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, key) for v in value]
    if isinstance(value, str) and len(value) >= PROSE_CHARS and key not in _KEEP_KEYS:
        return neutral(value)
    return value


def _what(record: dict) -> str:
    body = record.get("body") if isinstance(record.get("body"), dict) else {}
    if record["method"] != "POST":
        return record["method"].lower() + "-" + (record["path"].strip("/").replace("/", "-") or "root")
    text = json.dumps(body)
    if any(k in text for k in ('"tool_result"', '"function_call_output"', '"role": "tool"')):
        return "tool-result"
    return "first" if body.get("tools") else "side"


def write(records: list[dict], client: str, version: str, root: Path = ROOT) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, record in enumerate(records):
        fixture = {"client": client, "version": version, **record, "body": scrub(record.get("body"))}
        path = root / f"{client}-{n}-{_what(record)}.json"
        path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def load(name: str) -> dict:
    return json.loads((ROOT / name).read_text())


def names() -> list[str]:
    return sorted(p.name for p in ROOT.glob("*.json"))


def main() -> None:
    p = argparse.ArgumentParser(description="recorded agent requests -> fixtures")
    p.add_argument(
        "--from", dest="src", type=Path, required=True, help="a capture_agent_requests.py --out file"
    )
    p.add_argument("--client", required=True)
    p.add_argument("--version", required=True)
    a = p.parse_args()
    records = [json.loads(line) for line in a.src.read_text().splitlines() if line.strip()]
    for path in write(records, a.client, a.version):
        print(path)


if __name__ == "__main__":
    main()

"""Save an SVG screenshot of the chat after one real exchange (for the README):

    python -m app.tui.screenshot docs/screenshot.svg [--model M] [--prompt TEXT]

Runs the app headless on the model (default: the bundled one), greedy, in a throwaway data dir.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from functools import partial
from pathlib import Path


async def take(out: Path, model: str | None, prompt: str, size: tuple[int, int], max_tokens: int) -> None:
    from mlx_engine.engine import EngineConfig

    from .app import ChatApp
    from .backends import LocalBackend

    app = ChatApp(model, load_backend=partial(LocalBackend.load, config=EngineConfig(cache_gb=0.25)))
    async with app.run_test(size=size) as pilot:
        while app.backend is None:
            await pilot.pause(0.1)
        for line in ("/temp 0", f"/max {max_tokens}", prompt):
            app.prompt.load_text(line)
            await pilot.press("enter")
            await pilot.pause(0.1)
        while app.generating:
            await pilot.pause(0.1)
        await pilot.pause(4)  # let the settings toasts fade
        app.prompt.cursor_blink = False
        await pilot.pause(0.2)
        out.write_text(app.export_screenshot(title="duet chat"), encoding="utf-8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=None)
    p.add_argument("--prompt", default="Give me three short tips for writing clean Python code.")
    p.add_argument("--size", default="110x34", help="columns x rows")
    p.add_argument("--max-tokens", type=int, default=160)
    a = p.parse_args()
    cols, rows = (int(x) for x in a.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DUET_DATA_DIR"] = tmp
        asyncio.run(take(a.out, a.model, a.prompt, (cols, rows), a.max_tokens))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

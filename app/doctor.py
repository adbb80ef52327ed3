"""`duet doctor`: what this installation will run on, and what is wrong with it.

One report, as text or ``--json``: Duet's version and where it is installed; MLX's version, backend
(Metal / CUDA / CPU), device and memory; which kernels will run; which BLAS MLX really calls; the
bundled model; the Hugging Face cache (location, size, loadable models); the config, data and log
directories; the launchd/systemd service; this machine's peer identity, paired peers and the
interfaces zeroconf would use (browsing only on ``--interface`` addresses the user names: never
every interface); on macOS, whether Local Network permission seems missing.

Every problem found is one line on stderr (``duet doctor: problem: ...``) and makes the exit code
1; the report itself still prints, so a script reading ``--json`` sees ``problems`` too.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_PROBLEMS = 1
MLX_BACKEND_PACKAGES = ("mlx-metal", "mlx-cuda-13", "mlx-cuda-12", "mlx-cpu")
LINUX_BACKENDS = ("mlx-cpu", "mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")  # each ships mlx/lib/libmlx.so
CUDA_DRIVERS = {"mlx-cuda-13": ">= 580", "mlx-cuda-12": ">= 550.54.14"}
MDNS_GROUP, MDNS_PORT = "224.0.0.251", 5353


@dataclass
class Report:
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": not self.problems, "problems": list(self.problems), **self.sections}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gib(n: float) -> float:
    return round(n / 2**30, 2)


def mlx_install_problem(platform: str = sys.platform) -> str | None:
    """On Linux, MLX's backend is a separate wheel chosen by duet-llm's extra: none installed, or
    several (they overwrite each other's libmlx.so), is a broken install. None when it is sound."""
    if platform != "linux":
        return None
    present = [p for p in LINUX_BACKENDS if _version(p)]
    if not present:
        return (
            "MLX has no backend installed: pip install 'duet-llm[cpu]' (CPU) or 'duet-llm[cuda]' "
            "(NVIDIA GPU; docs/install.md)"
        )
    if len(present) > 1:
        return (
            f"several MLX backends are installed ({', '.join(present)}) and overwrite each other's "
            "libmlx.so: pip uninstall all of them, then install duet-llm with one extra ([cpu] or [cuda])"
        )
    return None


def check_mlx_install() -> None:
    """Raise ``ConfigError`` (one line, before MLX is imported) when MLX's install is broken."""
    from mlx_engine.errors import ConfigError

    problem = mlx_install_problem()
    if problem is not None:
        raise ConfigError(problem, "mlx")


# --- sections -------------------------------------------------------------------------------------
def duet_section(report: Report) -> str:
    import app
    from mlx_engine import __version__

    report.sections["duet"] = {
        "version": __version__,
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "installed_at": str(Path(app.__file__).resolve().parent.parent),
    }
    return __version__


def mlx_section(report: Report) -> str | None:
    """MLX, its backend, device and memory; returns the backend name, None when MLX is unusable."""
    section: dict[str, Any] = {
        "version": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "packages": {p: v for p in MLX_BACKEND_PACKAGES if (v := _version(p))},
    }
    report.sections["mlx"] = section
    problem = mlx_install_problem()
    if problem is not None:
        report.problems.append(problem)
        return None
    try:
        import mlx.core as mx

        from mlx_engine.backend import backend_name, total_memory_bytes
    except Exception as e:  # a broken wheel, a missing library
        report.problems.append(f"MLX does not import ({type(e).__name__}: {e}); reinstall duet-llm")
        return None
    backend = backend_name()
    try:
        info = dict(mx.device_info())
    except Exception:
        info = {}
    section.update(
        version=getattr(mx, "__version__", section["version"]),
        backend=backend,
        device=str(info.get("device_name") or info.get("architecture") or platform.machine()),
        memory_gib=_gib(total_memory_bytes()),
    )
    for pkg, driver in CUDA_DRIVERS.items():
        if pkg in section["packages"] and backend != "cuda":
            report.problems.append(
                f"MLX's CUDA backend ({pkg}) is installed but no CUDA GPU is usable: check `nvidia-smi` "
                f"(it needs an NVIDIA driver {driver}, compute capability >= 7.5)"
            )
    return backend


def cpu_kernels_status() -> tuple[str, str | None]:
    """The C++ CPU kernels extension (``cpu_kernels``): (status, problem or None). Not built is a
    state (the dequantized path runs), a built one that does not load is a problem."""
    if importlib.util.find_spec("cpu_kernels") is None:
        return "not installed", None
    import logging

    quiet = logging.getLogger("duet.cpu_kernels")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its one-line warning is this report's business here
    try:
        spec = importlib.import_module("cpu_kernels.spec")  # optional: may be absent or older
        if spec.available():
            return f"available ({spec.default_threads()} threads)", None
        reason = spec.unavailable_reason() or "unknown reason"
    except Exception as e:  # an older or broken package
        return f"unusable ({type(e).__name__}: {e})", f"the CPU kernels package does not load: {e}"
    finally:
        quiet.setLevel(level)
    built = importlib.util.find_spec("cpu_kernels._ext") is not None
    if built and "DUET_CPU_KERNELS" not in reason:
        return f"built but unavailable: {reason}", f"the CPU kernels extension does not load: {reason}"
    return f"not used: {reason}", None


def kernels_section(report: Report, backend: str | None) -> None:
    """Which code runs each hot operation on this backend."""
    if backend is None:
        report.sections["kernels"] = {}
        return
    from mlx_engine.loading.weight_policy import keep_quantized

    if backend == "metal":
        decode = "custom Metal paged-attention kernel (metal_kernels/paged_attention.py)"
    else:
        decode = (
            "reference path: MLX gather + fused attention on the "
            f"{backend.upper()} backend (the same semantics the Metal kernel is verified against "
            "by the CPU emulator in the tests; custom kernels run on Metal only)"
        )
    if not keep_quantized(backend):
        matmul = (
            f"dense float32 weights (quantized ones expanded at load) through MLX's {backend.upper()} matmul"
        )
    elif backend == "cpu":
        matmul = "quantized weights, Duet's CPU kernels (cpu_kernels) where they apply, else MLX's"
    else:
        matmul = f"quantized weights, MLX's {'Metal' if backend == 'metal' else 'CUDA'} quantized matmul"
    section: dict[str, Any] = {
        "decode_attention": decode,
        "prefill_attention": f"MLX fused scaled_dot_product_attention ({backend})",
        "matmul": matmul,
    }
    if backend == "cpu":
        section["cpu_kernels"], problem = cpu_kernels_status()
        if problem:
            report.problems.append(problem)
    report.sections["kernels"] = section


def blas_section(report: Report, backend: str | None) -> None:
    if backend is None:
        report.sections["blas"] = {}
        return
    from mlx_engine.blas import fix_hint, mlx_blas

    info = mlx_blas()
    report.sections["blas"] = {"name": info.name, "library": info.path}
    if info.slow and backend == "cpu":
        report.problems.append(f"MLX calls the reference BLAS (~10x slower prefill on CPU): {fix_hint()}")


def model_section(report: Report) -> None:
    from mlx_engine.errors import ModelNotFoundError
    from mlx_engine.loading.resolve import BUNDLED_NAME, bundled_model_path

    section: dict[str, Any] = {"name": BUNDLED_NAME}
    report.sections["bundled_model"] = section
    try:
        path = bundled_model_path()
    except ModelNotFoundError as e:
        section.update(present=False, path=None)
        report.problems.append(str(e))
        return
    package = path.parent.name.replace("_", "-")
    section.update(
        present=True, path=str(path), package=package, size_mib=round(path.stat().st_size / 2**20, 1)
    )


def _tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (symlinks not followed: HF snapshots link to blobs)."""
    total = 0
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


def hf_cache_section(report: Report) -> None:
    from huggingface_hub import constants

    from mlx_engine.loading.resolve import cached_models

    root = Path(constants.HF_HUB_CACHE)
    report.sections["hf_cache"] = {
        "path": str(root),
        "exists": root.is_dir(),
        "size_bytes": _tree_bytes(root) if root.is_dir() else 0,
        "models": cached_models() if root.is_dir() else [],
        "offline": bool(constants.HF_HUB_OFFLINE),
    }


def _dir_state(path: Path) -> dict[str, Any]:
    exists = path.is_dir()
    probe = path if exists else next((p for p in path.parents if p.exists()), path)
    return {"path": str(path), "exists": exists, "writable": os.access(probe, os.W_OK | os.X_OK)}


def dirs_section(report: Report) -> None:
    from app.service import log_dir
    from app.tui.store import data_dir
    from peer.trust.keys import config_dir

    dirs = {"config": config_dir(), "data": data_dir(), "logs": log_dir()}
    section = {name: _dir_state(p) for name, p in dirs.items()}
    report.sections["dirs"] = section
    for name, state in section.items():
        if not state["writable"]:
            report.problems.append(f"the {name} directory {state['path']} is not writable by this user")


def service_section(report: Report) -> None:
    from app.service import service_status
    from mlx_engine.errors import ConfigError

    try:
        report.sections["service"] = service_status()
    except ConfigError as e:
        report.sections["service"] = {"error": str(e)}


def zeroconf_interfaces() -> list[dict[str, Any]]:
    """The adapters and IPv4 addresses zeroconf's default (``InterfaceChoice.All``, IPv4) would use."""
    import ifaddr

    out = []
    for adapter in ifaddr.get_adapters():
        ips = [ip.ip for ip in adapter.ips if ip.is_IPv4 and ip.network_prefix != 32]
        if ips:
            out.append({"name": adapter.nice_name, "addresses": ips})
    return out


def peers_section(report: Report, interfaces: list[str], timeout: float) -> None:
    from mlx_engine.errors import ConfigError
    from peer.trust.keys import CERT_FILE, PairedPeers, config_dir, fingerprint, short_id

    section: dict[str, Any] = {"identity": None, "paired": [], "zeroconf_interfaces": zeroconf_interfaces()}
    report.sections["peers"] = section
    cert = config_dir() / CERT_FILE
    if cert.is_file():
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            der = x509.load_pem_x509_certificate(cert.read_bytes()).public_bytes(serialization.Encoding.DER)
            section["identity"] = short_id(fingerprint(der))
        except (OSError, ValueError) as e:
            report.problems.append(f"this machine's peer certificate {cert} is unreadable: {e}")
    try:
        paired = PairedPeers().load()
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        report.problems.append(f"paired peers: {e}")
        paired = {}
    section["paired"] = [{"name": p.name, "id": p.short_id} for p in paired.values()]
    if not interfaces:
        section["discovered"] = None  # browsing needs --interface: never every interface
        return
    from peer.discovery import Browser, local_ip_for

    ips = [local_ip_for(i) for i in interfaces]  # ConfigError (exit 2) for an address not ours
    paired_ids = {p.short_id for p in paired.values()}
    with Browser(ips) as browser:
        seen = browser.collect(timeout)
    section["discovered"] = [p.as_dict(p.short_id in paired_ids) for p in sorted(seen, key=lambda p: p.name)]


def mdns_send_blocked(make_socket: Callable[[], socket.socket] | None = None) -> bool:
    """True when sending one mDNS query is refused with "no route to host", what macOS 15+ Local
    Network Privacy does to a process it has not allowed (a CLI started from Terminal inherits
    Terminal's permission; a launchd agent or a plain process does not)."""
    sock = make_socket() if make_socket else socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # a standard query for PTR _duet._tcp.local, the one Duet's discovery sends
    query = b"\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x05_duet\x04_tcp\x05local\x00\x00\x0c\x00\x01"
    try:
        sock.sendto(query, (MDNS_GROUP, MDNS_PORT))
    except OSError as e:
        return e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)
    finally:
        sock.close()
    return False


def local_network_section(report: Report) -> None:
    if sys.platform != "darwin":
        return
    blocked = mdns_send_blocked()
    report.sections["local_network"] = {"mdns_send_allowed": not blocked}
    if blocked:
        report.problems.append(
            "Local Network access seems denied (an mDNS send failed with 'no route to host'): allow "
            "the app running duet in System Settings > Privacy & Security > Local Network; a launchd "
            "agent needs the Duet app bundle (docs/install.md)"
        )


# --- the command ----------------------------------------------------------------------------------
def run_checks(interfaces: list[str] | None = None, timeout: float = 3.0) -> Report:
    report = Report()
    duet_section(report)
    backend = mlx_section(report)
    kernels_section(report, backend)
    blas_section(report, backend)
    model_section(report)
    hf_cache_section(report)
    dirs_section(report)
    service_section(report)
    peers_section(report, list(interfaces or ()), timeout)
    local_network_section(report)
    return report


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return "; ".join(_text(v) for v in value) or "none"
    return str(value)


def model_file_section(report: Report, spec: str) -> None:
    """``duet doctor MODEL``: will this model load, and how will it be held? Read from the file's
    header (a GGUF) or config (a model directory), no weights loaded."""
    from mlx_engine.errors import ModelLoadError, ModelNotFoundError
    from mlx_engine.loading.gguf_check import check_gguf
    from mlx_engine.loading.preflight import check_model

    section: dict[str, Any] = {"spec": spec}
    report.sections["model"] = section
    try:
        src = check_model(spec)
    except (ModelNotFoundError, ModelLoadError) as e:  # GGUFError is a ModelLoadError
        section["loads"] = False
        report.problems.append(str(e))
        return
    section["path"] = str(src.path)
    if src.kind != "gguf":
        section.update(loads=True, format="MLX safetensors directory")
        return
    check = check_gguf(src.path)
    details = check.as_dict()
    details.pop("path")
    details["held_as"] = {k: v for k, v in details["held_as"].items() if k not in ("F32", "F16", "BF16")}
    if not check.loads:
        report.problems.append(f"{src.path.name} will not load: {check.reason}")
    for key in ("parameters", "active_parameters"):
        if details.get(key):
            n = details[key]
            details[key] = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    for key in ("file_gb", "memory_gb"):
        details[key] = round(details[key], 2)
    section.update({k: v for k, v in details.items() if v not in (None, {}, 0, 0.0)} | {"loads": check.loads})


def format_report(report: Report) -> str:
    lines = []
    for name, section in report.sections.items():
        lines.append(f"{name}:")
        for key, value in section.items():
            lines.append(f"  {key + ':':<20} {_text(value)}")
    lines.append("ok: no problems found" if not report.problems else f"{len(report.problems)} problem(s)")
    return "\n".join(lines)


def add_doctor_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this installation: MLX backend, kernels, BLAS, model, caches, service, peers",
        description="Report what Duet will run on (MLX backend, device, kernels, BLAS), the bundled "
        "model, the Hugging Face cache, Duet's directories, the service and peers. Each problem is "
        "one line on stderr and the exit code is 1. Peers are browsed for only on --interface "
        "addresses.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="instead, check this model (a GGUF file, a model directory or a cached HF repo id): "
        "whether it will load and why not, its architecture, tensor types and memory, without loading it",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (problems included)")
    p.add_argument(
        "--interface",
        action="append",
        default=[],
        metavar="IP",
        help="also browse mDNS for peers on this interface address (repeatable; default: no browsing)",
    )
    p.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to browse with --interface (default 3)"
    )
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.model is not None:
        report = Report()
        model_file_section(report, args.model)
    else:
        report = run_checks(args.interface, args.timeout)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    for problem in report.problems:
        print(f"duet doctor: problem: {problem}", file=sys.stderr)
    return EXIT_PROBLEMS if report.problems else 0

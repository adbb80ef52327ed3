"""Pull a model from the Hugging Face hub into its cache, with progress, resumably.

    pulled = pull("bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", progress=print)
    pulled.source  # a ModelSource for load_model / the engine

Everything goes through huggingface_hub, so its cache layout (``HF_HOME`` / ``HF_HUB_CACHE``),
``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, its timeouts (``HF_HUB_ETAG_TIMEOUT``,
``HF_HUB_DOWNLOAD_TIMEOUT``) and hf_xet all apply. The steps:

1. list the repo (``HfApi.model_info(files_metadata=True)``: the commit and every file's size) and
   choose its files (``hub_spec``: the GGUF of the quant asked for, or an MLX/safetensors dir's files);
   offline (``HF_HUB_OFFLINE=1``) the same choice is made from the cache, and an uncached model is an
   error;
2. check before downloading: the bytes still to fetch fit the cache's disk (with a margin), and the
   model is not larger than this machine's memory;
3. fetch each file not yet cached. huggingface_hub 2.x drops a partial download when its process
   dies (its temporary file has a per-process name), so a plain-HTTP file is fetched here into
   ``blobs/<etag>.incomplete`` of the repo's cache folder with huggingface_hub's ``http_get``, which
   asks for the rest (``Range: bytes=N-``) when a file is already partly there, a later run resuming
   where a killed one stopped; the finished blob is then linked into the snapshot by
   ``hf_hub_download``. Files the hub serves through Xet go to ``hf_hub_download`` (hf_xet) directly.

Progress goes to a callback (``progress``) as ``PullProgress`` records, on the thread that runs
``pull``: the CLI draws bars from them (``terminal_progress``), the server can stream them as
Ollama's ``/api/pull`` NDJSON, the TUI can show them. An exception raised by the callback stops
the pull (what was downloaded stays for the next run). Errors are one-line ``DuetError``s:
``ModelNotFoundError`` for a missing or gated repo, an unknown or ambiguous quant, offline and not
cached; ``ModelLoadError`` for an unreachable or stalled hub, a full disk, a model too large for memory.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

from mlx_engine.errors import DuetError, ModelLoadError, ModelNotFoundError
from mlx_engine.loading.hub_spec import MLX_PATTERNS, HubSpec, choose_gguf, gguf_choices, parse_hub_spec
from mlx_engine.loading.resolve import ModelSource

DISK_MARGIN_BYTES = 64 * 2**20  # free space kept beyond what the download needs (and 2% of it)


@dataclass(frozen=True)
class PullProgress:
    """One step of a pull, as Ollama's ``/api/pull`` reports it.

    ``status``: ``"pulling manifest"`` (listing the repo), ``"pulling <file>"`` (a file: ``file``,
    ``digest``, ``total`` and ``completed`` bytes of that file; sent as bytes arrive, and once with
    ``completed == total`` for a file already cached), ``"success"`` (done).
    ``overall_total`` / ``overall_completed``: bytes of every file of the model together."""

    status: str
    file: str | None = None
    digest: str | None = None  # the file's etag (sha256 for LFS files)
    total: int | None = None
    completed: int = 0
    overall_total: int | None = None
    overall_completed: int = 0


ProgressHook = Callable[[PullProgress], None]


@dataclass(frozen=True)
class PulledModel:
    name: str  # canonical: owner/repo:QUANT for a GGUF, owner/repo for an MLX/safetensors dir
    repo_id: str
    revision: str  # the commit
    kind: str  # "gguf" or "hf_dir" (ModelSource.kind)
    path: Path  # the GGUF file, or the snapshot directory
    files: tuple[str, ...]  # repo paths of the model's files
    size: int  # bytes of those files
    downloaded: int = 0  # bytes fetched by this pull

    @property
    def source(self) -> ModelSource:
        return ModelSource(self.kind, self.path, self.name)


@dataclass
class _Plan:
    commit: str
    kind: str
    name: str
    files: dict[str, int | None]  # repo path -> size
    weights: list[str] = field(default_factory=list)  # the files loaded into memory


_ETAG = re.compile(r"[0-9a-fA-F]{32,64}")  # a git blob sha1 or an LFS sha256


def _hub() -> Any:
    from huggingface_hub import constants

    return constants


def _cache_dir() -> Path:
    return Path(_hub().HF_HUB_CACHE)


def _storage(repo_id: str) -> Path:
    return _cache_dir() / ("models--" + repo_id.replace("/", "--"))


def _plan(hs: HubSpec, files: dict[str, int | None], commit: str) -> _Plan:
    names = list(files)
    has_mlx = "config.json" in files and any(f.endswith(".safetensors") for f in names)
    ggufs = gguf_choices(files)
    if ggufs and (hs.quant is not None or not has_mlx):
        choice = choose_gguf(hs.repo_id, ggufs, hs.quant)
        return _Plan(
            commit,
            "gguf",
            f"{hs.repo_id}:{choice.label}",
            {f: files[f] for f in choice.files},
            [*choice.files],
        )
    if has_mlx:
        if hs.quant is not None:
            raise ModelNotFoundError(
                f"{hs.repo_id} is an MLX/safetensors repo with no GGUF files: drop :{hs.quant}"
            )
        wanted = {
            f: files[f] for f in names if "/" not in f and any(fnmatch.fnmatch(f, p) for p in MLX_PATTERNS)
        }
        weights = [f for f in wanted if f.endswith(".safetensors")]
        return _Plan(commit, "hf_dir", hs.repo_id, wanted, weights)
    raise ModelNotFoundError(
        f"{hs.repo_id} holds no model Duet can load (no .gguf file, no config.json + *.safetensors)"
    )


def _error(e: BaseException, repo_id: str) -> DuetError:
    """A one-line DuetError for what huggingface_hub or the network raised."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = _hub().ENDPOINT
    if isinstance(e, DuetError):
        return e
    if isinstance(e, GatedRepoError):
        return ModelNotFoundError(
            f"{repo_id} is a gated model: accept its license at {endpoint}/{repo_id} and set HF_TOKEN "
            "to a token of that account"
        )
    if isinstance(e, RepositoryNotFoundError):
        return ModelNotFoundError(
            f"no such model repository on the Hugging Face hub: {repo_id!r} (a private one needs HF_TOKEN)"
        )
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFoundError(f"{repo_id}: no such revision on the hub")
    if isinstance(e, OfflineModeIsEnabled | LocalEntryNotFoundError):
        return _offline_error(repo_id)
    if isinstance(e, httpx2.TimeoutException):
        return ModelLoadError(
            f"the Hugging Face hub ({endpoint}) stopped answering while pulling {repo_id}; retry "
            "(a pull resumes where it stopped), or raise HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT"
        )
    if isinstance(e, httpx2.TransportError | ConnectionError):
        return ModelLoadError(
            f"cannot reach the Hugging Face hub ({endpoint}) to pull {repo_id}: {e}; check the "
            "connection (HF_HUB_OFFLINE=1 uses only the cache)"
        )
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return ModelLoadError(f"the Hugging Face hub answered HTTP {status} while pulling {repo_id}")
    if isinstance(e, OSError):
        return ModelLoadError(f"pulling {repo_id} failed: {e}")
    raise e


def _offline_error(repo_id: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {repo_id!r} is not in the local Hugging Face cache and downloads are off "
        "(HF_HUB_OFFLINE is set or the hub is unreachable); connect and retry, or pass a local path"
    )


def _remote_plan(hs: HubSpec) -> _Plan:
    from huggingface_hub import HfApi

    info = HfApi(endpoint=_hub().ENDPOINT).model_info(
        hs.repo_id, files_metadata=True, timeout=_hub().HF_HUB_ETAG_TIMEOUT
    )
    files = {s.rfilename: s.size for s in info.siblings or []}
    if not info.sha:
        raise ModelLoadError(f"the hub gave no commit for {hs.repo_id}")
    return _plan(hs, files, info.sha)


def _cached_plan(hs: HubSpec) -> _Plan | None:
    """The plan from the cache alone (offline): the snapshot ``refs/main`` names, else the newest."""
    storage = _storage(hs.repo_id)
    snapshots = storage / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = storage / "refs" / "main"
    commit = ref.read_text().strip() if ref.is_file() else None
    if commit is None or not (snapshots / commit).is_dir():
        dirs = sorted((d for d in snapshots.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
        if not dirs:
            return None
        commit = dirs[-1].name
    root = snapshots / commit
    files: dict[str, int | None] = {
        p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()
    }
    try:
        return _plan(hs, files, commit)
    except ModelNotFoundError as e:
        if not files:
            return None
        raise ModelNotFoundError(f"{e} (offline: from the files in the cache)") from None


def total_memory() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _free_space(path: Path) -> int:
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return shutil.disk_usage(os.getcwd()).free


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _check_room(plan: _Plan, missing: dict[str, int]) -> None:
    weights = sum(plan.files.get(f) or 0 for f in plan.weights)
    ram = total_memory()
    if ram and weights > ram:
        raise ModelLoadError(
            f"{plan.name} is {_gb(weights)}, more than this machine's {_gb(ram)} of memory; pick a "
            "smaller quant or model"
        )
    need = sum(missing.values())
    if need:
        free = _free_space(_cache_dir())
        want = need + need // 50 + DISK_MARGIN_BYTES
        if free < want:
            raise ModelLoadError(
                f"not enough disk space to pull {plan.name}: {_gb(need)} to download, {_gb(free)} free "
                f"in {_cache_dir()} (HF_HUB_CACHE / HF_HOME move the cache)"
            )


def _cached_path(repo_id: str, filename: str, commit: str) -> Path | None:
    p = _storage(repo_id) / "snapshots" / commit / filename
    return p if p.exists() else None


def _partial_path(repo_id: str, etag: str) -> Path:
    return _storage(repo_id) / "blobs" / f"{etag}.incomplete"


class _Reporter:
    """Turns huggingface_hub's tqdm updates into PullProgress records for the hook."""

    def __init__(self, hook: ProgressHook | None, overall_total: int | None, overall_done: int):
        self.hook = hook
        self.overall_total = overall_total
        self.overall_done = overall_done
        self.file: str | None = None
        self.digest: str | None = None
        self.file_total: int | None = None
        self.file_done = 0
        self.received = 0  # bytes this pull downloaded

    def emit(self, status: str | None = None) -> None:
        if self.hook is not None:
            self.hook(
                PullProgress(
                    status=status or f"pulling {self.file}",
                    file=self.file,
                    digest=self.digest,
                    total=self.file_total,
                    completed=self.file_done,
                    overall_total=self.overall_total,
                    overall_completed=self.overall_done,
                )
            )

    def start(self, file: str, digest: str | None, total: int | None, done: int) -> None:
        self.file, self.digest, self.file_total, self.file_done = file, digest, total, done
        self.emit()

    def advance(self, n: int) -> None:
        self.file_done += n
        self.overall_done += n
        self.received += n
        self.emit()

    def tqdm_class(self) -> type:
        from tqdm import tqdm

        reporter = self

        class _HookBar(tqdm):
            """huggingface_hub's progress bar, drawn by the hook instead of on the terminal."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.pop("name", None)
                kwargs["disable"] = True
                super().__init__(*args, **kwargs)

            def update(self, n: float | None = 1) -> bool | None:
                reporter.advance(int(n or 0))
                return None

        return _HookBar


def _has_xet() -> bool:
    import importlib.util

    return importlib.util.find_spec("hf_xet") is not None


def _fetch(repo_id: str, filename: str, commit: str, reporter: _Reporter) -> None:
    """One file into the cache (see the module docstring, step 3)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    c = _hub()
    endpoint = c.ENDPOINT
    url = hf_hub_url(repo_id, filename, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, timeout=c.HF_HUB_ETAG_TIMEOUT, endpoint=endpoint)
    if meta.etag is None:
        raise ModelLoadError(f"the hub gave no ETag for {repo_id}/{filename}")
    if not _ETAG.fullmatch(meta.etag):  # it names a file in the cache: never a path elsewhere
        raise ModelLoadError(f"the hub gave {repo_id}/{filename} an ETag that is no hash: {meta.etag[:80]!r}")
    if meta.xet_file_data is not None and _has_xet() and not c.HF_HUB_DISABLE_XET:
        reporter.start(filename, meta.etag, meta.size, 0)
        hf_hub_download(
            repo_id,
            filename,
            revision=commit,
            cache_dir=_cache_dir(),
            endpoint=endpoint,
            etag_timeout=c.HF_HUB_ETAG_TIMEOUT,
            tqdm_class=reporter.tqdm_class(),
        )
        return
    storage = _storage(repo_id)
    blob = storage / "blobs" / meta.etag
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock = _cache_dir() / ".locks" / storage.name / f"{meta.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(str(lock)):
            if not blob.exists():
                partial = _partial_path(repo_id, meta.etag)
                headers = build_hf_headers()
                if urlparse(meta.location).netloc != urlparse(url).netloc:
                    headers.pop("authorization", None)  # the CDN's signed URL carries its own access
                with open(partial, "ab", buffering=0) as f:
                    have = f.tell()
                    if meta.size is not None and have > meta.size:
                        f.truncate(0)
                        have = 0
                    reporter.overall_done += have
                    reporter.start(filename, meta.etag, meta.size, have)
                    http_get(
                        meta.location,
                        f,
                        resume_size=have,
                        headers=headers,
                        expected_size=meta.size,
                        displayed_filename=filename,
                        tqdm_class=reporter.tqdm_class(),
                    )
                os.replace(partial, blob)
    hf_hub_download(  # links the blob into the snapshot (a HEAD, no download: the blob is there)
        repo_id,
        filename,
        revision=commit,
        cache_dir=_cache_dir(),
        endpoint=endpoint,
        etag_timeout=c.HF_HUB_ETAG_TIMEOUT,
    )


def pull(spec: str, progress: ProgressHook | None = None) -> PulledModel:
    """Fetch the model ``spec`` names (``owner/repo``, ``owner/repo:QUANT``, ``hf.co/owner/repo:QUANT``,
    a huggingface.co URL) into the Hugging Face cache, or find it there, and say where it is.

    ``progress`` gets a ``PullProgress`` at each step and as bytes arrive, on this thread.
    Offline (``HF_HUB_OFFLINE=1``) only the cache is used. Raises a one-line ``DuetError``."""
    hs = parse_hub_spec(spec)
    if hs is None:
        raise ModelNotFoundError(
            f"{spec!r} is not a Hugging Face model: expected owner/repo, owner/repo:QUANT or hf.co/owner/repo:QUANT"
        )
    if progress is not None:
        progress(PullProgress("pulling manifest"))
    plan: _Plan | None
    if _hub().HF_HUB_OFFLINE:
        plan = _cached_plan(hs)
        if plan is None:
            raise _offline_error(hs.repo_id)
    else:
        try:
            plan = _remote_plan(hs)
        except DuetError:
            raise
        except Exception as e:
            err = _error(e, hs.repo_id)
            if isinstance(err, ModelNotFoundError):
                raise err from None
            plan = _cached_plan(hs)  # the hub is unreachable: what the cache holds, as hf does
            if plan is None or any(_cached_path(hs.repo_id, f, plan.commit) is None for f in plan.files):
                raise err from None
    missing = [f for f in plan.files if _cached_path(hs.repo_id, f, plan.commit) is None]
    if missing and _hub().HF_HUB_OFFLINE:
        raise _offline_error(hs.repo_id)
    _check_room(plan, {f: plan.files[f] or 0 for f in missing})  # a partial blob's bytes count as missing
    sizes = [s for s in plan.files.values() if s is not None]
    overall = sum(sizes) if len(sizes) == len(plan.files) else None
    reporter = _Reporter(progress, overall, sum(plan.files[f] or 0 for f in plan.files if f not in missing))
    for f in plan.files:
        if f not in missing:
            size = plan.files[f] or 0
            reporter.start(f, None, size, size)
    for f in missing:
        try:
            _fetch(hs.repo_id, f, plan.commit, reporter)
        except DuetError:
            raise
        except Exception as e:
            raise _error(e, hs.repo_id) from None
    root = _storage(hs.repo_id) / "snapshots" / plan.commit
    path = root / plan.weights[0] if plan.kind == "gguf" else root
    if progress is not None:
        progress(PullProgress("success", overall_total=overall, overall_completed=reporter.overall_done))
    return PulledModel(
        name=plan.name,
        repo_id=hs.repo_id,
        revision=plan.commit,
        kind=plan.kind,
        path=path,
        files=tuple(plan.files),
        size=sum(s or 0 for s in plan.files.values()),
        downloaded=reporter.received,
    )


def terminal_progress(stream: IO[str] | None = None) -> ProgressHook:
    """A hook that draws a tqdm bar per downloaded file (bytes, rate, ETA) on ``stream`` (stderr);
    files already cached and the listing draw nothing."""
    from tqdm import tqdm

    out = stream if stream is not None else sys.stderr
    bars: dict[str, Any] = {}
    last: dict[str, int] = {}

    def hook(p: PullProgress) -> None:
        if p.file is None:
            if p.status == "success":
                for bar in bars.values():
                    bar.close()
            return
        if p.file not in bars:
            if p.total is not None and p.completed >= p.total:
                return  # cached
            bars[p.file] = tqdm(
                total=p.total,
                initial=p.completed,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=p.file if len(p.file) <= 40 else "…" + p.file[-39:],
                file=out,
                dynamic_ncols=True,
                mininterval=0.2,
            )
            last[p.file] = p.completed
            return
        bars[p.file].update(p.completed - last[p.file])
        last[p.file] = p.completed
        if p.total is not None and p.completed >= p.total:
            bars[p.file].close()

    return hook

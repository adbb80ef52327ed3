"""The model picker (F2, ``/model``): the models on this machine with their quant and size, pulling
one from Hugging Face with a progress bar, and, when the chat talks to a server, that server's
models with which of them are loaded.

- Enter on a listed model switches the chat to it (the app's ``load_model``, as before).
- Enter in the input: a local path or a listed model loads; a Hugging Face id (``owner/repo`` or
  ``owner/repo:Q4_K_M``) not listed is pulled here, in a worker thread, with a progress bar; once
  pulled it joins the list, highlighted, and Enter loads it. A failed pull shows its error here.
- With ``--server``, the list is the server's (``GET /v1/models``: ``loaded`` and ``status`` per
  model); the input takes a server model's name, and nothing is pulled. Ctrl+R asks again.
- Esc closes (a pull under way is abandoned at its next progress report).

What the picker reads and runs goes through ``local_models`` and ``pull_model``, the one place that
knows the catalogue's and the puller's APIs (tests replace them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList, ProgressBar, Static
from textual.widgets.option_list import Option

from mlx_engine.errors import DuetError

from .widgets import human_bytes

NAME_WIDTH = 34  # the name column: the rest of a row fits an 80-column terminal's dialog


@dataclass(frozen=True)
class ModelRow:
    """One model the picker lists: ``spec`` is what loading it takes."""

    spec: str
    quant: str | None = None
    size: int | None = None
    note: str = ""  # bundled, recent, Hugging Face cache; a server model's status

    def label(self, current: str) -> str:
        mark = "● " if current in (self.spec, Path(self.spec).name) else "  "
        name = self.spec if len(self.spec) <= NAME_WIDTH else "…" + self.spec[-NAME_WIDTH + 1 :]
        size = human_bytes(self.size) if self.size else ""
        return f"{mark}{name:<{NAME_WIDTH}} {self.quant or '':>7} {size:>9}  {self.note}".rstrip()


@dataclass(frozen=True)
class PullStep:
    """A pull's progress: what it is doing, and bytes done of the whole model (total None: unknown)."""

    status: str
    completed: int = 0
    total: int | None = None


class PullCancelled(Exception):
    """Raised from a progress report once nobody waits for the pull (the picker closed)."""


# --- the adapters: the catalogue and the puller -------------------------------------------------
def local_models() -> list[ModelRow]:
    """The models on this machine: the bundled one, then the Hugging Face cache's."""
    from mlx_engine.loading.catalogue import list_models

    return [ModelRow(e.name, e.quant, e.size, "bundled" if e.bundled else e.format) for e in list_models()]


def pull_model(spec: str, progress: Callable[[PullStep], None]) -> ModelRow:
    """Fetch ``spec`` into the Hugging Face cache (blocking), reporting ``progress``; the pulled model."""
    from mlx_engine.loading.hub_spec import quant_label
    from mlx_engine.loading.pull import PullProgress, pull

    def report(p: PullProgress) -> None:
        if p.overall_total is not None:
            progress(PullStep(p.status, p.overall_completed, p.overall_total))
        else:
            progress(PullStep(p.status, p.completed, p.total))

    pulled = pull(spec, progress=report)
    quant = quant_label(pulled.path.name) if pulled.kind == "gguf" else None
    return ModelRow(pulled.name, quant, pulled.size, "pulled")


def picker_rows(local: list[ModelRow], recent: list[str]) -> list[ModelRow]:
    """The local list: the catalogue's models, then those loaded earlier in this chat (paths)."""
    known = {r.spec for r in local}
    return local + [ModelRow(r, note="recent") for r in recent if r not in known]


def server_rows(cards: list[Any]) -> list[ModelRow]:
    """Rows for a server's ``/v1/models`` entries (the openai client's ``Model`` objects)."""
    rows = []
    for m in cards:
        extra = getattr(m, "model_extra", None) or {}
        status = extra.get("status") or ("loaded" if extra.get("loaded") else "")
        size = extra.get("size_bytes") if isinstance(extra.get("size_bytes"), int) else None
        quant = extra.get("quant") if isinstance(extra.get("quant"), str) else None
        rows.append(ModelRow(m.id, quant, size, status))
    return rows


# --- the screen ---------------------------------------------------------------------------------
class ModelPicker(ModalScreen[str | None]):
    """Dismisses with the spec of the model to switch to, or None."""

    DEFAULT_CSS = """
    ModelPicker { align: center middle; }
    ModelPicker #pull { height: auto; display: none; }
    ModelPicker #pull-status { height: auto; color: $text-muted; }
    ModelPicker #pull-status.-error { color: $text-error; }
    ModelPicker #pull-bar { margin-top: 0; }
    """
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("ctrl+r", "refresh", "Refresh", tooltip="list the models again"),
    ]
    AUTO_FOCUS = "#models"

    def __init__(self, rows: list[ModelRow], current: str, server: Any = None, remote: bool = False):
        """``server``: the chat's ``RemoteBackend`` when it talks to a server (its models are listed,
        with their state); ``remote``: the chat is a server's, connected or not (nothing is pulled)."""
        super().__init__()
        self.rows = list(rows)
        self.current = current
        self.server = server
        self.remote = remote or server is not None
        self.pulling: str | None = None

    @property
    def choices(self) -> list[tuple[str, str]]:
        """(spec, label) of each listed model."""
        return [(r.spec, r.label(self.current)) for r in self.rows]

    def compose(self) -> ComposeResult:
        where = f" on {self.server.url}" if self.server is not None else ""
        hint = (
            "Enter switches · Ctrl+R asks the server again · Esc cancels"
            if self.remote
            else "Enter switches · a Hugging Face id not listed is pulled · Esc cancels"
        )
        placeholder = (
            "or type a model name the server has"
            if self.remote
            else "or type: owner/repo[:QUANT] to pull, a .gguf file or a model dir"
        )
        with Vertical(classes="dialog picker"):
            yield Label(f"Model{where} — now: {self.current or 'none'}", classes="title")
            yield OptionList(*self._options(), id="models")
            yield Input(placeholder=placeholder, id="spec")
            with Vertical(id="pull"):
                yield Static("", id="pull-status", markup=False)
                yield ProgressBar(total=None, id="pull-bar", show_eta=False)
            yield Static(hint, classes="hint")

    def on_mount(self) -> None:
        if self.server is not None:
            self.action_refresh()

    def _options(self) -> list[Option]:
        return [Option(label, id=str(i)) for i, (_, label) in enumerate(self.choices)]

    def show_rows(self, rows: list[ModelRow], highlight: str | None = None) -> None:
        self.rows = rows
        models = self.query_one("#models", OptionList)
        models.clear_options()
        models.add_options(self._options())
        index = next((i for i, r in enumerate(rows) if r.spec == highlight), None)
        if index is not None:
            models.highlighted = index
            models.focus()

    # --- choosing ---------------------------------------------------------------------------------
    def action_close(self) -> None:
        self.dismiss(None)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.rows[event.option_index].spec)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        spec = event.value.strip()
        if not spec:
            return
        if self.remote or self._loadable(spec):
            self.dismiss(spec)
            return
        from mlx_engine.loading.hub_spec import parse_hub_spec

        if parse_hub_spec(spec) is None:
            self.dismiss(spec)  # neither a path nor a hub id: the load says what is wrong with it
            return
        self.start_pull(spec)

    def _loadable(self, spec: str) -> bool:
        """A listed model, or a path on this machine: nothing to pull."""
        return any(r.spec == spec for r in self.rows) or Path(spec).expanduser().exists()

    # --- pulling ----------------------------------------------------------------------------------
    def start_pull(self, spec: str) -> None:
        if self.pulling is not None:
            self.notify(f"Already pulling {self.pulling}", severity="warning")
            return
        self.pulling = spec
        self.query_one("#pull").display = True
        status = self.query_one("#pull-status", Static)
        status.remove_class("-error")
        status.update(f"Pulling {spec}…")
        self.query_one("#pull-bar", ProgressBar).update(total=None, progress=0)
        self._pull_worker(spec)

    @work(thread=True, exclusive=True, group="pull")
    def _pull_worker(self, spec: str) -> None:
        def progress(step: PullStep) -> None:
            if not self.is_attached:
                raise PullCancelled(spec)
            self.app.call_from_thread(self._progress, spec, step)

        try:
            row = pull_model(spec, progress)
        except PullCancelled:
            return
        except (DuetError, OSError, ValueError, RuntimeError) as e:
            if self.is_attached:
                self.app.call_from_thread(self._pull_failed, spec, str(e) or type(e).__name__)
            return
        if self.is_attached:
            self.app.call_from_thread(self._pulled, row)

    def _progress(self, spec: str, step: PullStep) -> None:
        bar = self.query_one("#pull-bar", ProgressBar)
        if step.total:
            bar.update(total=step.total, progress=step.completed)
            done = f"{human_bytes(step.completed)} of {human_bytes(step.total)}"
        else:
            bar.update(total=None)
            done = ""
        self.query_one("#pull-status", Static).update(f"{spec}: {step.status}  {done}".rstrip())

    def _pull_failed(self, spec: str, message: str) -> None:
        self.pulling = None
        status = self.query_one("#pull-status", Static)
        status.add_class("-error")
        status.update(f"Pulling {spec} failed: {message}")
        self.query_one("#pull-bar", ProgressBar).display = False

    def _pulled(self, row: ModelRow) -> None:
        self.pulling = None
        bar = self.query_one("#pull-bar", ProgressBar)
        bar.update(total=bar.total or 1, progress=bar.total or 1)
        self.query_one("#pull-status", Static).update(f"Pulled {row.spec}: Enter loads it")
        self.query_one("#spec", Input).value = ""
        rows = [r for r in self.rows if r.spec != row.spec]
        self.show_rows([*rows, row], highlight=row.spec)

    # --- a server's models ------------------------------------------------------------------------
    def action_refresh(self) -> None:
        if self.server is not None:
            self._server_worker()
        elif not self.remote:
            rows = picker_rows(local_models(), [r.spec for r in self.rows if r.note == "recent"])
            self.show_rows(rows)

    @work(exclusive=True, group="server-models")
    async def _server_worker(self) -> None:
        try:
            cards = [m async for m in self.server.client.models.list()]
        except Exception as e:  # the openai client's errors: the list stays as it was
            self.notify(f"Could not list the server's models: {e}", severity="warning")
            return
        current = self.query_one("#models", OptionList).highlighted
        self.show_rows(server_rows(cards))
        if current is not None and current < len(self.rows):
            self.query_one("#models", OptionList).highlighted = current


def model_picker(rows_for_local: list[str], current: str, backend: Any, remote: bool) -> ModelPicker:
    """The picker for the chat app: its server's models, or this machine's and ``rows_for_local``
    (the specs loaded earlier in the chat)."""
    if remote:
        names = getattr(backend, "models", []) or []
        return ModelPicker([ModelRow(n) for n in names], current, backend, remote=True)
    return ModelPicker(picker_rows(local_models(), rows_for_local), current)

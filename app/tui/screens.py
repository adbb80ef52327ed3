"""Modal screens: help, model picker, system prompt, sampling settings, errors."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from .model_picker import ModelPicker as ModelPicker  # it lived here: the tests' import
from .settings import FIELDS, UNSET_LABEL, Sampling


class Dialog(ModalScreen):
    """A centred box; Esc closes it with None."""

    BINDINGS = [Binding("escape", "close", "Close")]

    def action_close(self) -> None:
        self.dismiss(None)


class HelpScreen(Dialog):
    BINDINGS = [Binding("f1,q", "close", "Close", show=False)]

    def __init__(self, sections: dict[str, list[tuple[str, str]]]):
        super().__init__()
        self.sections = sections  # title -> [(key or command, what it does)]

    def compose(self) -> ComposeResult:
        from rich.console import Group, RenderableType
        from rich.table import Table
        from rich.text import Text

        parts: list[RenderableType] = []
        for title, rows in self.sections.items():
            table = Table(
                title=title,
                title_justify="left",
                title_style="bold",
                show_header=False,
                box=None,
                padding=(0, 2, 0, 0),
                expand=True,
            )
            table.add_column(style="bold", no_wrap=True)
            table.add_column(ratio=1)
            for key, what in rows:
                table.add_row(Text(key), Text(what))  # Text: "[name]" is not markup
            parts += [table, ""]
        with Vertical(classes="dialog wide"):
            yield Label("Duet chat — keys and commands", classes="title")
            with VerticalScroll():
                yield Static(Group(*parts))
            yield Static("Esc, q or F1 to close", classes="hint")

    @property
    def plain(self) -> str:
        return "\n".join(f"{k}  {v}" for rows in self.sections.values() for k, v in rows)


class SystemPromptEditor(Dialog):
    BINDINGS = [Binding("ctrl+s", "save", "Save")]
    AUTO_FOCUS = "#system"

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("System prompt", classes="title")
            yield TextArea(self.text, soft_wrap=True, id="system", tab_behavior="focus")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
            yield Static("Ctrl+S saves · Esc cancels · an empty prompt means none", classes="hint")

    def action_save(self) -> None:
        self.dismiss(self.query_one("#system", TextArea).text.strip())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)


class SettingsScreen(Dialog):
    """Sampling settings; dismisses with a validated Sampling."""

    BINDINGS = [Binding("ctrl+s", "save", "Save")]

    def __init__(self, sampling: Sampling):
        super().__init__()
        self.sampling = sampling

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Sampling", classes="title")
            for name in FIELDS:
                value = getattr(self.sampling, name)
                with Horizontal(classes="field"):
                    yield Label(name.replace("_", " "), classes="name")
                    yield Input(
                        "" if value is None else str(value),
                        id=name,
                        compact=True,
                        placeholder=UNSET_LABEL.get(name, ""),
                    )
            yield Static("", id="error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
            yield Static(
                "temperature 0 = greedy · top-k 0, top-p 1, min-p 0 = off · empty max tokens = auto "
                "(until the model stops) · empty seed = random",
                classes="hint",
            )

    def action_save(self) -> None:
        new = self.sampling
        try:
            for name in FIELDS:
                new = new.with_value(name, self.query_one(f"#{name}", Input).value)
        except ValueError as e:
            self.query_one("#error", Static).update(f"⚠ {e}")
            return
        self.dismiss(new)

    def on_input_submitted(self) -> None:
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)


class ErrorScreen(ModalScreen[str]):
    """A failure the user must see; dismisses with "pick", "keep" or "quit"."""

    BINDINGS = [Binding("escape", "close", "Close", show=False)]
    AUTO_FOCUS = "#pick"

    def __init__(self, title: str, message: str, can_keep: bool):
        super().__init__()
        self.title_text = title
        self.message = message
        self.can_keep = can_keep

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog error"):
            yield Label(self.title_text, classes="title")
            yield Static(self.message, id="message", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Pick another model", variant="primary", id="pick")
                yield Button(
                    "Keep the current model" if self.can_keep else "Quit",
                    id="keep" if self.can_keep else "quit",
                )

    def action_close(self) -> None:
        self.dismiss("keep" if self.can_keep else "pick")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)

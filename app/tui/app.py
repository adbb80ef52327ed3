"""`duet chat`: the Textual chat app.

The model loads in a thread worker (the UI shows progress meanwhile); replies stream
from ``backend.stream`` in an async worker on the app's loop. Esc cancels the request in
the backend at once and cancels the worker, which closes the stream; the worker hands the
loop back after every event, so key presses are handled between tokens however fast they
arrive (text is rendered at most every ``widgets.FLUSH_S``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Label, ListItem, ListView, ProgressBar, Static

from mlx_engine.errors import DuetError
from mlx_engine.loading.resolve import BUNDLED_NAME
from mlx_engine.request import Usage

from .backends import Backend, BackendError
from .commands import SLASH_COMMANDS, SlashCommands
from .model_picker import model_picker
from .peers import PeerDirectory, PeerRow
from .reply import stream_reply
from .screens import ErrorScreen, HelpScreen, SettingsScreen, SystemPromptEditor
from .store import NO_HISTORY_ENV, Conversation, Message, Store, history_off_by_env
from .widgets import MessageView, PeersPanel, PromptInput, StatusBar

INPUT_KEYS = [
    ("Enter", "send the message"),
    ("Shift+Enter, Ctrl+J", "new line"),
    ("Up / Down (empty input)", "recall earlier messages"),
    ("Tab / Shift+Tab", "move focus (messages, conversation list)"),
    ("c (on a focused message)", "copy that message"),
]


def key_label(key: str) -> str:
    """ "ctrl+r" -> "Ctrl+R", "escape" -> "Esc", "f1" -> "F1"."""
    names = {"escape": "Esc", "ctrl": "Ctrl", "shift": "Shift"}
    return "+".join(names.get(p, p.upper() if len(p) <= 3 else p) for p in key.split("+"))


class ConversationItem(ListItem):
    """A saved conversation in the sidebar list."""

    def __init__(self, conv_id: str, *children: Label):
        super().__init__(*children)
        self.conv_id = conv_id


class ChatApp(App):
    CSS_PATH = "chat.tcss"
    TITLE = "Duet"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    BINDINGS = [
        Binding("escape", "stop", "Stop", tooltip="stop the reply that is streaming"),
        Binding("ctrl+r", "regenerate", "Regen", tooltip="regenerate the last reply"),
        Binding("ctrl+o", "copy_reply", "Copy", tooltip="copy the last reply to the clipboard"),
        Binding("ctrl+n", "new_chat", "New", tooltip="new chat (the current one is saved)"),
        Binding("f1", "help", "Help", tooltip="this help"),
        Binding("f2", "pick_model", "Model", tooltip="pick or load a model"),
        Binding("f3", "edit_system", "System", show=False, tooltip="edit the system prompt"),
        Binding("f4", "settings", "Sampling", show=False, tooltip="sampling settings"),
        Binding("ctrl+s", "save", "Save", show=False, tooltip="save the conversation"),
        Binding(
            "ctrl+b",
            "toggle_sidebar",
            "Sidebar",
            show=False,
            tooltip="show or hide the conversations panel",
        ),
        Binding("ctrl+t", "toggle_dark", "Light/dark", show=False, tooltip="switch between light and dark"),
        Binding(
            "ctrl+p", "command_palette", "Palette", show=False, tooltip="command palette (themes, actions)"
        ),
        Binding("ctrl+q", "quit", "Quit", show=False, tooltip="save and quit"),  # App shows ^q already
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True, tooltip="save and quit"),
    ]

    def __init__(
        self,
        model: str | None = None,
        *,
        load_backend: Callable[[str | None], object],
        store: Store | None = None,
        remote: bool = False,
        peers: PeerDirectory | None = None,
    ):
        super().__init__()
        self.model_spec = model
        self.load_backend = load_backend  # blocking: spec -> backend; raises BackendError
        self.remote = remote
        self.store = store or Store()
        self.backend: Backend | None = None
        self.conv = Conversation()
        self.generating = False
        self.think: str | None = None  # /think: on, off or a level; None: the template's default
        self.last_usage: Usage | None = None
        self.last_prefill: dict = {}  # the backend's prefill report of the last reply (remote split, planner)
        self.peer_dir = peers or PeerDirectory()
        self.peer_rows: list[PeerRow] = []
        self.peers_shown: bool | None = None  # None: the panel shows once a peer exists; /peers sets it
        self.context_used: int | None = None
        self.live_tps: float | None = None
        self.recent_models: list[str] = []
        self.preferences = self.store.load_preferences()
        self.sent = self.store.load_history()  # the input history; PromptInput appends to it
        self.commands = SlashCommands(self)

    # --- layout -------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Label("Conversations", classes="section")
                yield ListView(id="conversations")
            with Vertical(id="chat"):
                with Horizontal(id="loading"):
                    yield Static("", id="loading-label", markup=False)
                    yield ProgressBar(total=None, show_eta=False, show_percentage=False)
                yield VerticalScroll(id="log")
                yield PeersPanel("", id="peers")
                yield PromptInput(self.sent, id="input", placeholder="Message (Enter sends, /help)")
        yield StatusBar("", id="status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        # Widgets of the main screen, kept so that code running while a dialog is open
        # (timers, workers) never queries the dialog by mistake.
        self.log_view = self.query_one("#log", VerticalScroll)
        self.prompt = self.query_one("#input", PromptInput)
        self.status_bar = self.query_one("#status", StatusBar)
        self.conversation_list = self.query_one("#conversations", ListView)
        self.sidebar = self.query_one("#sidebar", Vertical)
        self.loading_row = self.query_one("#loading", Horizontal)
        self.peers_panel = self.query_one("#peers", PeersPanel)
        self.log_view.anchor()
        self.prompt.focus()
        self.refresh_conversations()
        self.refresh_status()
        self.set_interval(0.5, self.refresh_status)
        self.load_model(self.model_spec)
        self._peers_worker()

    @work(thread=True, group="peers")
    def _peers_worker(self) -> None:
        try:
            self.peer_dir.prepare()  # the paired peers, and the mDNS browser with --peers auto
        except (DuetError, OSError) as e:
            self.call_from_thread(self.notify, f"Peers: {e}", title="Peers", severity="warning")
        self.call_from_thread(self.refresh_peers)

    # --- model loading --------------------------------------------------------------
    def load_model(self, spec: str | None) -> None:
        if self.generating:
            self.action_stop()
        label = spec or BUNDLED_NAME
        self.loading_row.query_one(Static).update(
            f"Connecting to {label}…" if self.remote else f"Loading {label}…"
        )
        self.loading_row.display = True
        self._load_worker(spec)

    @work(thread=True, exclusive=True, group="load")
    def _load_worker(self, spec: str | None) -> None:
        try:
            backend = self.load_backend(spec)
        except BackendError as e:
            self.call_from_thread(self._load_failed, spec, str(e))
            return
        self.call_from_thread(self._loaded, spec, backend)

    def _loaded(self, spec: str | None, backend) -> None:
        if self.generating:  # a reply from the old model was still streaming
            self.action_stop()
        old, self.backend = self.backend, backend
        self.model_spec = spec
        if spec and spec not in self.recent_models:
            self.recent_models.insert(0, spec)
        if old is not None:
            self.run_worker(old.close, thread=True, group="close")
        self.loading_row.display = False
        self.sub_title = backend.name
        self.conv.model = backend.name
        self.last_usage = None
        self.last_prefill = {}
        self._count_context()
        self.refresh_status()

    def _load_failed(self, spec: str | None, message: str) -> None:
        self.loading_row.display = False

        def chosen(what: str | None) -> None:
            if what == "pick":
                self.action_pick_model()
            elif what == "quit":
                self.exit()

        self.push_screen(ErrorScreen("The model did not load", message, self.backend is not None), chosen)

    # --- sending and streaming -------------------------------------------------------
    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if text.startswith("/"):
            self.prompt.remember(text)
            await self.commands.run(text)
            return
        if self.generating or self.backend is None:
            self.notify(
                "A reply is still streaming; Esc stops it"
                if self.generating
                else "The model is still loading",
                severity="warning",
            )
            if not self.prompt.text:
                self.prompt.load_text(event.text)  # give the message back to edit or resend
            return
        self.prompt.remember(text)
        self.conv.messages.append(Message("user", text))
        await self.log_view.mount(MessageView("user", text))
        await self.reply()

    async def reply(self) -> None:
        backend = self.backend
        assert backend is not None  # callers check
        view = MessageView("assistant", label=backend.name)
        await self.log_view.mount(view)
        self.log_view.anchor()
        n = backend.count_tokens(self.conv.chat_messages())
        view.start_thinking(f"prefill {n} tokens…" if n else "waiting for the first token…")
        self.generating = True
        self.generate(backend, view, n)

    @work(exclusive=True, group="generate")
    async def generate(self, backend: Backend, view: MessageView, prompt_tokens: int | None) -> None:
        await stream_reply(self, backend, view, prompt_tokens)

    def action_stop(self) -> None:
        """Esc: stop the reply now. The backend drops the request before its next step (whatever the
        worker is doing at this moment), and cancelling the worker ends the stream in the UI."""
        if self.generating:
            if self.backend is not None:
                self.backend.stop()
            self.workers.cancel_group(self, "generate")
        else:
            self.prompt.focus()

    async def action_regenerate(self) -> None:
        if self.generating or self.backend is None:
            return
        msgs = self.conv.messages
        if msgs and msgs[-1].role == "assistant":
            msgs.pop()
            views = self.log_view.query(MessageView)
            if views:
                await views.last().remove()
        if not msgs or msgs[-1].role != "user":
            self.notify("Nothing to regenerate: send a message first", severity="warning")
            return
        await self.reply()

    def last_reply(self) -> str | None:
        return next(
            (m.content for m in reversed(self.conv.messages) if m.role == "assistant" and m.content), None
        )

    def action_copy_reply(self) -> None:
        text = self.last_reply()
        if text is None:
            self.notify("No reply to copy yet", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify("Copied the last reply to the clipboard", timeout=2)

    # --- conversations --------------------------------------------------------------
    def save_conversation(self, quiet: bool = False) -> None:
        if not self.conv.messages:
            if not quiet:
                self.notify("Nothing to save yet", severity="warning")
            return
        path = self.store.save(self.conv)
        self.refresh_conversations()
        if not quiet:
            self.notify(f"Saved to {path}", timeout=4)

    def refresh_conversations(self) -> None:
        lv = self.conversation_list
        lv.clear()
        for c in self.store.list():
            when = datetime.fromtimestamp(c.updated).strftime("%b %d %H:%M")
            lv.append(
                ConversationItem(c.id, Label(c.display_title(), markup=False), Label(when, classes="when"))
            )

    async def on_list_view_selected(self, event: ListView.Selected) -> None:
        if isinstance(event.item, ConversationItem) and event.item.conv_id != self.conv.id:
            await self.open_conversation(self.store.load(event.item.conv_id))

    async def open_conversation(self, conv: Conversation) -> None:
        if self.generating:
            self.action_stop()
            await self.workers.wait_for_complete(list(self.workers))
        if self.conv.messages:
            self.store.save(self.conv)
        self.conv = conv
        await self.log_view.remove_children()
        label = conv.model or "Assistant"
        await self.log_view.mount_all(
            MessageView(m.role, m.content, m.meta, label=label if m.role == "assistant" else "")
            for m in conv.messages
        )
        self.log_view.anchor()
        self.last_usage = None
        self.last_prefill = {}
        self._count_context()
        self.refresh_conversations()
        self.refresh_status()
        self.prompt.focus()

    async def action_new_chat(self) -> None:
        await self.open_conversation(
            Conversation(
                system=self.conv.system,
                sampling=self.conv.sampling,
                model=self.backend.name if self.backend else "",
            )
        )

    def action_save(self) -> None:
        self.save_conversation()

    # --- settings ---------------------------------------------------------------------
    def action_pick_model(self) -> None:
        def chosen(spec: str | None) -> None:
            if spec:
                self.load_model(spec)

        current = self.backend.name if self.backend else ""
        self.push_screen(model_picker(self.recent_models, current, self.backend, self.remote), chosen)

    def action_edit_system(self) -> None:
        def chosen(text: str | None) -> None:
            if text is not None:
                self.set_system(text)

        self.push_screen(SystemPromptEditor(self.conv.system), chosen)

    def set_system(self, text: str) -> None:
        self.conv.system = text
        self._count_context()
        self.refresh_status()
        self.notify("System prompt set" if text else "System prompt cleared", timeout=2)

    def action_settings(self) -> None:
        def chosen(sampling) -> None:
            if sampling is not None:
                self.conv.sampling = sampling
                self.notify(sampling.summary(), title="Sampling", timeout=3)

        self.push_screen(SettingsScreen(self.conv.sampling), chosen)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.help_sections()))

    def help_sections(self) -> dict[str, list[tuple[str, str]]]:
        keys = [
            (key_label(b.key), b.tooltip or b.description) for b in self.BINDINGS if isinstance(b, Binding)
        ]
        history = (
            "every line you send is saved in input_history.json in Duet's data directory, for Up/Down "
            "recall in later runs; /clear-history deletes it, /history off or "
            f"{NO_HISTORY_ENV}=1 stops saving it (now: {'on' if self.saves_history else 'off'})"
        )
        files = [
            (
                "Conversations",
                "saved as JSON in Duet's data directory ($DUET_DATA_DIR, or the user data dir)",
            ),
            ("Input history", history),
        ]
        return {
            "Keys": keys + INPUT_KEYS,
            "Slash commands": list(SLASH_COMMANDS.items()),
            "Saved data": files,
        }

    def action_toggle_sidebar(self) -> None:
        shown = self.sidebar.display
        main = self.sidebar.screen
        main.set_class(shown, "-sidebar-off")
        main.set_class(not shown, "-sidebar-on")

    def action_toggle_dark(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    # --- peers and input history (their slash commands: commands.py) ---------------------------
    def refresh_peers(self) -> None:
        """The panel shows once a peer exists (or when /peers asked), with fresh states."""
        self.peer_rows = self.peer_dir.rows(self.backend.peer_sources() if self.backend else ())
        shown = bool(self.peer_rows) if self.peers_shown is None else self.peers_shown
        if shown:
            self.peers_panel.show_rows(self.peer_rows)
        self.peers_panel.display = shown

    @property
    def saves_history(self) -> bool:
        """Whether the input history is kept in input_history.json between runs."""
        return self.preferences.save_input_history and not history_off_by_env()

    # --- status and exit -------------------------------------------------------------------
    def _count_context(self) -> None:
        if self.backend is None:
            return
        msgs = self.conv.chat_messages()
        self.context_used = self.backend.count_tokens(msgs) if msgs else 0

    def refresh_status(self) -> None:
        b = self.backend
        self.status_bar.show(
            b.name if b else ("loading…" if self.loading_row.display else "no model"),
            self.context_used,
            b.context_length if b else None,
            self.last_usage,
            b.resources() if b else None,
            self.live_tps,
            self.last_prefill,
        )
        self.refresh_peers()

    def close_backend(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def on_unmount(self) -> None:
        """However the app ends (Ctrl+C, Ctrl+Q, /quit): save, then stop the engine."""
        if self.conv.messages:
            self.store.save(self.conv)
        if self.saves_history and self.sent:
            self.store.save_history(self.sent)
        self.close_backend()
        self.peer_dir.close()

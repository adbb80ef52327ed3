"""`duet chat`: the Textual chat app.

The model loads in a thread worker (the UI shows progress meanwhile); replies stream
from ``backend.stream`` in an async worker on the app's loop. Esc cancels the request in
the backend at once and cancels the worker, which closes the stream; the worker hands the
loop back after every event, so key presses are handled between tokens however fast they
arrive (text is rendered at most every ``widgets.FLUSH_S``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import aclosing
from datetime import datetime

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Label, ListItem, ListView, ProgressBar, Static

from mlx_engine.errors import DuetError
from mlx_engine.loading.resolve import BUNDLED_NAME
from mlx_engine.request import RequestError, Usage

from .backends import Backend, BackendError
from .model_picker import model_picker
from .peers import PeerDirectory, PeerRow
from .screens import ErrorScreen, HelpScreen, SettingsScreen, SystemPromptEditor
from .settings import ALIASES, FIELDS
from .store import NO_HISTORY_ENV, Conversation, Message, Store, history_off_by_env
from .widgets import MessageView, PeersPanel, PromptInput, StatusBar, usage_line

SLASH_COMMANDS = {
    "/model [name]": "switch model (no name: open the model picker)",
    "/system [text]": "set the system prompt (no text: open the editor)",
    "/temp <t>": "temperature (0 = greedy); also /top_p, /top_k, /min_p, /seed <n|off>",
    "/max <n|auto>": "longest reply in tokens; auto (the default): until the model stops or the context is full",
    "/think on|off|low|medium|high|auto": "ask a thinking model to think or not (its template's switch; "
    "auto: the template's default); t on a reply shows or hides its thinking",
    "/settings": "open the sampling settings",
    "/save [title]": "save the conversation (optionally naming it)",
    "/new": "start a new chat",
    "/regen": "regenerate the last reply",
    "/copy": "copy the last reply",
    "/peers": "show or hide the peers panel (prefill peers, paired and discovered machines); "
    "/peers pair <code> <host[:port]> pairs with the machine showing `duet peer pair`'s code, "
    "/peers unpair <name> forgets one",
    "/clear-history": "delete the saved input history (input_history.json) and forget it",
    "/history on|off": f"save the input history between runs or not (saved; {NO_HISTORY_ENV}=1 also turns it off)",
    "/help": "show this help",
    "/quit": "save and quit",
}

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
            await self.run_command(text)
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
        conv = self.conv
        messages = conv.chat_messages()
        msg = Message("assistant", "")
        conv.messages.append(msg)
        final, meta = None, ""
        n_tokens, t_first = 0, None
        try:
            # aclosing: a cancelled worker closes the stream now (the backend stops the request),
            # not whenever the abandoned generator is collected
            async with aclosing(backend.stream(messages, conv.sampling, self.think)) as events:
                async for ev in events:
                    if ev.reasoning:
                        await view.append_reasoning(ev.reasoning)
                    if ev.text:
                        await view.append(ev.text)  # buffered: rendered at most every FLUSH_S
                        msg.content = view.content
                    n_tokens += len(ev.token_ids) or (
                        1 if ev.text or ev.reasoning else 0
                    )  # remote chunks carry no ids
                    if prompt_tokens is not None:
                        self.context_used = prompt_tokens + n_tokens
                    if n_tokens and t_first is None:
                        t_first = time.perf_counter()
                    elif t_first is not None and n_tokens > 1:
                        self.live_tps = (n_tokens - 1) / max(time.perf_counter() - t_first, 1e-9)
                    if ev.finished:
                        final = ev
                    # Hand the loop back after every event: when the backend is ahead of the UI its
                    # queue never blocks, and a key press (Esc) must not wait for the backlog.
                    await asyncio.sleep(0)
        except RequestError as e:
            meta = f"error: {e}"
        except asyncio.CancelledError:
            meta = "stopped"
            raise
        finally:
            if final is not None:
                self.last_usage = final.usage
                self.last_prefill = (
                    backend.prefill_report(final.usage, final.request_id) if final.usage else {}
                )
                meta = usage_line(final.usage) if final.usage else ""
                if final.finish_reason == "error":
                    meta = f"error: {final.error or 'generation failed'}"
                elif final.finish_reason == "length":
                    meta += " · hit max tokens" if conv.sampling.max_tokens else " · context full"
                elif final.finish_reason == "cancelled":
                    meta = "stopped"
                if final.usage:
                    self.context_used = final.usage.total_tokens
            msg.content, msg.meta = view.content, meta
            await view.finish(meta)
            self.generating = False
            self.live_tps = None
            self.refresh_status()
            if conv is self.conv:
                self.save_conversation(quiet=True)

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

    # --- slash commands -----------------------------------------------------------------
    async def run_command(self, text: str) -> None:
        name, _, arg = text[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ALIASES or name in FIELDS:
            if not arg:
                self.notify(
                    f"/{name} needs a value, e.g. /{name} {self.conv.sampling.shown(ALIASES.get(name, name))}",
                    severity="warning",
                )
                return
            try:
                self.conv.sampling = self.conv.sampling.with_value(name, arg)
            except ValueError as e:
                self.notify(str(e), title="Bad setting", severity="error")
                return
            self.notify(self.conv.sampling.summary(), title="Sampling", timeout=3)
        elif name == "think":
            self.set_think(arg.lower())
        elif name == "model":
            self.load_model(arg) if arg else self.action_pick_model()
        elif name == "system":
            self.set_system(arg) if arg else self.action_edit_system()
        elif name == "settings":
            self.action_settings()
        elif name == "save":
            if arg:
                self.conv.title = arg
            self.save_conversation()
        elif name == "new":
            await self.action_new_chat()
        elif name in ("regen", "regenerate"):
            await self.action_regenerate()
        elif name == "copy":
            self.action_copy_reply()
        elif name == "clear-history":
            self.clear_history()
        elif name == "history":
            self.set_history_saving(arg.lower())
        elif name == "peers":
            self.peers_command(arg)
        elif name == "help":
            self.action_help()
        elif name in ("quit", "exit"):
            self.exit()
        else:
            self.notify(f"Unknown command /{name}; /help lists them", severity="error")

    def set_think(self, arg: str) -> None:
        """``/think``: on, off or a level for the replies from now on (auto: the template's default)."""
        if arg not in ("on", "off", "low", "medium", "high", "auto"):
            self.notify("/think takes on, off, low, medium, high or auto", severity="warning")
            return
        self.think = None if arg == "auto" else arg
        self.notify(f"thinking: {arg}", timeout=3)

    # --- peers ----------------------------------------------------------------------------------
    def peers_command(self, arg: str) -> None:
        """``/peers`` (show or hide the panel), ``/peers pair CODE HOST[:PORT]``, ``/peers unpair NAME``."""
        words = arg.split()
        what = words[0].lower() if words else ""
        if what in ("", "show", "hide"):
            self.peers_shown = {"show": True, "hide": False}.get(what, not self.peers_panel.display)
            self.refresh_peers()
            if self.peers_shown and not self.peer_rows:
                self.notify(
                    "No peers yet: start `duet peer serve` and chat with --peers HOST:PORT, "
                    "or pair with /peers pair CODE HOST",
                    title="Peers",
                    timeout=6,
                )
        elif what == "pair":
            if len(words) != 3:
                self.notify(
                    "Usage: /peers pair NNNN-NNNN HOST[:PORT] (the code `duet peer pair` shows there)",
                    title="Peers",
                    severity="error",
                )
                return
            self.notify(f"Pairing with {words[2]}…", title="Peers", timeout=3)
            self._pair_worker(words[1], words[2])
        elif what == "unpair":
            if len(words) != 2:
                self.notify(
                    "Usage: /peers unpair NAME (the panel lists the names)", title="Peers", severity="error"
                )
                return
            try:
                gone = self.peer_dir.unpair(words[1])
            except DuetError as e:
                self.notify(f"Cannot unpair: {e}", title="Peers", severity="error")
                return
            self.notify(f"Unpaired {gone.name} (id {gone.short_id})", title="Peers", timeout=4)
            self.refresh_peers()
        else:
            self.notify(
                f"Unknown /peers {what}: /peers, /peers pair CODE HOST[:PORT] or /peers unpair NAME",
                title="Peers",
                severity="error",
            )

    @work(thread=True, exclusive=True, group="pair")
    def _pair_worker(self, code: str, target: str) -> None:
        try:
            peer = self.peer_dir.pair(code, target)
        except (DuetError, OSError) as e:
            self.call_from_thread(self.notify, f"Pairing failed: {e}", title="Peers", severity="error")
            return
        self.call_from_thread(self._paired, peer.name, peer.short_id)

    def _paired(self, name: str, short_id: str) -> None:
        self.notify(
            f"Paired with {name} (id {short_id}); `duet chat --peers auto` prefills there when it serves",
            title="Peers",
            timeout=8,
        )
        self.refresh_peers()

    def refresh_peers(self) -> None:
        """The panel shows once a peer exists (or when /peers asked), with fresh states."""
        self.peer_rows = self.peer_dir.rows(self.backend.peer_sources() if self.backend else ())
        shown = bool(self.peer_rows) if self.peers_shown is None else self.peers_shown
        if shown:
            self.peers_panel.show_rows(self.peer_rows)
        self.peers_panel.display = shown

    # --- input history ----------------------------------------------------------------------
    @property
    def saves_history(self) -> bool:
        """Whether the input history is kept in input_history.json between runs."""
        return self.preferences.save_input_history and not history_off_by_env()

    def clear_history(self) -> None:
        deleted = self.store.clear_history()
        self.prompt.forget()
        where = self.store.history_path
        self.notify(f"Deleted {where}" if deleted else "Input history cleared (nothing was saved)", timeout=4)

    def set_history_saving(self, arg: str) -> None:
        if arg not in ("on", "off"):
            now = "on" if self.saves_history else "off"
            self.notify(f"/history on or /history off (saving is {now})", severity="warning")
            return
        self.preferences.save_input_history = arg == "on"
        self.store.save_preferences(self.preferences)
        if arg == "on" and history_off_by_env():
            self.notify(f"{NO_HISTORY_ENV} is set: the input history stays unsaved", severity="warning")
        elif arg == "on":
            self.notify("The input history is saved between runs", timeout=3)
        else:
            self.notify("The input history is no longer saved; /clear-history deletes what was", timeout=4)

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

"""The chat's slash commands (``/temp 0.7``, ``/model NAME``, ``/peers pair CODE HOST``…): what
each one does to the ``ChatApp``, and the help's list of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_engine.errors import DuetError

from .settings import ALIASES, FIELDS
from .store import NO_HISTORY_ENV, history_off_by_env

if TYPE_CHECKING:
    from .app import ChatApp

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


class SlashCommands:
    """Runs one command line typed in the chat's input (``run``)."""

    def __init__(self, app: ChatApp):
        self.app = app

    async def run(self, text: str) -> None:
        app = self.app
        name, _, arg = text[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ALIASES or name in FIELDS:
            self.sampling(name, arg)
        elif name == "think":
            self.think(arg.lower())
        elif name == "model":
            app.load_model(arg) if arg else app.action_pick_model()
        elif name == "system":
            app.set_system(arg) if arg else app.action_edit_system()
        elif name == "settings":
            app.action_settings()
        elif name == "save":
            if arg:
                app.conv.title = arg
            app.save_conversation()
        elif name == "new":
            await app.action_new_chat()
        elif name in ("regen", "regenerate"):
            await app.action_regenerate()
        elif name == "copy":
            app.action_copy_reply()
        elif name == "clear-history":
            self.clear_history()
        elif name == "history":
            self.history(arg.lower())
        elif name == "peers":
            self.peers(arg)
        elif name == "help":
            app.action_help()
        elif name in ("quit", "exit"):
            app.exit()
        else:
            app.notify(f"Unknown command /{name}; /help lists them", severity="error")

    def sampling(self, name: str, arg: str) -> None:
        """``/temp 0.7``, ``/top_p 0.9``…: one sampling setting of the conversation."""
        app = self.app
        if not arg:
            app.notify(
                f"/{name} needs a value, e.g. /{name} {app.conv.sampling.shown(ALIASES.get(name, name))}",
                severity="warning",
            )
            return
        try:
            app.conv.sampling = app.conv.sampling.with_value(name, arg)
        except ValueError as e:
            app.notify(str(e), title="Bad setting", severity="error")
            return
        app.notify(app.conv.sampling.summary(), title="Sampling", timeout=3)

    def think(self, arg: str) -> None:
        """``/think``: on, off or a level for the replies from now on (auto: the template's default)."""
        if arg not in ("on", "off", "low", "medium", "high", "auto"):
            self.app.notify("/think takes on, off, low, medium, high or auto", severity="warning")
            return
        self.app.think = None if arg == "auto" else arg
        self.app.notify(f"thinking: {arg}", timeout=3)

    # --- input history ---------------------------------------------------------------------------
    def clear_history(self) -> None:
        app = self.app
        deleted = app.store.clear_history()
        app.prompt.forget()
        where = app.store.history_path
        app.notify(f"Deleted {where}" if deleted else "Input history cleared (nothing was saved)", timeout=4)

    def history(self, arg: str) -> None:
        app = self.app
        if arg not in ("on", "off"):
            now = "on" if app.saves_history else "off"
            app.notify(f"/history on or /history off (saving is {now})", severity="warning")
            return
        app.preferences.save_input_history = arg == "on"
        app.store.save_preferences(app.preferences)
        if arg == "on" and history_off_by_env():
            app.notify(f"{NO_HISTORY_ENV} is set: the input history stays unsaved", severity="warning")
        elif arg == "on":
            app.notify("The input history is saved between runs", timeout=3)
        else:
            app.notify("The input history is no longer saved; /clear-history deletes what was", timeout=4)

    # --- peers -----------------------------------------------------------------------------------
    def peers(self, arg: str) -> None:
        """``/peers`` (show or hide the panel), ``/peers pair CODE HOST[:PORT]``, ``/peers unpair NAME``."""
        app = self.app
        words = arg.split()
        what = words[0].lower() if words else ""
        if what in ("", "show", "hide"):
            app.peers_shown = {"show": True, "hide": False}.get(what, not app.peers_panel.display)
            app.refresh_peers()
            if app.peers_shown and not app.peer_rows:
                app.notify(
                    "No peers yet: start `duet peer serve` and chat with --peers HOST:PORT, "
                    "or pair with /peers pair CODE HOST",
                    title="Peers",
                    timeout=6,
                )
        elif what == "pair":
            if len(words) != 3:
                app.notify(
                    "Usage: /peers pair NNNN-NNNN HOST[:PORT] (the code `duet peer pair` shows there)",
                    title="Peers",
                    severity="error",
                )
                return
            app.notify(f"Pairing with {words[2]}…", title="Peers", timeout=3)
            code, target = words[1], words[2]
            app.run_worker(lambda: self._pair(code, target), thread=True, exclusive=True, group="pair")
        elif what == "unpair":
            if len(words) != 2:
                app.notify(
                    "Usage: /peers unpair NAME (the panel lists the names)", title="Peers", severity="error"
                )
                return
            try:
                gone = app.peer_dir.unpair(words[1])
            except DuetError as e:
                app.notify(f"Cannot unpair: {e}", title="Peers", severity="error")
                return
            app.notify(f"Unpaired {gone.name} (id {gone.short_id})", title="Peers", timeout=4)
            app.refresh_peers()
        else:
            app.notify(
                f"Unknown /peers {what}: /peers, /peers pair CODE HOST[:PORT] or /peers unpair NAME",
                title="Peers",
                severity="error",
            )

    def _pair(self, code: str, target: str) -> None:
        """In a thread worker: pair (the SPAKE2 exchange and the certificates), then tell the UI."""
        app = self.app
        try:
            peer = app.peer_dir.pair(code, target)
        except (DuetError, OSError) as e:
            app.call_from_thread(app.notify, f"Pairing failed: {e}", title="Peers", severity="error")
            return
        app.call_from_thread(self._paired, peer.name, peer.short_id)

    def _paired(self, name: str, short_id: str) -> None:
        self.app.notify(
            f"Paired with {name} (id {short_id}); `duet chat --peers auto` prefills there when it serves",
            title="Peers",
            timeout=8,
        )
        self.app.refresh_peers()

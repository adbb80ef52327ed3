"""The chat's widgets: messages, the prompt editor, the status bar, the peers panel."""

from __future__ import annotations

import time
from typing import Any

from rich.console import RenderableType
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message as TMessage
from textual.timer import Timer
from textual.widgets import Collapsible, Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownStream

from mlx_engine.request import Usage

from .backends import Resources
from .peers import PeerRow

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
FLUSH_S = 0.1  # streamed text is rendered at most 10 times a second
# Control characters (a model can emit any token) would garble the terminal: show their Unicode pictures.
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(32) if chr(c) not in "\t\n"} | {0x7F: 0x2421}


def printable(text: str) -> str:
    return text.translate(_CONTROL_PICTURES)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def usage_line(u: Usage) -> str:
    parts = [f"{u.prompt_tokens} prompt tok"]
    if u.cached_tokens:
        parts.append(f"{u.cached_tokens} cached")
    parts.append(f"{u.completion_tokens} reply tok")
    if u.reasoning_tokens:
        parts.append(f"{u.reasoning_tokens} thinking")
    if u.ttft_s:
        parts.append(f"TTFT {u.ttft_s * 1000:.0f} ms")
    if u.decode_tps:
        parts.append(f"{u.decode_tps:.1f} tok/s")
    if u.prefill_location not in ("local", "server"):
        parts.append(f"prefill on {u.prefill_location}")
    return " · ".join(parts)


class MessageView(Vertical, can_focus=True):
    """One turn. Assistant replies render as Markdown and can be streamed into."""

    BINDINGS = [Binding("c", "copy", "Copy message"), Binding("t", "toggle_thoughts", "Show/hide thinking")]

    def __init__(self, role: str, content: str = "", meta: str = "", label: str = ""):
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self.meta = meta
        self.label = label or ("You" if role == "user" else "Assistant")
        self._stream: MarkdownStream | None = None
        self._pending = ""
        self._last_flush = 0.0
        self._spinner_timer: Timer | None = None
        self._t0 = 0.0
        self.reasoning = ""  # the reply's thinking, shown apart (dimmed, collapsible)
        self._thoughts: Collapsible | None = None

    def compose(self):
        yield Static(self.label, classes="role", markup=False)
        if self.role == "user":
            yield Static(printable(self.content), classes="body", markup=False)
        else:
            yield Markdown(printable(self.content), classes="body")
        yield Static(self.meta, classes="meta", markup=False)
        yield Static("", classes="thinking", markup=False)

    def on_mount(self) -> None:
        self.query_one(".meta").display = bool(self.meta)
        self.query_one(".thinking").display = False

    # --- streaming ----------------------------------------------------------------
    def start_thinking(self, note: str) -> None:
        """Show a spinner until the first token arrives (prefill)."""
        self._t0 = time.perf_counter()
        self._note = note
        thinking = self.query_one(".thinking", Static)
        thinking.display = True
        self._tick()
        self._spinner_timer = self.set_interval(0.1, self._tick)

    def _tick(self) -> None:
        dt = time.perf_counter() - self._t0
        self.query_one(".thinking", Static).update(
            f"{SPINNER[int(dt * 10) % len(SPINNER)]} {self._note} {dt:.1f}s"
        )

    def stop_thinking(self) -> None:
        if self._spinner_timer is not None:
            self._spinner_timer.stop()
            self._spinner_timer = None
        self.query_one(".thinking").display = False

    async def append_reasoning(self, text: str) -> None:
        """Add streamed thinking: dimmed, in a section of its own that collapses when the answer
        starts (``t`` opens it again)."""
        if not text:
            return
        self.stop_thinking()
        self.reasoning += text
        if self._thoughts is None:
            self._thoughts = Collapsible(
                Static("", classes="reasoning", markup=False),
                title="Thinking",
                collapsed=False,
                classes="thoughts",
            )
            await self.mount(self._thoughts, after=self.query_one(".role"))
        self._thoughts.query_one(".reasoning", Static).update(printable(self.reasoning))
        self._thoughts.title = f"Thinking ({len(self.reasoning.split())} words)"

    def action_toggle_thoughts(self) -> None:
        if self._thoughts is not None:
            self._thoughts.collapsed = not self._thoughts.collapsed

    async def append(self, text: str) -> None:
        """Add streamed text. Markdown is re-rendered at most every FLUSH_S: parsing per token
        would take the GIL from the engine thread and slow decoding down."""
        if not text:
            return
        if self._stream is None:
            self.stop_thinking()
            if self._thoughts is not None:  # the answer has begun: the thinking folds away
                self._thoughts.collapsed = True
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self.content += text
        self._pending += text
        if time.perf_counter() - self._last_flush >= FLUSH_S:
            await self._flush()

    async def _flush(self) -> None:
        if self._pending and self._stream is not None:
            text, self._pending = self._pending, ""
            self._last_flush = time.perf_counter()
            await self._stream.write(printable(text))

    async def finish(self, meta: str) -> None:
        self.stop_thinking()
        if self._stream is not None:
            await self._flush()
            await self._stream.stop()
            self._stream = None
        self.set_meta(meta)

    def set_meta(self, meta: str) -> None:
        self.meta = meta
        line = self.query_one(".meta", Static)
        line.update(meta)
        line.display = bool(meta)
        self.set_class(meta.startswith("error"), "-error")

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.content)
        self.app.notify("Copied the message to the clipboard", timeout=2)


class PromptInput(TextArea):
    """Multi-line editor: Enter sends, Shift+Enter or Ctrl+J adds a line, Up/Down on an
    empty (or just recalled) input walk the input history."""

    class Submitted(TMessage):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, sent: list[str], **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)
        self.sent = sent
        self._pos = len(sent)  # len(sent) = the fresh (unsent) line
        self._recalled: str | None = None

    async def _on_key(self, event) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.clear()  # now, not when the app gets the message: keys typed meanwhile belong to the next one
                self.post_message(self.Submitted(text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def _walking(self) -> bool:
        return self.text == "" or self.text == self._recalled

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self._walking() and self._pos > 0:
            self._pos -= 1
            self._show(self.sent[self._pos])
        else:
            super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if not select and self._recalled is not None and self._walking():
            self._pos = min(self._pos + 1, len(self.sent))
            self._show(self.sent[self._pos] if self._pos < len(self.sent) else "")
        else:
            super().action_cursor_down(select)

    def _show(self, text: str) -> None:
        self._recalled = text or None
        self.load_text(text)
        self.move_cursor(self.document.end)

    def remember(self, text: str) -> None:
        if text and (not self.sent or self.sent[-1] != text):
            self.sent.append(text)
        self._pos = len(self.sent)
        self._recalled = None

    def forget(self) -> None:
        """Drop every remembered line (``/clear-history``)."""
        self.sent.clear()
        self._pos = 0
        self._recalled = None


def seconds(s: float) -> str:
    """0.052 -> "52ms", 1.234 -> "1.23s"."""
    return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s"


def plan_of(report: dict[str, Any]) -> dict[str, Any] | None:
    """The offload planner's decision for the request (``plan`` in the prefill report: one dict, or
    a list with one per peer, of which the one for the peer that prefilled, else the first)."""
    plan = report.get("plan")
    if isinstance(plan, list):
        taken = [p for p in plan if isinstance(p, dict) and p.get("offload")]
        plan = (taken or plan or [None])[0]
    return plan if isinstance(plan, dict) else None


def planned(plan: dict[str, Any], where: str) -> tuple[float | None, list[str]]:
    """The planner's predicted time to first token for the path taken (``where`` the prefill ran),
    and tooltip lines: its choice and reason, both predictions and the measured time."""
    side = "remote" if where.startswith("remote:") else "local"
    num = (int, float)
    predicted = plan.get(f"predicted_{side}_ttft_s")
    lines = [f"planner: {'offload' if plan.get('offload') else 'prefill here'} ({plan.get('reason') or '-'})"]
    guesses = [
        f"{name} {seconds(v)}"
        for name in ("local", "remote")
        if isinstance(v := plan.get(f"predicted_{name}_ttft_s"), num)
    ]
    if guesses:
        measured = plan.get("measured_ttft_s")
        lines.append(
            "predicted TTFT: "
            + ", ".join(guesses)
            + (f"; measured {seconds(measured)}" if isinstance(measured, num) else "")
        )
    return (float(predicted) if isinstance(predicted, num) else None), lines


def prefill_summary(usage: Usage, report: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """Where the last prefill ran and its timings, for the status bar: a short part
    (``prefill remote:gpu 310ms (wait 120ms, xfer 180ms, plan 300ms)``) and detail lines for its tooltip.
    ``report``: the backend's prefill report (``duet generate --json``'s remote-prefill usage)."""
    report = report or {}
    where = usage.prefill_location
    short = f"prefill {where}"
    detail = [f"prefill ran on: {where}"]
    if usage.ttft_s:
        short += f" {seconds(usage.ttft_s)}"
        detail.append(f"time to first token: {seconds(usage.ttft_s)}")
    if usage.prefill_tps and where == "local":
        detail.append(f"local prefill: {usage.prefill_tps:,.0f} tok/s")
    split = []
    loads = [x for x in report.get("remote_loads") or () if x.get("outcome") == "done"]
    if where.startswith("remote:"):
        wait = sum(x.get("wait_s") or 0.0 for x in loads) if loads else usage.remote_wait_s
        xfer = sum(x.get("transfer_s") or 0.0 for x in loads)
        split.append(f"wait {seconds(wait)}")
        if loads:
            split.append(f"xfer {seconds(xfer)}")
        detail.append(
            f"remote: {usage.remote_tokens:,} tokens, {human_bytes(usage.remote_bytes)} of KV; waited "
            f"{seconds(wait)} for the first layer"
            + (f", then {seconds(xfer)} of streaming" if loads else "")
            + (f"; the peer computed for {seconds(usage.remote_compute_s)}" if usage.remote_compute_s else "")
        )
    plan = plan_of(report)
    if plan is not None:
        predicted, lines = planned(plan, where)
        if predicted is not None:
            split.append(f"plan {seconds(predicted)}")
        detail += lines
    fallback = report.get("fallback_reason") or usage.fallback_reason
    if fallback:
        split.append("fell back")
        detail.append(f"fallback: {fallback}")
    if split:
        short += f" ({', '.join(split)})"
    return short, detail


class StatusBar(Static):
    """model · context used/max · where the last prefill ran and its timings · tok/s · prefix-cache
    hits · KV memory. Its tooltip has the details (backend, prefill split, fallback reason)."""

    def show(
        self,
        model: str,
        context_used: int | None,
        context_max: int | None,
        usage: Usage | None,
        res: Resources | None,
        live_tps: float | None = None,
        prefill_report: dict[str, Any] | None = None,
    ) -> None:
        parts = [model or "no model"]
        ctx_max = f"{context_max:,}" if context_max else "?"
        parts.append(f"ctx {context_used if context_used is not None else '-'}/{ctx_max}")
        detail = [res.detail] if res is not None and res.detail else []
        if usage is not None:
            short, lines = prefill_summary(usage, prefill_report)
            parts.append(short)
            detail += lines
        tps = live_tps if live_tps is not None else (usage.decode_tps if usage else 0.0)
        if tps:
            parts.append(f"{tps:.1f} tok/s")
        if res is not None and res.prefix_hit_rate is not None:
            parts.append(f"cache {res.prefix_hit_rate * 100:.0f}%")
        if res is not None and res.kv_total_bytes:
            parts.append(f"KV {human_bytes(res.kv_used_bytes or 0)}/{human_bytes(res.kv_total_bytes)}")
        self.update(" │ ".join(parts))
        self.tooltip = "\n".join(detail) or None


class PeersPanel(Static):
    """The peers panel: one line per machine (name, address, backend, state, pairing, prefill rate).
    Hidden until a peer exists; ``/peers`` shows or hides it."""

    body: RenderableType = ""  # what it shows now (a rich Table, or a line when there are no peers)

    def show_rows(self, rows: list[PeerRow]) -> None:
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, show_header=True, header_style="bold", padding=(0, 2, 0, 0), expand=True)
        for col in ("peer", "address", "backend", "state", "pairing", "prefill"):
            table.add_column(col, no_wrap=True, overflow="ellipsis")
        for r in rows:
            state = Text(
                ("● " if r.healthy else "○ ") + r.state,
                style="green" if r.healthy else "red" if r.attached else "",
            )
            if r.prefill_tps:
                rate = f"{r.prefill_tps:,.0f} tok/s" + ("" if r.measured else " (adv.)")
            else:
                rate = "-"
            table.add_row(
                Text(r.name), Text(r.address or "-"), Text(r.backend or "-"), state, r.pairing, rate
            )
        self.body = table if rows else Text("No peers yet: `duet peer serve` there, then --peers HOST:PORT")
        self.update(self.body)
        self.border_title = "Peers"
        self.border_subtitle = "/peers hides · /peers pair CODE HOST · /peers unpair NAME"
        errors = [f"{r.name}: {r.error}" for r in rows if r.error]
        self.tooltip = "\n".join(errors) or None

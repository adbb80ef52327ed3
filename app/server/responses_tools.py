"""The tools of a Responses request, as the chat call offers them to the model.

- ``function`` tools are the chat's function tools.
- ``namespace`` tools (Codex's ``{"type": "namespace", "name": "multi_agent_v1", "tools": [...]}``)
  are flattened: each function inside becomes a function tool the model sees under its own
  name (``namespace.name`` where two namespaces, or a namespace and a top-level tool, share a
  name), its description led by the namespace's. A call the model makes to one comes back as a
  ``function_call`` item with the function's ``name`` and its ``namespace``, as OpenAI's API
  answers and Codex reads; a ``function_call`` input item that names a ``namespace`` is mapped to
  the flattened name again, so the model reads its own earlier calls as it wrote them.
- Hosted tools a local server cannot run (``web_search``, ``file_search``, ``code_interpreter``,
  ``computer_use``, ``image_generation``, remote ``mcp``, ...) are left out of what the model sees,
  with a warning in the log the first time: clients such as Codex send them by default, and a
  400 would break their first request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .common import warn_once
from .errors import bad_request
from .responses_protocol import ToolDef


def _hosted(kind: str) -> None:
    warn_once(
        f"responses-tool:{kind}",
        f"responses: {kind} tools are hosted tools this server cannot run: not offered to the model",
    )


def _function(name: str, t: ToolDef | dict[str, Any], where: str, lead: str = "") -> dict[str, Any]:
    get = t.get if isinstance(t, dict) else lambda k: getattr(t, k, None)
    description = get("description")
    if lead:
        description = f"{lead} {description}" if description else lead
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    if get("parameters"):
        fn["parameters"] = get("parameters")
    if get("strict") is not None:
        fn["strict"] = get("strict")
    return {"type": "function", "function": fn}


@dataclass
class ResponseTools:
    """The chat tools of a request and the names that map between what the model calls and what
    the client declared."""

    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    # the name the model sees -> (namespace or None, the function's own name)
    declared: dict[str, tuple[str | None, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: list[ToolDef] | None) -> ResponseTools:
        out = cls()
        top = {t.name for t in tools or [] if t.type == "function" and t.name}
        seen: dict[str, int] = {}  # function names in namespaces, counted: collisions get qualified
        for t in tools or []:
            if t.type == "namespace":
                for inner in (t.model_extra or {}).get("tools") or []:
                    if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                        seen[inner["name"]] = seen.get(inner["name"], 0) + 1
        for i, t in enumerate(tools or []):
            where = f"tools[{i}]"
            if t.type == "function":
                if not t.name:
                    raise bad_request("a function tool needs a name", f"{where}.name")
                out._add(t.name, None, t.name, _function(t.name, t, where))
            elif t.type == "namespace":
                out._add_namespace(t, where, top, seen)
            else:
                _hosted(t.type)
        return out

    def _add(self, flat: str, namespace: str | None, name: str, tool: dict[str, Any]) -> None:
        self.declared[flat] = (namespace, name)
        self.chat_tools.append(tool)

    def _add_namespace(self, t: ToolDef, where: str, top: set[str], seen: dict[str, int]) -> None:
        if not t.name:
            raise bad_request("a namespace tool needs a name", f"{where}.name")
        inner_tools = (t.model_extra or {}).get("tools")
        if not isinstance(inner_tools, list):
            raise bad_request("a namespace tool needs a list of tools", f"{where}.tools")
        lead = f"[{t.name}: {t.description}]" if t.description else f"[{t.name}]"
        for j, inner in enumerate(inner_tools):
            at = f"{where}.tools[{j}]"
            if not isinstance(inner, dict) or not isinstance(inner.get("name"), str) or not inner["name"]:
                raise bad_request("each tool in a namespace needs a name", at)
            if inner.get("type", "function") != "function":
                _hosted(str(inner.get("type")))
                continue
            name = inner["name"]
            clash = name in top or seen.get(name, 0) > 1
            flat = f"{t.name}.{name}" if clash else name
            self._add(flat, t.name, name, _function(flat, inner, at, lead))

    def call_fields(self, flat: str) -> dict[str, Any]:
        """What a ``function_call`` item says of a call the model made to ``flat``: its ``name``,
        and its ``namespace`` for a function declared in one."""
        namespace, name = self.declared.get(flat, (None, flat))
        return {"name": name, "namespace": namespace} if namespace else {"name": flat}

    def flat_name(self, name: str, namespace: str | None) -> str:
        """The name the model sees for a client's ``(namespace, name)``."""
        if namespace is None:
            return name
        for flat, declared in self.declared.items():
            if declared == (namespace, name):
                return flat
        return name  # a namespace this request does not declare: the name the model most likely saw

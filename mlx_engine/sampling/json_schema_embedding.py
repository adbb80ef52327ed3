"""Put several JSON schemas inside one wrapper schema without breaking their ``$ref``s.

A schema's references (``#/$defs/X``, ``#/definitions/X``, ``#`` for itself, any other ``#/...``
pointer) resolve against its own root. Placed inside another schema, as a tool's ``parameters``
become the ``arguments`` of the tool-call grammar's wrapper, they would resolve against the
wrapper: ``Pointer '/$defs/Address' does not exist``, or ``#`` silently meaning the wrapper.
Pydantic writes such references for every nested model, so this is the common case.

``embed_schemas`` moves each schema's ``$defs`` and ``definitions`` into one ``$defs`` for the
wrapper's root, under new names unique across the schemas (two tools may both define
``Address``), and rewrites every reference to match. A schema that points into itself other than
through its definitions (recursion through ``#``, or ``#/properties/...``) becomes a definition
too, and is embedded as a reference to it.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

# keywords whose value is instance data, not a schema: a "$ref" inside them is not a reference
_DATA = frozenset({"const", "enum", "default", "examples", "example"})
# keywords whose value maps names (property names...) to schemas
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DEFS = ("$defs", "definitions")


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return unquote(token).replace("~1", "/").replace("~0", "~")


class _Names:
    """Unique definition names for the wrapper, made of characters no pointer needs to escape."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def new(self, base: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", base) or "_"
        name, k = base, 1
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name


class _Embedding:
    """One schema being embedded: its definitions' new names and, if needed, its own."""

    def __init__(self, schema: dict, prefix: str, names: _Names):
        self.prefix, self.names = prefix, names
        self.renamed: dict[tuple[str, str], str] = {}
        for kind in _DEFS:
            defs = schema.get(kind)
            if isinstance(defs, dict):
                for d in defs:
                    self.renamed[(kind, d)] = names.new(f"{prefix}.{d}")
        self.root: str | None = None  # the schema's own name, once something refers to it

    def _root_name(self) -> str:
        if self.root is None:
            self.root = self.names.new(self.prefix)
        return self.root

    def ref(self, ref: str) -> str:
        if not ref.startswith("#"):
            return ref  # another document: left for the grammar compiler to judge
        pointer = ref[1:]
        if pointer in ("", "/"):
            return "#/$defs/" + self._root_name()
        if not pointer.startswith("/"):
            return ref  # a named anchor ("#foo"), which moves with its subschema
        tokens = [_unescape(t) for t in pointer[1:].split("/")]
        if len(tokens) >= 2 and (tokens[0], tokens[1]) in self.renamed:
            tokens = ["$defs", self.renamed[(tokens[0], tokens[1])], *tokens[2:]]
        else:
            tokens = ["$defs", self._root_name(), *tokens]
        return "#/" + "/".join(_escape(t) for t in tokens)

    def rewrite(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                out[k] = self.ref(v)
            elif k in _DATA:
                out[k] = v
            elif k in _NAMED and isinstance(v, dict):
                out[k] = {name: self.rewrite(s) for name, s in v.items()}
            else:
                out[k] = self.rewrite(v)
        return out


def embed_schemas(schemas: list[Any], prefixes: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """``schemas`` rewritten to sit anywhere inside one wrapper, and the ``$defs`` for its root.

    ``prefixes`` (one per schema, e.g. the tool names) start the new definition names.
    """
    names = _Names()
    out: list[Any] = []
    defs: dict[str, Any] = {}
    for schema, prefix in zip(schemas, prefixes, strict=True):
        if not isinstance(schema, dict):  # true / false
            out.append(schema)
            continue
        e = _Embedding(schema, prefix, names)
        for (kind, d), new in e.renamed.items():
            defs[new] = e.rewrite(schema[kind][d])
        # the root's own definitions are hoisted; $id and $schema would re-base the references
        body = e.rewrite({k: v for k, v in schema.items() if k not in (*_DEFS, "$id", "$schema")})
        if e.root is not None:
            defs[e.root] = body
            body = {"$ref": "#/$defs/" + e.root}
        out.append(body)
    return out, defs

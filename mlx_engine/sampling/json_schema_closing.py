"""Close the objects of a JSON schema before it becomes a grammar: only declared properties.

In JSON Schema an object that lists ``properties`` but says nothing of ``additionalProperties``
also allows any other key. Held to such a schema, a small model invents keys until max_tokens
(SmolLM2 copies the schema's own ``title`` and ``type`` into its answer, again and again), and
pydantic's ``model_json_schema()`` (instructor, LangChain, the Agents SDK...) never says
``additionalProperties``. So objects that declare properties and leave additional ones
unspecified get ``additionalProperties: false``, as vLLM's and SGLang's grammar back end does by
default (xgrammar's ``strict_mode``). Every output is still valid against the client's schema:
the grammar allows a subset of it.

Left open: objects that declare no properties (a free-form map) or say anything about extra keys
(``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``), and branches that
are combined with others (``allOf`` with several members, ``not``, ``if``/``then``/``else``,
``dependentSchemas``). A schema where some object declares properties beside ``allOf``,
``anyOf``, ``$ref``, ``if``... is left as it is altogether: closing one part could exclude keys
another part requires. (Pydantic writes neither.)
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# beside "properties", these may declare more keys of the same object
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "dependentSchemas")
# keywords whose value maps names to subschemas, and those whose value is a subschema or a list
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _subschemas(schema: dict):
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            yield from schema[key].values()
    for key in _SUBSCHEMAS:
        if key in schema:
            yield schema[key]
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            yield from schema[key]


def _combines_properties(schema: Any) -> bool:
    """Whether some object of the schema has properties declared beside its own ``properties``
    (by ``allOf``, ``$ref``...): closing either part could then exclude the other's keys."""
    stack = [schema]
    while stack:
        s = stack.pop()
        if not isinstance(s, dict):
            continue
        if "properties" in s and any(k in s for k in _COMPOSED):
            return True
        stack.extend(_subschemas(s))
    return False


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose objects allow only their declared properties (see above)."""
    if _combines_properties(schema):
        return schema
    return _close(schema)


def _close(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s) for name, s in out[key].items()}
    for key in ("items", "additionalItems", "contains"):
        if key in out:
            out[key] = _close(out[key])
    for key in ("anyOf", "oneOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [_close(s) for s in out[key]]
    if isinstance(out.get("allOf"), list) and len(out["allOf"]) == 1:
        out["allOf"] = [_close(out["allOf"][0])]
    return out

"""close_objects: the objects of a schema take only their declared properties, where that cannot
exclude an instance some other part of the schema requires."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import BaseModel

from mlx_engine.sampling.json_schema_closing import close_objects


class Address(BaseModel):
    city: str


class Person(BaseModel):  # pydantic never writes additionalProperties
    name: str
    homes: list[Address]
    extra: dict[str, int] = {}


def test_pydantic_models_are_closed_at_every_level():
    schema = Person.model_json_schema()
    closed = close_objects(schema)
    good = {"name": "Ann", "homes": [{"city": "Oslo"}], "extra": {"any": 1}}
    jsonschema.validate(good, closed)
    for bad in (
        {**good, "title": "Person"},  # what a small model copies from the schema
        {**good, "homes": [{"city": "Oslo", "type": "object"}]},  # inside a $defs entry
    ):
        jsonschema.validate(bad, schema)  # allowed by the client's own schema...
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, closed)  # ...but never generated
    assert closed["properties"]["extra"]["additionalProperties"] == {"type": "integer"}  # a map stays a map
    assert schema == Person.model_json_schema()  # the client's schema is not modified


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # no properties: free-form
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        {"type": "object", "properties": {"a": {}}, "allOf": [{"properties": {"b": {}}}]},
        {"type": "object", "properties": {"a": {}}, "$ref": "#/$defs/B", "$defs": {"B": {"type": "object"}}},
        {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},  # closing one excludes the other
        {"not": {"properties": {"a": {}}}},
        {"const": {"properties": {"a": {}}}},  # data, not a schema
    ],
)
def test_left_open_where_closing_could_exclude_valid_instances(schema):
    assert close_objects(schema) == schema


def test_alternatives_items_and_definitions_are_closed():
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {
        "anyOf": [obj, {"type": "array", "items": obj, "prefixItems": [obj]}],
        "$defs": {"D": obj},
        "allOf": [{"properties": {"properties": obj}}],  # one member; a property named "properties"
    }
    closed = close_objects(schema)
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert closed["anyOf"][1]["items"]["additionalProperties"] is False
    assert closed["anyOf"][1]["prefixItems"][0]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert closed["allOf"][0]["properties"]["properties"]["additionalProperties"] is False

"""`duet serve` with no --model: the bundled SmolLM2-135M GGUF answers through the openai SDK.

Its chat template knows nothing of tools, so this also covers the server's own tools prompt.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.test_server_harness import ServerProcess

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    srv = ServerProcess(None, tmp_path_factory.mktemp("serve-bundled") / "server.log", "--cache-gb", "0.1")
    yield openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)
    srv.stop()


def test_bundled_model_answers(client):
    assert client.models.list().data[0].id == "SmolLM2-135M-Instruct-Q4_1"
    r = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=16,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


def test_bundled_model_json_schema_and_forced_tool_call(client):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct-Q4_1",
        temperature=0,
        max_tokens=40,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    t = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    (call,) = t.choices[0].message.tool_calls
    assert t.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


class Address(BaseModel):  # as instructor and most frameworks declare models: nested, open objects
    city: str
    country: str


class Person(BaseModel):
    name: str
    age: int
    address: Address


def test_bundled_model_fills_nested_pydantic_models(client):
    """instructor's TOOLS mode (a named tool whose parameters hold $defs) and the SDK's parse()."""
    messages = [{"role": "user", "content": "Marie Curie was 66 and lived in Warsaw, Poland."}]
    tool = {"type": "function", "function": {"name": "Person", "parameters": Person.model_json_schema()}}
    r = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=100,
        messages=messages,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Person"}},
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    person = Person.model_validate_json(call.function.arguments)
    assert "Curie" in person.name and set(json.loads(call.function.arguments)) == {"name", "age", "address"}
    parsed = client.chat.completions.parse(
        model="default", temperature=0, max_tokens=100, messages=messages, response_format=Person
    )
    assert "Curie" in parsed.choices[0].message.parsed.name

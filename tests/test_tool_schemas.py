"""A resources server's tools as Responses function tools, from OpenAPI documents of the shapes
FastAPI writes for NeMo Gym's pydantic models (bridge/nemo_gym/tool_schemas.py): a body by
`$ref`, models inside models, a model that refers to itself, a route without a body."""

from __future__ import annotations

import json

from nemo_gym_grpc.bridge.nemo_gym import capabilities
from nemo_gym_grpc.bridge.nemo_gym.tool_schemas import function_tool, parameters


def body(ref: str) -> dict:
    return {"requestBody": {"content": {"application/json": {"schema": {"$ref": ref}}}}}


SCHEMAS = {
    "WeatherRequest": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "when": {"$ref": "#/components/schemas/Day"}},
        "required": ["city"],
    },
    "Day": {"type": "object", "properties": {"offset": {"type": "integer"}}},
    "Tree": {
        "type": "object",
        "properties": {
            "children": {"type": "array", "items": {"$ref": "#/components/schemas/Tree"}}
        },
    },
}
DOC = {
    "paths": {
        "/get_weather": {"post": {**body("#/components/schemas/WeatherRequest"), "summary": "S"}},
        "/grow": {"post": {**body("#/components/schemas/Tree"), "description": "Grow a tree."}},
        "/ping": {"post": {"summary": "Ping"}},
        "/{path}": {"post": {"summary": "Route To Python Function"}},
        "/verify": {"post": body("#/components/schemas/BaseVerifyRequest")},
    },
    "components": {"schemas": SCHEMAS},
}


def test_a_body_by_ref_is_inlined_and_what_it_refers_to_goes_under_defs():
    tool = function_tool("get_weather", DOC["paths"]["/get_weather"]["post"], DOC)
    assert tool == {
        "type": "function",
        "name": "get_weather",
        "description": "S",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "when": {"$ref": "#/$defs/Day"}},
            "required": ["city"],
            "$defs": {"Day": SCHEMAS["Day"]},
        },
        "strict": False,
    }


def test_a_model_that_refers_to_itself_stays_finite():
    schema = parameters({"$ref": "#/components/schemas/Tree"}, DOC)
    assert schema["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}
    assert schema["$defs"]["Tree"]["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}
    assert json.loads(json.dumps(schema)) == schema


def test_a_route_without_a_body_takes_an_empty_object_and_a_missing_schema_is_open():
    assert function_tool("ping", {"summary": "Ping"}, DOC)["parameters"] == {
        "type": "object",
        "properties": {},
    }
    missing = parameters(
        {"type": "object", "properties": {"x": {"$ref": "#/components/schemas/Gone"}}}, DOC
    )
    assert missing["$defs"] == {"Gone": {}}


def test_the_capabilities_list_each_tool_with_its_function_tool_in_the_same_order():
    caps = capabilities.read_openapi(DOC)
    assert caps.tools == ("get_weather", "grow", "ping")
    assert [json.loads(t)["name"] for t in caps.function_tools] == list(caps.tools)
    assert json.loads(caps.function_tools[1])["description"] == "Grow a tree."

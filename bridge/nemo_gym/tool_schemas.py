"""A resources server's tools as OpenAI Responses function tools, read from its OpenAPI document.

NeMo Gym serves each tool as `POST /<name>` taking a pydantic body; FastAPI's `/openapi.json`
gives that body's JSON schema (by `$ref` into `components.schemas`) and the handler's docstring
as the route's `description`. NeMo Gym 0.7 can also advertise the same routes over MCP
(`expose_tools_over_mcp: true`, nemo_gym/mcp_auto_exposure.py: its `/mcp` tools run the route's
own handler), and the rows of such a server may carry no tools at all (example_mcp_weather's
have `"tools": []`: its agent lists them over MCP). A trainer that drives the model itself gets
them here instead, in the shape a row's `responses_create_params.tools` holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COMPONENTS = "#/components/schemas/"
DEFS = "#/$defs/"
EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def function_tool(name: str, post: Mapping[str, Any], doc: Mapping[str, Any]) -> dict[str, Any]:
    """The Responses function tool of route `POST /<name>` (`post`: its OpenAPI operation; `doc`:
    the whole document): {"type": "function", "name", "description" (the operation's
    description, else its summary), "parameters" (the request body's JSON schema, the schemas
    it refers to under "$defs"), "strict": False}. A route without a JSON body takes `{}`."""
    body = dig(post, "requestBody", "content", "application/json", "schema")
    description = post.get("description") or post.get("summary") or ""
    return {
        "type": "function",
        "name": name,
        "description": str(description),
        "parameters": parameters(body, doc) if isinstance(body, Mapping) else dict(EMPTY_OBJECT),
        "strict": False,
    }


def parameters(schema: Mapping[str, Any], doc: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` made self-contained: a top-level `$ref` replaced by its target, every other
    `#/components/schemas/X` pointed at `#/$defs/X` and X copied there (with what X refers to,
    so recursive models stay finite). A reference to a schema the document lacks becomes `{}`."""
    components = dig(doc, "components", "schemas")
    components = components if isinstance(components, Mapping) else {}
    top = dict(_target(schema, components) or schema)
    defs: dict[str, Any] = {}
    pending = list(refs(top))
    result: dict[str, Any] = _rewrite(top)
    while pending:
        name = pending.pop()
        if name in defs:
            continue
        found = components.get(name)
        defs[name] = _rewrite(found) if isinstance(found, Mapping) else {}
        pending.extend(refs(found))
    if defs:
        result["$defs"] = defs
    return result


def _target(schema: Mapping[str, Any], components: Mapping[str, Any]) -> Mapping[str, Any] | None:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith(COMPONENTS):
        found = components.get(ref[len(COMPONENTS) :])
        return found if isinstance(found, Mapping) else None
    return None


def _rewrite(value: Any) -> Any:
    """`value` copied, its component `$ref`s pointed at `$defs`."""
    if isinstance(value, Mapping):
        return {
            key: DEFS + item[len(COMPONENTS) :]
            if key == "$ref" and isinstance(item, str) and item.startswith(COMPONENTS)
            else _rewrite(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_rewrite(item) for item in value]
    return value


def refs(value: Any) -> list[str]:
    """The schema names of every `$ref` under `value` into `components.schemas`, in order
    ("#/components/schemas/X" -> "X")."""
    if isinstance(value, Mapping):
        found = []
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str) and item.startswith(COMPONENTS):
                found.append(item[len(COMPONENTS) :])
            else:
                found.extend(refs(item))
        return found
    if isinstance(value, list):
        return [name for item in value for name in refs(item)]
    return []


def dig(value: Any, *keys: str) -> Any:
    """`value[k1][k2]...`, or None where a level is missing or not a mapping."""
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value

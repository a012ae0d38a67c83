"""The OpenAPI document the API serves: FastAPI's, corrected where FastAPI's defaults do not
match what this API answers:

- FastAPI adds a 422 with its `HTTPValidationError` body to every route with parameters; this
  API never sends that body: each route documents its own error statuses with
  `errors.ErrorResponse` (validation errors are 422 on the jobs API, 400 on the OpenAI routes).
- FastAPI documents a route's error responses in the route's own media type; errors are JSON
  also where success is not (the SSE stream).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

_SCHEMAS = "#/components/schemas/"
_DEFAULT_SCHEMAS = ("HTTPValidationError", "ValidationError")
_JSON = "application/json"


def install_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        return corrected(generate())

    app.openapi = openapi  # type: ignore[method-assign]


def corrected(schema: dict[str, Any]) -> dict[str, Any]:
    """The document with both corrections (made in place; idempotent)."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            for status, response in list(responses.items()):
                content = response.get("content", {})
                refs = {
                    media: body.get("schema", {}).get("$ref") for media, body in content.items()
                }
                if status == "422" and refs.get(_JSON) == _SCHEMAS + "HTTPValidationError":
                    del responses[status]
                elif int(status) >= 400 and _JSON not in content and len(content) == 1:
                    response["content"] = {_JSON: next(iter(content.values()))}
    components = schema.get("components", {}).get("schemas", {})
    for name in _DEFAULT_SCHEMAS:
        components.pop(name, None)
    return schema

"""JSON schemas of the shapes backends ask for: nested objects, arrays, enums, bounded numbers,
required fields, strings with patterns."""

from __future__ import annotations

from typing import Any

_STR = {"type": "string", "maxLength": 24}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}}),
    _obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}}),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"user": _obj({"id": {"type": "integer"}, "email": _STR})}),
    _obj({"ok": {"type": "boolean"}, "reason": _STR}, required=["ok"]),
    _obj({"points": {"type": "array", "items": _obj({"x": {"type": "integer"}}), "maxItems": 3}}),
    _obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    _obj({"title": _STR, "author": _obj({"first": _STR, "last": _STR})}),
    _obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "maxItems": 2}}),
    _obj({"level": {"enum": [1, 2, 3]}, "label": {"const": "level"}}),
    _obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}, "currency": {"enum": ["USD", "EUR"]}}),
    _obj({"answer": {"type": "string", "pattern": "^(yes|no)$"}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
    _obj({"items": {"type": "array", "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 5}}), "minItems": 1, "maxItems": 2}}),
    _obj({"id": {"type": "integer", "minimum": 1000, "maximum": 9999}, "active": {"type": "boolean"}, "nickname": {"type": ["string", "null"], "maxLength": 16}}),
    _obj({"city": _STR, "coords": _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}})}),
    _obj({"steps": {"type": "array", "items": {"enum": ["mix", "bake", "serve"]}, "maxItems": 4}, "minutes": {"type": "integer", "minimum": 5, "maximum": 90}}),
    _obj({"language": {"enum": ["python", "rust", "go"]}, "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+$"}, "stable": {"type": "boolean"}}, required=["language", "version"]),
]  # fmt: skip

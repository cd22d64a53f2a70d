"""JSON schemas of every kind a structured-output test asks for: nested objects, arrays,
enums, numbers with ranges, required fields, additionalProperties false. Strings and
arrays are bounded, and fractions are multiples of 0.25 (exact in binary, as jsonschema
checks them), so that a small model's answer ends within a test's max_tokens (its digits
or letters could otherwise run on)."""

from __future__ import annotations

SHORT = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict] = [  # type: ignore[type-arg]
    {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "multipleOf": 0.25,
     "minimum": 0, "maximum": 1}}, "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "email": SHORT}, "required": ["id", "email"],
        "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["ok", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
     "unit": {"const": "kg"}}, "required": ["n", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"city": SHORT, "zip": {"type": "string",
     "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": SHORT, "qty": {"type": "integer",
        "minimum": 1, "maximum": 99}}, "required": ["sku", "qty"],
        "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"v": SHORT},
               "required": ["v"], "additionalProperties": False}]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
     "labels": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
     "required": ["level", "labels"], "additionalProperties": False},
    {"type": "object", "properties": {"title": SHORT, "year": {"type": "integer",
     "minimum": 1900, "maximum": 2030}}, "required": ["title", "year"],
     "additionalProperties": False},
    {"type": "string", "enum": ["small", "medium", "large"]},
    {"type": "object", "properties": {
        "lat": {"type": "number", "multipleOf": 0.25, "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "multipleOf": 0.25, "minimum": -180, "maximum": 180}},
     "required": ["lat", "lon"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "items": SHORT,
     "minItems": 1, "maxItems": 3}, "done": {"type": "boolean"}},
     "required": ["steps", "done"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"],
        "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
     "required": ["a"], "additionalProperties": False},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["A", "B", "C", "D"]},
     "confidence": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"name": SHORT, "nickname": {"type": ["string", "null"],
     "maxLength": 8}}, "required": ["name", "nickname"], "additionalProperties": False},
]  # fmt: skip

"""Thirty JSON schemas of increasing difficulty, each with one valid instance: what the
structured-output tests and ``benchmarks/structured_output.py`` run (flat objects, numbers
with bounds, enums, arrays with bounds, nesting, ``anyOf``/``oneOf``, ``$ref`` and recursion,
string formats and patterns, tuples, nullable fields, a Pydantic model's schema)."""

from __future__ import annotations

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}

SCHEMAS: list[tuple[str, dict, object]] = [
    ("string field", {"type": "object", "properties": {"name": {"type": "string"}},
                      "required": ["name"]}, {"name": "Ada"}),
    ("integer and boolean", {"type": "object", "properties": {
        "count": {"type": "integer"}, "done": {"type": "boolean"}},
        "required": ["count", "done"]}, {"count": 3, "done": False}),
    ("number", {"type": "object", "properties": {"price": {"type": "number"}},
                "required": ["price"]}, {"price": 9.5}),
    ("enum", {"type": "object", "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"]}, {"colour": "green"}),
    ("const", {"type": "object", "properties": {"kind": {"const": "point"},
                                                "x": {"type": "integer"}},
               "required": ["kind", "x"]}, {"kind": "point", "x": 1}),
    ("array of strings", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["tags"]},
        {"tags": ["a", "b"]}),
    ("array with bounds", {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                   "maxItems": 4}}, "required": ["scores"]}, {"scores": [1, 2, 3]}),
    ("integer bounds", {"type": "object", "properties": {
        "month": {"type": "integer", "minimum": 1, "maximum": 12}}, "required": ["month"]},
        {"month": 7}),
    ("string length", {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 5}}, "required": ["code"]},
        {"code": "ab1"}),
    ("optional fields", {"type": "object", "properties": {
        "title": {"type": "string"}, "subtitle": {"type": "string"},
        "pages": {"type": "integer"}}, "required": ["title"]}, {"title": "Dune"}),
    ("nested object", {"type": "object", "properties": {
        "author": PERSON, "year": {"type": "integer"}}, "required": ["author", "year"]},
        {"author": {"name": "Frank", "age": 60}, "year": 1965}),
    ("array of objects", {"type": "object", "properties": {
        "people": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 3}},
        "required": ["people"]}, {"people": [{"name": "A", "age": 1}]}),
    ("nullable", {"type": "object", "properties": {
        "middle_name": {"type": ["string", "null"]}}, "required": ["middle_name"]},
        {"middle_name": None}),
    ("anyOf", {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}, "required": ["id"]},
        {"id": 42}),
    ("oneOf objects", {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"radius": {"type": "number"}},
         "required": ["radius"], "additionalProperties": False},
        {"type": "object", "properties": {"side": {"type": "number"}, "sides": {
            "type": "integer"}}, "required": ["side", "sides"], "additionalProperties": False}
    ]}}, "required": ["shape"]}, {"shape": {"radius": 2.0}}),
    ("no additional properties", {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}},
        "required": ["a", "b", "c"], "additionalProperties": False},
        {"a": "x", "b": 1, "c": True}),
    ("pattern", {"type": "object", "properties": {
        "ticket": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
        "required": ["ticket"]}, {"ticket": "ABC-123"}),
    ("format date", {"type": "object", "properties": {
        "born": {"type": "string", "format": "date",
                 "description": "a date of birth, YYYY-MM-DD"}}, "required": ["born"]},
        {"born": "1815-12-10"}),
    ("format email", {"type": "object", "properties": {
        "email": {"type": "string", "format": "email",
                  "description": "an email address such as ada@example.com"}},
        "required": ["email"]},
        {"email": "ada@example.com"}),
    ("format uuid", {"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid", "description": "a random UUID"}},
        "required": ["id"]},
        {"id": "123e4567-e89b-12d3-a456-426614174000"}),
    ("format ipv4", {"type": "object", "properties": {
        "ip": {"type": "string", "format": "ipv4", "description": "an IPv4 address"}},
        "required": ["ip"]},
        {"ip": "192.168.0.1"}),
    ("format date-time", {"type": "object", "properties": {
        "at": {"type": "string", "format": "date-time",
               "description": "a timestamp in RFC 3339 form"}}, "required": ["at"]},
        {"at": "2026-12-03T10:00:00Z"}),
    ("tuple", {"type": "object", "properties": {"point": {
        "type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}],
        "items": False}}, "required": ["point"]}, {"point": [1.0, 2.0]}),
    ("exclusive bounds", {"type": "object", "properties": {
        "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
        "required": ["ratio"]}, {"ratio": 0.5}),
    ("$defs and $ref", {"$defs": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"}},
        "required": ["street", "city"]}}, "type": "object", "properties": {
        "home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
        "required": ["home", "work"]},
        {"home": {"street": "1 A St", "city": "X"}, "work": {"street": "2 B St", "city": "Y"}}),
    ("recursive tree", {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "maxItems": 2,
                                                   "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"]}}, "$ref": "#/$defs/node"},
        {"value": 1, "children": [{"value": 2}]}),
    ("top-level array", {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 3},
        [{"sku": "x1", "qty": 2}]),
    ("four levels", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "object", "properties": {
            "d": {"type": "string", "enum": ["deep"]}}, "required": ["d"]}},
            "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
        {"a": {"b": {"c": {"d": "deep"}}}}),
    ("many fields", {"type": "object", "properties": {
        f"f{i}": {"type": ["integer", "string", "boolean"][i % 3]} for i in range(12)},
        "required": [f"f{i}" for i in range(12)], "additionalProperties": False},
        {f"f{i}": [i, str(i), bool(i % 2)][i % 3] for i in range(12)}),
    ("pydantic model", {
        "$defs": {"Step": {"properties": {
            "explanation": {"title": "Explanation", "type": "string"},
            "output": {"title": "Output", "type": "string"}},
            "required": ["explanation", "output"], "title": "Step", "type": "object",
            "additionalProperties": False}},
        "properties": {"steps": {"items": {"$ref": "#/$defs/Step"}, "title": "Steps",
                                 "type": "array", "maxItems": 3},
                       "final_answer": {"title": "Final Answer", "type": "string"}},
        "required": ["steps", "final_answer"], "title": "MathReasoning", "type": "object",
        "additionalProperties": False},
        {"steps": [{"explanation": "add", "output": "2"}], "final_answer": "2"}),
]

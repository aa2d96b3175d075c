"""The checks and the one rewrite hyla makes to a JSON schema before its grammar is built.

- :func:`parse_schema`: the text must hold a JSON object, at most ``MAX_SCHEMA_DEPTH`` deep,
  that some finite value can satisfy;
- :func:`has_finite_instance`: no ``$ref`` cycle that every value must go round;
- :func:`closed`: objects that name their properties take no others unless they say so.
Pure Python.
"""

from __future__ import annotations

import json

MAX_SCHEMA_NODES = 20_000
# Deeper than any schema people write; checked on the parsed value, because whether
# json.loads itself gives up (RecursionError) depends on the stack it runs on and on the
# recursion limit other libraries set (torch raises it).
MAX_SCHEMA_DEPTH = 100
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def parse_schema(text: str) -> dict:
    """A JSON schema from its text: ValueError unless it is a JSON object that some finite
    JSON value can satisfy (:func:`has_finite_instance`)."""
    def not_a_number(name: str):
        # NaN and Infinity are Python's json extensions; a request's 1e400 arrives as one
        raise ValueError(f"the JSON schema holds {name}: a JSON number is finite (a huge one "
                         f"such as 1e400 overflows to Infinity)")
    try:
        schema = json.loads(text, parse_constant=not_a_number)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("the JSON schema is nested too deeply") from None
    if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema is nested too deeply (more than {MAX_SCHEMA_DEPTH} "
                         "levels)")
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        finite = has_finite_instance(schema)
    except RecursionError:
        raise ValueError("the JSON schema is nested too deeply") from None
    if not finite:
        raise ValueError("the JSON schema is recursive without a base case: every value it "
                         "allows contains itself, so no finite JSON can satisfy it")
    return schema


def nesting_depth(value) -> int:
    """How many lists and objects deep ``value`` goes, without recursion.

    Example:
        >>> nesting_depth({"a": [1, {"b": []}]}), nesting_depth(3)
        (4, 0)
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(
            node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def closed(schema):
    """``schema`` with objects that name their properties taking no others unless it says
    so (``additionalProperties``), as XGrammar's strict mode (vLLM's default) and OpenAI's
    strict schemas do: without it a small model keeps inventing keys until ``max_tokens``.

    Example:
        >>> closed({"type": "object", "properties": {"a": {"type": "object",
        ...         "properties": {}}}})["properties"]["a"]["additionalProperties"]
        False
    """
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):     # names -> subschemas
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in ("const", "enum", "default", "examples", "required"):   # values
            out[key] = value
        else:
            out[key] = closed(value)
    if "properties" in out and not {"additionalProperties", "unevaluatedProperties",
                                    "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def has_finite_instance(schema) -> bool:
    """Whether a finite JSON value could satisfy ``schema`` as far as its ``$ref`` cycles go:
    False when every path through some required property, non-empty array or ``allOf``
    leads back to where it started (``{"properties": {"a": {"$ref": "#"}}, "required":
    ["a"]}``). Types, bounds and formats are the grammar engine's to check. Least fixed
    point over the local references (any JSON pointer into the schema: ``#``,
    ``#/$defs/...``, ``#/properties/a``, ``~0`` and ``~1`` escapes).

    Example:
        >>> tree = {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array",
        ...         "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}
        >>> loop = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
        >>> has_finite_instance(tree), has_finite_instance(loop)
        (True, False)
    """
    refs: dict[str, object] = {"#": schema}
    nodes = [0]

    def collect(node) -> None:
        nodes[0] += 1
        if nodes[0] > MAX_SCHEMA_NODES:
            raise ValueError(f"the JSON schema is too large: more than {MAX_SCHEMA_NODES} "
                             f"subschemas")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in refs:
                target = _pointer(schema, ref)
                if target is not None:
                    refs[ref] = target
            for sub in node.values():
                if isinstance(sub, dict | list):
                    collect(sub)
        elif isinstance(node, list):
            for sub in node:
                if isinstance(sub, dict | list):
                    collect(sub)

    collect(schema)
    known = dict.fromkeys(refs, False)

    def finite(node) -> bool:
        if not isinstance(node, dict):
            return node is not False
        ok = True
        ref = node.get("$ref")
        if isinstance(ref, str):
            ok = known.get(ref, True)         # a remote or unknown reference: not ours to judge
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key]:
                ok = ok and any(finite(b) for b in node[key])
        if isinstance(node.get("allOf"), list):
            ok = ok and all(finite(b) for b in node["allOf"])
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for name in node.get("required") or ():
            if isinstance(name, str) and name in props:
                ok = ok and finite(props[name])
        least = node.get("minItems", 0)
        if isinstance(least, int) and least > 0:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            ok = ok and all(finite(p) for p in prefix[:least])
            if least > len(prefix) and "items" in node:
                ok = ok and finite(node["items"])
        return ok

    changed = True
    while changed:
        changed = False
        for name, node in refs.items():
            if not known[name] and finite(node):
                known[name] = changed = True
    return known["#"]


def _pointer(schema, ref: str):
    """The node a local ``$ref`` (``#`` or ``#/a/b``, RFC 6901 escapes) points at, or None."""
    node = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node

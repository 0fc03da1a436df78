"""A JSON Schema's shape: its keywords and subschemas, its draft, its local refs, its root types and bounds.

What grammar.py, bundle.py, validate.py, tables.py and spec.py read off a schema, whatever backend decodes it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any
from urllib.parse import urldefrag, urljoin

# JSON Schema keywords (2020-12 and the older drafts). Other keys are annotations or vendor extensions: they never
# constrain a value, and are left out of the grammar schema.
KEYWORDS = frozenset("""
$schema $id id $ref $defs definitions $anchor $dynamicRef $dynamicAnchor $recursiveRef $recursiveAnchor $vocabulary
type enum const multipleOf maximum exclusiveMaximum minimum exclusiveMinimum maxLength minLength pattern format
maxItems minItems uniqueItems maxContains minContains maxProperties minProperties required dependentRequired
properties patternProperties additionalProperties propertyNames items prefixItems additionalItems contains
unevaluatedItems unevaluatedProperties allOf anyOf oneOf not if then else dependentSchemas dependencies
contentEncoding contentMediaType contentSchema
""".split())
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
        "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items")
_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf", "items")


def esc(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def subschemas(node, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every subschema (a dict) with its JSON pointer, depth first; boolean subschemas are skipped."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from subschemas(sub, f"{path}/{key}/{esc(name)}")
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield from subschemas(node[key], f"{path}/{key}")
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from subschemas(sub, f"{path}/{key}/{i}")
    if isinstance(node.get("dependencies"), dict):
        for name, sub in node["dependencies"].items():
            yield from subschemas(sub, f"{path}/dependencies/{esc(name)}")


def types_of(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def declared_draft(schema: dict) -> int:
    """The declared draft as a year-ish number: 4, 6, 7, 2019, 2020 (2020 when none is declared)."""
    declared = str(schema.get("$schema", ""))
    for mark, n in (("draft-04", 4), ("draft-03", 4), ("draft-06", 6), ("draft-07", 7), ("2019-09", 2019)):
        if mark in declared:
            return n
    return 2020


def local_refs(schema: dict) -> tuple[dict, list[str]]:
    """The schema with every `$ref` that points into the document itself written as '#/...', and the refs that
    point elsewhere (another file or URL, which would have to be fetched).

    A ref to the document's own `$id` (or to a subschema's `$id`) is local; refs to the JSON Schema meta-schemas
    are left alone (jsonschema ships them)."""
    from jsonschema_specifications import REGISTRY as META

    doc = copy.deepcopy(schema)
    id_key = "id" if declared_draft(schema) == 4 else "$id"
    bases: dict[str, str] = {}  # absolute $id (no fragment) -> JSON pointer of the subschema that declares it
    anchors: dict[str, str] = {}

    def ids(node, path, base):
        if not isinstance(node, dict):
            return
        if isinstance(node.get(id_key), str):
            absolute, frag = urldefrag(urljoin(base, node[id_key]))
            if absolute:
                base = absolute
                bases.setdefault(absolute, path)
            if frag and not frag.startswith("/"):
                anchors[urljoin(base, "#" + frag)] = path
        if isinstance(node.get("$anchor"), str):
            anchors[urljoin(base, "#" + node["$anchor"])] = path
        for sub_path, sub in children(node, path):
            ids(sub, sub_path, base)

    root_base = urldefrag(doc.get(id_key, "")).url if isinstance(doc.get(id_key), str) else ""
    bases[root_base] = ""
    ids(doc, "", root_base)
    remote: list[str] = []

    def fix(node, base):
        if not isinstance(node, dict):
            return
        if isinstance(node.get(id_key), str) and urldefrag(urljoin(base, node[id_key])).url:
            base = urldefrag(urljoin(base, node[id_key])).url
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = urljoin(base, ref) if base else ref
            absolute, frag = urldefrag(target)
            if target in anchors:
                node["$ref"] = "#" + anchors[target]
            elif absolute in bases and (not frag or frag.startswith("/")):
                node["$ref"] = "#" + bases[absolute] + frag
            elif not absolute and (not frag or frag.startswith("/")):
                node["$ref"] = "#" + frag
            elif absolute.rstrip("#") not in META and absolute not in META:
                remote.append(ref)
        for _, sub in children(node, ""):
            fix(sub, base)

    fix(doc, root_base)
    return doc, remote


def children(node: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    """The immediate subschemas of a schema object (booleans skipped), with their JSON pointers under `path`."""
    for key in _MAPS + ("dependencies",):
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                if isinstance(sub, dict):
                    yield f"{path}/{key}/{esc(name)}", sub
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield f"{path}/{key}", node[key]
    for key in _LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                if isinstance(sub, dict):
                    yield f"{path}/{key}/{i}", sub


def bounded(schema: dict | None) -> bool:
    """Whether every array and string the schema can produce has a length bound (so loops end in the grammar)."""
    if schema is None:
        return False
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        kinds = node.get("type")
        kinds = set(kinds) if isinstance(kinds, list) else {kinds}
        if ("array" in kinds or "items" in node or "prefixItems" in node) and "maxItems" not in node:
            return False
        if "string" in kinds and not any(k in node for k in ("maxLength", "enum", "const")):
            return False
        for key, value in node.items():
            if key in _MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, dict):
                stack.append(value)  # items, additionalProperties, not, if/then/else, contains, ...
            elif isinstance(value, list) and key not in ("enum", "required", "type", "examples"):
                stack.extend(value)  # anyOf, oneOf, allOf, prefixItems
    return True


def root_types(schema: dict | None) -> tuple[str, ...]:
    """The JSON types the schema allows at its root; () means any. json_object jobs (None) are objects."""
    if schema is None:
        return ("object",)
    kind = schema.get("type")
    if isinstance(kind, str):
        return (kind,)
    if isinstance(kind, list):
        return tuple(k for k in kind if isinstance(k, str))
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null",
                 list: "array", dict: "object"}
        return tuple(dict.fromkeys(names.get(type(v), "string") for v in values))
    return ()


def is_object_root(schema: dict | None) -> bool:
    """Object roots get one typed column per property; a type list containing "object" counts as an object."""
    return "object" in root_types(schema) or (schema is not None and not root_types(schema) and "properties" in schema)

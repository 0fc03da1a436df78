"""JSON Schema -> Arrow: the Arrow type of a schema's values, and the output's typed columns (a top-level property
whose values fit one Arrow type gets its own column beside `json`)."""

from __future__ import annotations

from urllib.parse import unquote

import pyarrow as pa

from batchjson.schema.shape import is_object_root, local_refs, root_types

# JSON Schema types that map cleanly onto one Arrow type; other properties stay in the `json` column only.
ARROW_TYPES = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
VALUE_COLUMN = "value"
# How far _arrow_type follows refs and branches: enough for what Pydantic writes (a ref to an enum, inside an
# Optional, inside a list), and an end to a schema that refers to itself.
_DEPTH = 8


def _deref(node, root: dict):
    """The subschema a local `$ref` ('#/...') points to (None if nothing); `node` itself if it has no ref, or a
    type of its own."""
    ref = node.get("$ref") if isinstance(node, dict) and "type" not in node else None
    if not isinstance(ref, str):
        return node
    target = root
    for part in ref.removeprefix("#").split("/")[1:]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        elif isinstance(target, dict) and part in target:
            target = target[part]
        else:
            return None
    return target


def _is_null(node, root: dict) -> bool:
    target = _deref(node, root)
    return isinstance(target, dict) and root_types(target) == ("null",)


def _arrow_type(schema, root: dict, depth: int = _DEPTH) -> pa.DataType | None:
    """The Arrow type of values of `schema`: a scalar type (null allowed), or a list of one; None when none fits.
    Looks through local `$ref`s and a nullable union (`anyOf: [X, {"type": "null"}]`, Pydantic's Optional[X])."""
    if depth == 0 or not isinstance(schema, dict):
        return None
    target = _deref(schema, root)
    if target is not schema:
        return _arrow_type(target, root, depth - 1)
    branches = schema.get("anyOf", schema.get("oneOf"))
    if "type" not in schema and isinstance(branches, list):
        others = [b for b in branches if not _is_null(b, root)]
        return _arrow_type(others[0], root, depth - 1) if len(others) == 1 else None
    kinds = [k for k in root_types(schema) if k != "null"]
    if len(kinds) != 1:
        return None
    if kinds[0] == "array":
        item = _arrow_type(schema.get("items"), root, depth - 1)
        return pa.list_(item) if item is not None and not pa.types.is_list(item) else None
    return ARROW_TYPES.get(kinds[0])


def typed_columns(schema: dict | None, taken: set[str]) -> dict[str, pa.DataType]:
    """Top-level schema properties that become their own Arrow column (a scalar or a list of scalars, null
    allowed); a non-object root becomes one `value` column when its type maps to Arrow."""
    if schema is None:
        return {}
    root = local_refs(schema)[0]  # every ref written as '#/...', whatever $id or anchor it went through
    if not is_object_root(schema):
        kind = _arrow_type(root, root)
        return {VALUE_COLUMN: kind} if kind is not None and VALUE_COLUMN not in taken else {}
    out = {}
    for name, prop in (root.get("properties") or {}).items():
        kind = _arrow_type(prop, root)
        if kind is not None and name not in taken:
            out[name] = kind
    return out

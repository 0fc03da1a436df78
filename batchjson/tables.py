"""Outcomes -> Arrow tables of the three kinds of part files: valid rows, re-queued rows, rejects.

One schema per kind for the whole run. Nothing here writes: where the tables go, and how atomically, is
storage/commits.py's business."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import unquote

import pyarrow as pa

from batchjson.records import Outcome
from batchjson.schema.shape import is_object_root, local_refs, root_types
from batchjson.spec import META_COLUMNS

# JSON Schema types that map cleanly onto one Arrow type; other properties stay in the `json` column only.
ARROW_TYPES = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
META_TYPES = dict(zip(META_COLUMNS, (pa.int8(), pa.string(), pa.int32(), pa.int32())))


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


def reserved(id_column: str, passthrough: Iterable[str]) -> set[str]:
    """Output column names a schema property cannot take."""
    return {id_column, "json", *passthrough, *META_COLUMNS}


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


class PartSink:
    """Builds the three kinds of part files from outcomes, with one Arrow schema per kind for the whole run."""

    def __init__(self, id_column: str, passthrough: pa.Schema, schema: dict | None):
        self.id_column = id_column
        self.passthrough = passthrough
        base = [pa.field(id_column, pa.string()), *passthrough]
        self.typed = typed_columns(schema, reserved(id_column, passthrough.names))
        self.root_value = schema is not None and not is_object_root(schema)
        meta = [pa.field(k, t) for k, t in META_TYPES.items()]
        self.output_schema = pa.schema([*base, pa.field("json", pa.string()),
                                        *(pa.field(k, t) for k, t in self.typed.items()), *meta])
        self.reject_schema = pa.schema([*base, pa.field("reason", pa.string()), pa.field("detail", pa.string()),
                                        pa.field("raw_text", pa.string()), *meta])
        self.requeue_schema = self.reject_schema.append(pa.field("prompt", pa.string()))

    def _common(self, outcomes: list[Outcome], pass_no: int) -> dict[str, list]:
        gens = [o.generation for o in outcomes]
        cols: dict[str, list] = {self.id_column: [g.prompt.row_id for g in gens]}
        for name in self.passthrough.names:
            cols[name] = [g.prompt.extra.get(name) for g in gens]
        cols |= {"_pass": [pass_no] * len(gens), "_finish_reason": [g.finish_reason for g in gens],
                 "_prompt_tokens": [g.prompt_tokens for g in gens], "_output_tokens": [g.output_tokens for g in gens]}
        return cols

    def valid(self, outcomes: list[Outcome], pass_no: int) -> pa.Table:
        cols = self._common(outcomes, pass_no)
        cols["json"] = [o.generation.text for o in outcomes]  # already checked JSON: stored as the model wrote it
        for name, kind in self.typed.items():
            values = [o.value if self.root_value else
                      o.value.get(name) if isinstance(o.value, dict) else None for o in outcomes]
            try:
                cols[name] = pa.array(values, kind)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                cols[name] = pa.nulls(len(values), kind)  # e.g. an integer beyond int64: the json column keeps it
        return pa.table({f.name: cols[f.name] for f in self.output_schema}, schema=self.output_schema)

    def rejected(self, outcomes: list[Outcome], pass_no: int, with_prompt: bool = False) -> pa.Table:
        cols = self._common(outcomes, pass_no)
        cols |= {"reason": [o.reason for o in outcomes], "detail": [o.detail for o in outcomes],
                 "raw_text": [o.generation.text for o in outcomes]}
        schema = self.reject_schema
        if with_prompt:
            cols["prompt"] = [o.generation.prompt.text for o in outcomes]
            schema = self.requeue_schema
        return pa.table({f.name: cols[f.name] for f in schema}, schema=schema)

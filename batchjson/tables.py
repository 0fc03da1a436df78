"""Outcomes -> Arrow tables of the three kinds of part files: valid rows, re-queued rows, rejects.

One schema per kind for the whole run. Nothing here writes: where the tables go, and how atomically, is
storage/commits.py's business."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from batchjson.records import Outcome
from batchjson.schema.arrow import typed_columns
from batchjson.schema.shape import is_object_root
from batchjson.spec import META_COLUMNS

META_TYPES = dict(zip(META_COLUMNS, (pa.int8(), pa.string(), pa.int32(), pa.int32())))


def reserved(id_column: str, passthrough: Iterable[str]) -> set[str]:
    """Output column names a schema property cannot take."""
    return {id_column, "json", *passthrough, *META_COLUMNS}


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

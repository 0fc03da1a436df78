"""Rows -> prompts: the user template filled per row, framed by the model's chat template."""

from __future__ import annotations

from collections.abc import Iterator

from batchjson.records import Generation, Prompt
from batchjson.source import Unit
from batchjson.spec import PromptSpec


class Renderer:
    """Renders rows into chat prompts.

    The chat template is rendered once, around a marker, into a prefix and a suffix: per row only the user
    text is formatted, which keeps rendering cheap and gives every prompt the same prefix (prefix caching).
    """

    MARK = "\x00BATCHJSON_USER\x00"

    def __init__(self, spec: PromptSpec, chat_frame: tuple[str, str], id_column: str, passthrough: tuple[str, ...],
                 duplicates: dict[str, tuple[str, int]] | None = None):
        self.spec = spec
        self.columns = spec.columns  # parsed from the template once, not per row
        self.duplicates = duplicates or {}  # id -> the unit that holds its first occurrence
        self.prefix, self.suffix = chat_frame
        self.id_column = id_column
        self.passthrough = passthrough

    def render(self, unit: Unit) -> Iterator[Prompt | Generation]:
        """One Prompt per row; a row with a null or empty prompt column comes back as a failed Generation."""
        cols = {name: unit.batch.column(name).to_pylist() for name in unit.batch.schema.names}
        ids = cols[self.id_column]
        for i, row_id in enumerate(ids):
            extra = {c: cols[c][i] for c in self.passthrough}
            values = {c: cols[c][i] for c in self.columns}
            row_id = str(row_id)
            prompt = Prompt(row_id, unit.key, "", extra)
            first = self.duplicates.get(row_id)
            if first is not None and first != (unit.key, i):
                yield Generation(prompt, error="duplicate_id", detail=f"{self.id_column} {row_id!r} already appears "
                                 f"in unit {first[0]} (row {first[1]}); only the first occurrence is processed")
                continue
            empty = [c for c, v in values.items() if v is None or (isinstance(v, str) and not v.strip())]
            if empty:
                yield Generation(prompt, error="empty_prompt", detail=f"column {empty[0]!r} is null or empty")
                continue
            prompt.text = self.prefix + self.spec.template.format_map(values) + self.suffix
            yield prompt

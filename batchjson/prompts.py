"""Rows -> prompts: the user template filled per row, framed by the model's chat template."""

from __future__ import annotations

from collections.abc import Iterator

from batchjson.errors import InputError
from batchjson.records import Generation, Prompt
from batchjson.source import Unit
from batchjson.spec import PromptSpec


class Renderer:
    """Renders rows into chat prompts.

    The chat template is rendered once, around a marker, into a prefix and a suffix: per row only the user
    text is formatted, which keeps rendering cheap and gives every prompt the same prefix (prefix caching).
    """

    MARK = "\x00BATCHJSON_USER\x00"

    def __init__(self, spec: PromptSpec, chat_frame: tuple[str, str], id_column: str, passthrough: tuple[str, ...]):
        self.spec = spec
        self.prefix, self.suffix = chat_frame
        self.id_column = id_column
        self.passthrough = passthrough

    def render(self, unit: Unit) -> Iterator[Prompt | Generation]:
        """One Prompt per row; a row with a null or empty prompt column comes back as a failed Generation."""
        cols = {name: unit.batch.column(name).to_pylist() for name in unit.batch.schema.names}
        ids = cols[self.id_column]
        for i, row_id in enumerate(ids):
            if row_id is None:
                raise InputError(f"{unit.file}: a row of unit {unit.key} (row {i} of that batch) has a null "
                                 f"{self.id_column!r}; every row needs an id.")
            extra = {c: cols[c][i] for c in self.passthrough}
            values = {c: cols[c][i] for c in self.spec.columns}
            prompt = Prompt(str(row_id), unit.key, "", extra)
            empty = [c for c, v in values.items() if v is None or (isinstance(v, str) and not v.strip())]
            if empty:
                yield Generation(prompt, error="empty_prompt", detail=f"column {empty[0]!r} is null or empty")
                continue
            prompt.text = self.prefix + self.spec.template.format_map(values) + self.suffix
            yield prompt

"""Rows -> prompts: the user template filled per row, or a row's own chat messages, framed by the model's chat template
(from its tokenizer: the engine's once one has started, else the model's files)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa

from batchjson.errors import EngineError
from batchjson.ids import row_ids
from batchjson.records import Generation, Prompt
from batchjson.source import Unit
from batchjson.spec import PromptSpec

MARK = "\x00BATCHJSON_USER\x00"


# The tokenizer class tokenizer_config.json names for a plain tokenizer.json (Transformers 5's name, and 4's).
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer(model_dir: str, loaded=None):
    """The model's tokenizer: `loaded` where an engine has loaded it already (a Hugging Face one: its chat template
    renders as the files' does, and a second load takes seconds before the first request), else from the files.
    Files whose config names the generic class are loaded as that class, the one AutoTokenizer would pick, without
    importing AutoTokenizer's model registry and torch (4 s of CPU in each process that loads one: each fake-engine
    replica, bench's and the tests' runs)."""
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if isinstance(loaded, PreTrainedTokenizerBase):
        return loaded
    try:
        if _tokenizer_class(model_dir) in GENERIC_TOKENIZERS:
            return PreTrainedTokenizerFast.from_pretrained(model_dir)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise EngineError(f"model.path: cannot load the tokenizer of {model_dir} ({e}). Point model.path at a "
                          "Hugging Face model folder with its tokenizer files.") from None


def _tokenizer_class(model_dir: str) -> str | None:
    try:
        return json.loads((Path(model_dir) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def chat_frame(model_dir: str, system: str, loaded=None) -> tuple[str, str]:
    """The model's chat template rendered around a marker: (text before the user message, text after it).

    Prompts are plain data: the template is rendered once, with no engine involved. A model without a
    chat template gets the system text as a plain preamble."""
    tokenizer = _tokenizer(model_dir, loaded)
    if not getattr(tokenizer, "chat_template", None):
        return (f"{system}\n\n" if system else ""), ""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": MARK}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prefix, _, suffix = text.partition(MARK)
    return prefix, suffix


def chat_messages(model_dir: str, loaded=None) -> Callable[[list], str]:
    """The model's chat template as a function of one row's messages (prompt.messages), rendered whole per row:
    a conversation has no fixed frame to cut once. ValueError for messages it cannot render (not a list of
    {role, content} strings, or refused by the template, e.g. roles that do not alternate); the row is then
    rejected as invalid_input. A model without a chat template gets the turns' texts one after another."""
    import jinja2

    tokenizer = _tokenizer(model_dir, loaded)
    template = getattr(tokenizer, "chat_template", None)

    def render(messages: list) -> str:
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"message {i} is not a {{role, content}} pair of strings")
        if not template:
            return "".join(f"{m['content']}\n\n" for m in messages)
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise ValueError(f"the model's chat template refused them: {e}") from None

    return render


class _Undecodable:
    """A string cell that is not valid UTF-8."""


BAD = _Undecodable()


def _values(column: pa.ChunkedArray | pa.Array) -> list:
    try:
        return column.to_pylist()
    except UnicodeDecodeError:  # Parquet does not check UTF-8; one bad cell must not sink the whole unit
        if not pa.types.is_string(column.type):  # a nested column (messages): cell by cell
            out = []
            for cell in column:
                try:
                    out.append(cell.as_py())
                except UnicodeDecodeError:
                    out.append(BAD)
            return out
        out = []
        for raw in column.cast(pa.binary()).to_pylist():
            try:
                out.append(None if raw is None else raw.decode())
            except UnicodeDecodeError:
                out.append(BAD)
        return out


class Renderer:
    """Renders rows into chat prompts.

    The chat template is rendered once, around a marker, into a prefix and a suffix: per row only the user
    text is formatted, which keeps rendering cheap and gives every prompt the same prefix (prefix caching).
    """

    def __init__(self, spec: PromptSpec, frame: tuple[str, str], id_column: str, passthrough: tuple[str, ...],
                 owners: dict[str, tuple[str, int]] | None = None, chat: Callable[[list], str] | None = None):
        self.spec = spec
        self.chat = chat  # prompt.messages: the chat template per row (chat_messages), instead of the frame
        self.columns = spec.columns  # parsed from the template once, not per row
        self.owners = owners or {}  # a repeated id -> the (unit, row) that is processed; the others are rejected
        self.prefix, self.suffix = frame
        self.id_column = id_column
        self.passthrough = passthrough

    def render(self, unit: Unit) -> Iterator[Prompt | Generation]:
        """One Prompt per row; a row that cannot be prompted comes back as a failed Generation."""
        cols = {name: _values(unit.batch.column(name)) for name in unit.batch.schema.names}
        ids = row_ids(unit.batch.column(self.id_column), unit.ref.file)
        for i, row_id in enumerate(ids):
            extra = {c: (None if cols[c][i] is BAD else cols[c][i]) for c in self.passthrough}
            values = {c: cols[c][i] for c in self.columns}
            prompt = Prompt(row_id, unit.key, "", extra)
            owner = self.owners.get(row_id)
            if owner is not None and owner != (unit.key, i):
                yield Generation(prompt, error="duplicate_id", detail=f"{self.id_column} {row_id!r} also appears in "
                                 f"unit {owner[0]} (row {owner[1]}), which is the one processed")
                continue
            bad = [c for c in (*self.columns, *self.passthrough) if cols[c][i] is BAD]
            if bad:
                yield Generation(prompt, error="invalid_input", detail=f"column {bad[0]!r} of {unit.ref.file} row "
                                 f"{unit.ref.offset + i} is not valid UTF-8")
                continue
            empty = [c for c, v in values.items() if v is None or v == [] or (isinstance(v, str) and not v.strip())]
            if empty:
                yield Generation(prompt, error="empty_prompt", detail=f"column {empty[0]!r} is null or empty")
                continue
            if self.chat is None:
                prompt.text = self.prefix + self.spec.template.format_map(values) + self.suffix
            else:
                try:
                    prompt.text = self.chat(values[self.spec.messages])
                except ValueError as e:
                    yield Generation(prompt, error="invalid_input", detail=f"column {self.spec.messages!r} of "
                                     f"{unit.ref.file} row {unit.ref.offset + i}: {e}")
                    continue
            yield prompt

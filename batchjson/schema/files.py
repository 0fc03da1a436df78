"""Loading a job's output JSON Schema: read from a file (or given inline, or written by a Pydantic model), checked as a
JSON Schema, the files its refs reach bundled in, and no remote ref left. Also the reading of the files a spec names,
with the message that names them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonschema import SchemaError, validators

from batchjson.errors import SpecError
from batchjson.schema.bundle import bundle
from batchjson.schema.shape import local_refs


def read(path: Path, loads: Callable[[str], Any], syntax_error: type[Exception], what: str) -> Any:
    """`path` parsed by `loads`; a SpecError naming it as `what` when it cannot be read or does not parse."""
    try:
        return loads(path.read_text())
    except OSError as e:
        raise SpecError(f"{what} {path} cannot be read: {e.strerror}.") from None
    except syntax_error as e:
        raise SpecError(f"{what} {path} does not parse: {e}.") from None


def schema_file(path: Path) -> dict:
    """The JSON Schema at `path` (schema.path), checked, with the files its refs reach bundled in."""
    doc = read(path, json.loads, json.JSONDecodeError, "schema.path: the JSON Schema")
    return checked(doc, path.parent, path.name)


def _check_schema(doc: dict, what: str = "") -> None:
    try:
        validators.validator_for(doc, default=validators.Draft202012Validator).check_schema(doc)
    except SchemaError as e:
        raise SpecError(f"the JSON Schema {what}is invalid at {'/'.join(map(str, e.absolute_path)) or 'its root'}: "
                        f"{e.message}.") from None


def checked(doc: Any, folder: Path, name: str | None = None) -> dict:
    """The schema, checked, with the files its refs reach bundled in (`folder/name` is where it was read)."""
    if not isinstance(doc, dict):
        raise SpecError(f"the JSON Schema must be a JSON object ({{...}}), got {type(doc).__name__}: wrap it, e.g. "
                        '{"type": "string"}.')
    _check_schema(doc)
    _, remote = local_refs(doc)
    if remote:
        # Refs to sibling files are bundled in, so that the grammar and the validator see one document.
        doc, remote = bundle(doc, folder, name)
        _check_schema(doc, "with the files it refers to bundled in, ")
    # jsonschema would fetch a remote $ref over the network while validating, row after row.
    if remote:
        raise SpecError(f"the JSON Schema refers to a URL ($ref {remote[0]!r}"
                        f"{f' and {len(remote) - 1} more' if len(remote) > 1 else ''}): batchjson does not fetch "
                        "schemas. Save the referenced schema next to the schema file and refer to it by a relative "
                        "path (\"$ref\": \"other.json#/definitions/x\"), or inline it under \"$defs\".")
    return doc

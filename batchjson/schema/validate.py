"""Generations -> outcomes: finish reason, JSON parse and JSON Schema, whatever the grammar promised."""

from __future__ import annotations

import orjson
from jsonschema import FormatChecker, validators
from jsonschema.exceptions import best_match
from jsonschema_specifications import REGISTRY as META_SCHEMAS

from batchjson.records import Generation, Outcome
from batchjson.schema.shape import subschemas


# Every format checker jsonschema has (with its format extras installed), whatever the declared draft: a schema that
# says "format": "date-time" means it, and the draft's own checker set lacks formats later drafts added.
FORMATS = FormatChecker()

# Keywords a later draft added that an older draft gives no meaning: a draft-04 schema that writes "const" means
# it (the grammar backends enforce it whatever the draft, and so does ajv, SchemaStore's validator). Left out,
# `{"oneOf": [{"const": "a"}, {"const": "b"}]}` would refuse every answer in draft-04, as both branches match.
# Keywords whose meaning changed between drafts (exclusiveMaximum, items, dependencies...) keep the declared one.
LATER_KEYWORDS = ("const", "contains", "propertyNames", "if")


def validator_class(schema: dict) -> type:
    """The declared draft's validator (2020-12 when none is declared), plus LATER_KEYWORDS where it lacks them."""
    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    missing = {k: validators.Draft7Validator.VALIDATORS[k] for k in LATER_KEYWORDS if k not in cls.VALIDATORS}
    return validators.extend(cls, missing) if missing else cls


def used_formats(schema: dict | None) -> set[str]:
    return {node["format"] for _, node in subschemas(schema or {}) if isinstance(node.get("format"), str)}


def unchecked_formats(schema: dict | None) -> list[str]:
    """Formats the schema uses that no checker knows: nothing checks them, neither the grammar nor validation."""
    return sorted(used_formats(schema) - set(FORMATS.checkers))


class Validator:
    """Checks every output; compiled once for the schema's declared draft (2020-12 when none is declared), with
    the later drafts' const, contains, propertyNames and if/then/else where the draft lacks them.

    `format` is asserted unless check_format is false. $refs resolve inside the schema and to the JSON Schema
    meta-schemas only: nothing is fetched (the spec loader refuses remote $refs)."""

    def __init__(self, schema: dict | None, check_format: bool = True):
        self.schema = schema
        self._validator = None
        if schema is not None:
            self._validator = validator_class(schema)(schema, format_checker=FORMATS if check_format else None, registry=META_SCHEMAS)

    def check(self, gen: Generation) -> Outcome:
        """The outcome of one row. With several candidates (n > 1): the first valid one's, or else the first
        candidate's failure; the outcome's generation is then that candidate."""
        if not gen.candidates:
            return self._check(gen)
        first = None
        for candidate in gen.candidates:
            outcome = self._check(candidate)
            if outcome.ok:
                return outcome
            first = first or outcome
        return first

    def _check(self, gen: Generation) -> Outcome:
        if gen.error:
            return Outcome(gen, reason=gen.error, detail=gen.detail)
        if gen.finish_reason == "repetition":
            return Outcome(gen, reason="repetition", detail=f"stopped after {gen.output_tokens} tokens: the output "
                           "repeats itself")
        if gen.finish_reason == "length":
            return Outcome(gen, reason="truncated", detail=f"hit max_tokens after {gen.output_tokens} tokens")
        try:
            value = orjson.loads(gen.text)
        except orjson.JSONDecodeError as e:
            return Outcome(gen, reason="json_parse", detail=str(e))
        if self._validator is None:
            if not isinstance(value, dict):
                return Outcome(gen, reason="schema", detail=f"expected a JSON object, got {type(value).__name__}")
            return Outcome(gen, value=value)
        error = best_match(self._validator.iter_errors(value))
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "(root)"
            return Outcome(gen, reason="schema", detail=f"{where}: {error.message}"[:500])
        return Outcome(gen, value=value)

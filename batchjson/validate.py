"""Generations -> outcomes: finish reason, JSON parse and JSON Schema, whatever the grammar promised."""

from __future__ import annotations

import orjson
from jsonschema import validators
from jsonschema.exceptions import best_match

from batchjson.records import Generation, Outcome


class Validator:
    """Checks every output; compiled once for the schema's declared draft (2020-12 when none is declared)."""

    def __init__(self, schema: dict | None):
        self.schema = schema
        self._validator = None
        if schema is not None:
            cls = validators.validator_for(schema, default=validators.Draft202012Validator)
            self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def check(self, gen: Generation) -> Outcome:
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

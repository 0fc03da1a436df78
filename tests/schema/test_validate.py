"""Validation is the source of truth: truncation, JSON syntax and the schema, whatever the grammar allowed."""

from __future__ import annotations

from batchjson.records import Generation, Prompt
from batchjson.schema.validate import Validator

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "tags": {"type": "array", "items": {"type": "integer", "maximum": 9}}},
          "required": ["name"], "additionalProperties": False}


def gen(text, finish="stop", **kw):
    return Generation(Prompt("r1", "u", "p"), text, finish, 10, 5, **kw)


def test_valid_row():
    out = Validator(SCHEMA).check(gen('{"name":"ab","tags":[1,2]}'))
    assert out.ok and out.value == {"name": "ab", "tags": [1, 2]}


def test_each_failure_has_its_reason_and_detail():
    v = Validator(SCHEMA)
    truncated = v.check(gen('{"name":"ab","tags":[1,1,1,1', finish="length"))
    assert (truncated.reason, truncated.detail) == ("truncated", "hit max_tokens after 5 tokens")
    # A raw control character inside a string: xgrammar lets it through for length-bounded strings.
    assert v.check(gen('{"name":"a\x04b"}')).reason == "json_parse"
    bad = v.check(gen('{"name":"ab","tags":[1,12]}'))
    assert bad.reason == "schema" and bad.detail.startswith("tags/1: 12 is greater than the maximum of 9")
    assert v.check(gen('{"name":"abcdef"}')).detail.startswith("name: 'abcdef' is too long")
    looping = v.check(gen('{"name":"ab","tags":[1,1,1,1', finish="repetition"))
    assert looping.reason == "repetition" and "repeats itself" in looping.detail
    err = v.check(gen("", finish="error", error="engine_error", detail="the engine ended the request (error)"))
    assert (err.reason, err.detail) == ("engine_error", "the engine ended the request (error)")


def test_declared_draft_is_used():
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "properties": {"x": {"type": "number", "maximum": 5, "exclusiveMaximum": True}}}
    assert Validator(draft4).check(gen('{"x":5}')).reason == "schema"
    assert Validator(draft4).check(gen('{"x":4}')).ok


def test_an_older_draft_still_checks_the_later_keywords_it_writes():
    # SchemaStore's web-manifest: a draft-04 schema whose oneOf branches are consts. Without const, both branches
    # match and every answer would fail; the grammar enforces const whatever the draft.
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "properties": {"orientation": {"oneOf": [{"const": "any"}, {"const": "natural"}]},
                             "tags": {"type": "array", "contains": {"const": "x"}},
                             "kind": {"type": "string"}},
              "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["tags"]}}
    v = Validator(draft4)
    assert v.check(gen('{"orientation":"natural","tags":["x","y"]}')).ok
    assert v.check(gen('{"orientation":"sideways"}')).reason == "schema"
    assert v.check(gen('{"tags":["y"]}')).reason == "schema"
    assert v.check(gen('{"kind":"a"}')).detail == "(root): 'tags' is a required property"


def test_json_object_mode_wants_an_object():
    assert Validator(None).check(gen('{"any":1}')).ok
    assert Validator(None).check(gen("[1]")).reason == "schema"


def test_format_is_asserted_with_every_checker_unless_turned_off():
    # Draft 7's own checker set has no "duration"; jsonschema's full set (with its format extras) does.
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"when": {"type": "string", "format": "date-time"},
                             "took": {"type": "string", "format": "duration"},
                             "site": {"type": "string", "format": "uri"}}}
    v = Validator(schema)
    assert v.check(gen('{"when":"2026-11-30T02:00:00Z","took":"PT5M","site":"https://example.com/a"}')).ok
    assert v.check(gen('{"when":"yesterday"}')).detail.startswith("when: 'yesterday' is not a 'date-time'")
    assert v.check(gen('{"took":"five minutes"}')).reason == "schema"
    assert v.check(gen('{"site":"not a uri"}')).reason == "schema"
    assert Validator(schema, check_format=False).check(gen('{"when":"yesterday"}')).ok


def test_formats_nobody_checks_are_named():
    from batchjson.schema.validate import unchecked_formats

    assert unchecked_formats({"properties": {"v": {"format": "semver"}, "c": {"format": "color"}}}) == ["semver"]


def test_non_object_roots_are_validated():
    v = Validator({"type": "array", "items": {"type": "string", "enum": ["a", "b"]}})
    assert v.check(gen('["a","b"]')).value == ["a", "b"]
    assert v.check(gen('["c"]')).reason == "schema"
    assert Validator({"type": "string", "enum": ["yes", "no"]}).check(gen('"no"')).value == "no"


def test_first_valid_candidate_is_kept():
    v = Validator(SCHEMA)
    bad, good, also_good = gen('{"name":"abcdef"}'), gen('{"name":"ab"}'), gen('{"name":"cd"}')
    parent = gen('{"name":"abcdef"}', candidates=[bad, good, also_good])
    out = v.check(parent)
    assert out.ok and out.generation is good and out.value == {"name": "ab"}
    looping = gen('{"name":"ab","tags":[1,1', finish="repetition")
    failed = v.check(gen("", candidates=[looping, bad]))
    assert failed.reason == "repetition" and failed.generation is looping


def test_iri_is_checked_though_its_parser_is_built_only_when_first_needed():
    import subprocess
    import sys

    # Building the iri parser took two thirds of `batchjson check`; the command line never needs it.
    code = "import sys, batchjson.cli, batchjson.schema.validate; print('lark' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    v = Validator({"type": "string", "format": "iri"})
    assert v.check(gen('"https://例え.jp/a"')).ok
    assert v.check(gen('"not an iri"')).reason == "schema"

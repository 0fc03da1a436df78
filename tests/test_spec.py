"""Job specs: good ones load, bad ones fail at load with a message naming the key and what is allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchjson.errors import SpecError
from batchjson.spec import LOOP_GUARD_BOUNDED, load_spec

ROOT = Path(__file__).parent.parent
BASE = """
[input]
path = "in.parquet"
[prompt]
template = "Read {text}"
[schema]
inline = {type = "object", properties = {a = {type = "string"}}}
"""


def spec_file(tmp_path, text):
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


def test_sample_job_loads_with_paths_from_its_folder():
    spec = load_spec(ROOT / "jobs" / "sample.toml")
    assert Path(spec.input.path) == (ROOT / "sample_data" / "sample.parquet").resolve()
    assert spec.schema_doc["properties"]["items"]["type"] == "array"
    assert spec.speculative.method == "auto" and spec.prompt.columns == ("text",)


@pytest.mark.parametrize("extra, message", [
    ("[input.extra]\n", "unknown key input.extra; allowed keys in [input]"),
    ("[sampling]\ntemprature = 0.5\n", "unknown key sampling.temprature"),
    ("[sampling]\ntemperature = -1.0\n", "sampling.temperature must be >= 0"),
    ("[sampling]\nmax_tokens = 'many'\n", "sampling.max_tokens must be int, got str 'many'"),
    ("[output]\nif_exists = 'append'\n", "output.if_exists must be one of ['resume', 'fail', 'overwrite']"),
    ("[model]\ngrammar_fills = 'fast'\n", "model.grammar_fills must be one of ['batch', 'vllm']"),
    ("[speculative]\nmethod = 'draft_model'\n", 'needs speculative.draft_model'),
    ("[modle]\n", "unknown section [modle]"),
    ("[sampling]\nstructured_output_backend = 'guidance'\n", "pass 1 uses model.structured_output_backend"),
])
def test_bad_values_name_the_key(tmp_path, extra, message):
    with pytest.raises(SpecError, match=None) as e:
        load_spec(spec_file(tmp_path, BASE + extra))
    assert message in str(e.value)
    assert "job.toml" in str(e.value)


def test_missing_section_and_template_without_columns(tmp_path):
    with pytest.raises(SpecError, match=r"needs an \[prompt\] section"):
        load_spec(spec_file(tmp_path, '[input]\npath = "x"\n[schema]\njson_object = true\n'))
    with pytest.raises(SpecError, match="names no column"):
        load_spec(spec_file(tmp_path, BASE.replace("Read {text}", "Read this")))


def test_invalid_schema_is_caught_at_load(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}}))
    text = BASE.replace('inline = {type = "object", properties = {a = {type = "string"}}}', 'path = "s.json"')
    with pytest.raises(SpecError, match="JSON Schema is invalid at properties/a/type"):
        load_spec(spec_file(tmp_path, text))
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(SpecError, match="the JSON Schema .*s.json does not parse"):
        load_spec(spec_file(tmp_path, text))
    with pytest.raises(SpecError, match="exactly one of path, inline, pydantic or json_object"):
        load_spec(spec_file(tmp_path, text + "json_object = true\n"))


def test_hash_ignores_output_but_not_decoding(tmp_path):
    a = load_spec(spec_file(tmp_path, BASE))
    b = load_spec(spec_file(tmp_path, BASE + "[output]\npath = 'elsewhere'\n"))
    c = load_spec(spec_file(tmp_path, BASE + "[sampling]\nmax_tokens = 7\n"))
    assert a.hash() == b.hash() != c.hash()


def schema_job(tmp_path, schema, extra=""):
    (tmp_path / "s.json").write_text(json.dumps(schema))
    text = BASE.replace('inline = {type = "object", properties = {a = {type = "string"}}}', 'path = "s.json"')
    return spec_file(tmp_path, text + extra)


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
    {"type": "string", "enum": ["positive", "negative"]},
    {"type": ["object", "null"], "properties": {"a": {"type": "integer"}}},
    {"enum": [1, 2, 3]},
])
def test_any_root_type_loads(tmp_path, schema):
    spec = load_spec(schema_job(tmp_path, schema))
    assert spec.schema_doc == schema and spec.model.structured_output_backend == "auto"
    assert spec.schema.check_format


def test_remote_ref_is_refused_with_what_to_do(tmp_path):
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.com/address.json"}}}
    with pytest.raises(SpecError, match=r"refers to a URL \(\$ref 'https://example.com/address.json'\)"
                                        r".*Save the referenced schema next to the schema file"):
        load_spec(schema_job(tmp_path, schema))
    # Refs into the document itself, through its own $id, and to the meta-schemas are not remote.
    local = {"$id": "https://example.com/job.json", "type": "object", "$defs": {"n": {"type": "integer"}},
             "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"$ref": "https://example.com/job.json#/$defs/n"},
                            "c": {"$ref": "https://json-schema.org/draft/2020-12/schema"}}}
    assert load_spec(schema_job(tmp_path, local)).schema_doc == local


def write_json(path: Path, doc) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def sibling_schemas(folder: Path) -> None:
    """A draft-07 job schema referring to a sibling file, which refers to a file in a subfolder, which refers back
    (a cycle through a recursive definition)."""
    write_json(folder / "common.json", {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"address": {"type": "object", "required": ["city"],
                                    "properties": {"city": {"$ref": "#/definitions/name"},
                                                   "parts": {"type": "array", "items": {"$ref": "parts/part.json"}}}},
                        "name": {"type": "string", "minLength": 2},
                        "unused": {"$ref": "nowhere.json"}}})
    write_json(folder / "parts" / "part.json", {
        "type": "object", "properties": {"label": {"$ref": "../common.json#/definitions/name"},
                                         "inner": {"$ref": "#"}}, "additionalProperties": False})


def test_a_schema_file_referring_to_a_sibling_file_is_bundled(tmp_path):
    from batchjson.records import Generation, Prompt
    from batchjson.schema.grammar import choose, grammar_accepts
    from batchjson.schema.shape import local_refs
    from batchjson.schema.validate import Validator

    sibling_schemas(tmp_path)
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "required": ["home"],
              "properties": {"home": {"$ref": "common.json#/definitions/address"},
                             "name": {"$ref": "./common.json#/definitions/name"}}}
    doc = load_spec(schema_job(tmp_path, schema)).schema_doc
    # One self-contained document: the files can go, and the grammar and the validator see the same schema.
    for name in ("common.json", "parts/part.json"):
        (tmp_path / name).unlink()
    assert local_refs(doc)[1] == [] and set(doc["definitions"]) == {"common.json", "part.json"}
    assert "unused" not in doc["definitions"]["common.json"]["definitions"]  # only what the refs reach
    validator = Validator(doc)

    def ok(value) -> bool:
        return validator.check(Generation(Prompt("r", "u", ""), json.dumps(value), "stop")).ok

    good = {"home": {"city": "Oslo", "parts": [{"label": "ab", "inner": {"label": "cd"}}]}, "name": "Al"}
    assert ok(good)
    assert not ok({"home": {"city": "O"}})  # minLength, from common.json
    assert not ok({"home": {"city": "Oslo", "parts": [{"inner": {"label": "x"}}]}})  # part.json -> common.json
    assert not ok({"home": {"city": "Oslo", "parts": [{"extra": 1}]}})  # part.json's own additionalProperties
    choice = choose(doc)
    assert choice.backend and grammar_accepts(choice.relaxed, json.dumps(good, separators=(",", ":")))


def test_refs_relative_to_an_id_and_without_suffix_are_read_from_the_folder(tmp_path):
    from batchjson.schema.shape import local_refs

    write_json(tmp_path / "types.json", {"$id": "https://example.com/schemas/types.json",
                                          "$defs": {"n": {"type": "integer", "minimum": 1}}})
    schema = {"$id": "https://example.com/schemas/job.json", "type": "object",
              "properties": {"a": {"$ref": "types.json#/$defs/n"}, "b": {"$ref": "types#/$defs/n"},
                             "c": {"$ref": "https://example.com/schemas/types.json#/$defs/n"}}}
    doc = load_spec(schema_job(tmp_path, schema)).schema_doc
    assert local_refs(doc)[1] == [] and doc["$defs"]["types.json"] == {"$defs": {"n": {"type": "integer",
                                                                                         "minimum": 1}}}
    assert {p["$ref"] for p in doc["properties"].values()} == {"#/$defs/types.json/$defs/n"}


def test_a_missing_sibling_file_is_refused_naming_the_ref_and_the_path(tmp_path):
    schema = {"type": "object", "properties": {"a": {"$ref": "common.json#/definitions/name"}}}
    with pytest.raises(SpecError, match=r"\$ref 'common.json#/definitions/name' in the JSON Schema refers to the "
                                        rf"file {tmp_path / 'common.json'}, which does not exist"):
        load_spec(schema_job(tmp_path, schema))
    sibling_schemas(tmp_path)
    write_json(tmp_path / "common.json", {"definitions": {"name": {"$ref": "names.json"}}})
    with pytest.raises(SpecError, match=rf"\$ref 'names.json' in the JSON Schema file {tmp_path / 'common.json'} "
                                        rf"refers to the file {tmp_path / 'names.json'}, which does not exist"):
        load_spec(schema_job(tmp_path, schema))
    write_json(tmp_path / "common.json", {"definitions": {}})
    with pytest.raises(SpecError, match=r"'common.json#/definitions/name' in the JSON Schema points to nothing"):
        load_spec(schema_job(tmp_path, schema))


def test_backend_and_format_keys(tmp_path):
    spec = load_spec(schema_job(tmp_path, {"type": "object"}, "[model]\nstructured_output_backend = 'guidance'\n"))
    assert spec.model.structured_output_backend == "guidance"
    with pytest.raises(SpecError, match="model.structured_output_backend must be one of"):
        load_spec(spec_file(tmp_path, BASE + "[model]\nstructured_output_backend = 'xgrammer'\n"))
    spec = load_spec(spec_file(tmp_path, BASE.replace("[schema]\n", "[schema]\ncheck_format = false\n")))
    assert spec.schema.check_format is False
    fills = load_spec(spec_file(tmp_path, BASE + "[model]\ngrammar_fills = 'vllm'\n"))
    assert fills.model.grammar_fills == "vllm" and load_spec(spec_file(tmp_path, BASE)).model.grammar_fills == "batch"
    assert fills.hash() == load_spec(spec_file(tmp_path, BASE)).hash()  # the same masks: a resume may switch


def test_loop_guard_is_on_by_default_in_both_passes_and_can_be_turned_off(tmp_path):
    from batchjson.spec import LOOP_GUARD

    spec = load_spec(spec_file(tmp_path, BASE))
    assert spec.sampling.repetition_detection == spec.fallback.repetition_detection == LOOP_GUARD
    assert LOOP_GUARD == {"max_pattern_size": 64, "min_pattern_size": 8, "min_count": 3}
    assert (spec.fallback.temperature, spec.fallback.top_p, spec.fallback.repetition_penalty, spec.fallback.seed,
            spec.fallback.max_tokens, spec.fallback.n) == (0.7, 1.0, 1.1, 0, 512, 1)
    off = load_spec(spec_file(tmp_path, BASE + "[sampling]\nrepetition_detection = false\n"
                                              "[fallback]\nrepetition_detection = false\nn = 2\n"))
    assert off.sampling.repetition_detection is False and off.fallback.repetition_detection is False
    assert off.fallback.n == 2 and off.hash() != spec.hash()
    # A table replaces the default whole: keys left out take vLLM's defaults, not ours.
    bounded = BASE.replace("a = {type = \"string\"}", "a = {type = \"string\", maxLength = 9}")
    assert load_spec(spec_file(tmp_path, bounded)).sampling.repetition_detection == LOOP_GUARD_BOUNDED
    own = load_spec(spec_file(tmp_path, BASE + "[sampling.repetition_detection]\nmax_pattern_size = 16\nmin_count = 4\n"))
    assert own.sampling.repetition_detection == {"max_pattern_size": 16, "min_count": 4}
    assert own.fallback.repetition_detection == LOOP_GUARD


@pytest.mark.parametrize("extra, message", [
    ("[sampling]\nrepetition_detection = true\n", "repetition_detection must be a table"),
    ("[sampling]\nrepetition_detection = 3\n", "sampling.repetition_detection must be dict or bool"),
    ("[sampling.repetition_detection]\nmax_pattern = 16\n", "repetition_detection.max_pattern is unknown"),
    ("[sampling.repetition_detection]\nmax_pattern_size = 16\n", "min_count >= 2"),
    ("[fallback.repetition_detection]\nmax_pattern_size = 16\nmin_count = 1.5\n", "must be integers"),
    ("[sampling]\nn = 2\n", "sampling.n is not allowed"),
    ("[fallback]\nn = 0\n", "fallback.n must be >= 1"),
])
def test_bad_loop_guard_and_n_name_the_key(tmp_path, extra, message):
    with pytest.raises(SpecError) as e:
        load_spec(spec_file(tmp_path, BASE + extra))
    assert message in str(e.value)


def test_an_inline_schema_reads_sibling_files_from_the_spec_folder(tmp_path):
    write_json(tmp_path / "schemas" / "name.json", {"type": "string", "maxLength": 3})
    spec = load_spec(spec_file(tmp_path, BASE.replace('a = {type = "string"}', 'a = {"$ref" = "schemas/name.json"}')))
    assert spec.schema_doc["properties"]["a"] == {"$ref": "#/$defs/name.json"}
    assert spec.schema_doc["$defs"]["name.json"] == {"type": "string", "maxLength": 3}


def test_a_file_of_another_draft_keeps_its_meaning_inside_the_schema(tmp_path):
    from batchjson.records import Generation, Prompt
    from batchjson.schema.validate import Validator

    # From 2019-09 on, keywords next to a $ref apply; before, they are ignored. And a boolean schema is a target too.
    write_json(tmp_path / "v.json", {"$schema": "https://json-schema.org/draft/2020-12/schema",
                                      "$defs": {"short": {"$ref": "#/$defs/str", "maxLength": 3},
                                                "str": {"type": "string"}, "never": False}})
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"s": {"$ref": "v.json#/$defs/short"}, "x": {"$ref": "v.json#/$defs/never"}}}
    validator = Validator(load_spec(schema_job(tmp_path, schema)).schema_doc)

    def ok(value) -> bool:
        return validator.check(Generation(Prompt("r", "u", ""), json.dumps(value), "stop")).ok

    assert ok({"s": "abc"}) and not ok({"s": "abcd"}) and not ok({"s": 1}) and not ok({"x": 1})


def pydantic_job(tmp_path, ref):
    return spec_file(tmp_path, BASE.replace(BASE.splitlines()[-1], f'pydantic = "{ref}"'))


def test_a_pydantic_model_is_the_schema(tmp_path):
    from batchjson.records import Generation, Prompt
    from batchjson.schema.validate import Validator
    from helpers import import_model, write_model

    ref = write_model(tmp_path)
    spec = load_spec(pydantic_job(tmp_path, ref))
    doc = import_model(tmp_path, ref).model_json_schema()
    assert spec.schema_doc == doc and spec.schema.pydantic == ref
    # What Pydantic writes: nested models and enums under $defs, Optional as anyOf [..., null].
    assert doc["properties"]["place"] == {"$ref": "#/$defs/Place"} and set(doc["$defs"]) == {"Color", "Place"}
    assert {"type": "null"} in doc["properties"]["note"]["anyOf"]
    # Every string and the list are bounded: the light loop guard, as for the same schema written by hand.
    assert spec.sampling.repetition_detection == LOOP_GUARD_BOUNDED

    def ok(value) -> bool:
        return Validator(spec.schema_doc).check(Generation(Prompt("r", "u", ""), json.dumps(value), "stop")).ok

    good = {"name": "ab", "n": 3, "color": "red", "place": {"city": "Oslo"}, "tags": ["x"]}
    assert ok(good) and ok({**good, "note": None, "place": {"city": "Oslo", "zip": "0150"}})
    assert not ok({**good, "color": "green"}) and not ok({**good, "place": {}}) and not ok({**good, "note": 3})


def test_the_hash_covers_the_models_fields_not_its_module(tmp_path):
    from helpers import THING_MODEL, write_model

    spec = load_spec(pydantic_job(tmp_path, write_model(tmp_path)))
    moved = load_spec(pydantic_job(tmp_path, write_model(tmp_path)))  # the same class in another module
    changed = load_spec(pydantic_job(tmp_path, write_model(tmp_path, THING_MODEL.replace("le=9", "le=8"))))
    assert spec.hash() == moved.hash() != changed.hash()


NOT_A_MODEL = "class Thing:\n    pass\n"
NO_JSON_SCHEMA = """
from typing import Callable

from pydantic import BaseModel


class Thing(BaseModel):
    f: Callable[[], int]
"""
REMOTE_REF = """
from pydantic import BaseModel, Field


class Thing(BaseModel):
    a: str = Field(json_schema_extra={"$ref": "https://example.com/a.json"})
"""


@pytest.mark.parametrize("source, ref, message", [
    (None, "things", "schema.pydantic must be 'module:Class' (e.g. 'invoices:Invoice'"),
    (None, "nowhere_at_all:Thing", "schema.pydantic: no module 'nowhere_at_all' in {folder} or the installed "
     "packages. Put nowhere_at_all.py next to the spec, or install the package that holds it."),
    ("import not_a_module_either\n", "{module}:Thing", "schema.pydantic: importing {module} failed at "
     "{folder}/{module}.py:1: ModuleNotFoundError: No module named 'not_a_module_either'"),
    ("class Thing(:\n", "{module}:Thing", "schema.pydantic: importing {module} failed: SyntaxError"),
    (None, "{module}:Thingy", "schema.pydantic: the module {module} ({folder}/{module}.py) has no 'Thingy'"),
    (NOT_A_MODEL, "{module}:Thing", "schema.pydantic: the class {module}.Thing is not a Pydantic model (a "
     "subclass of pydantic.BaseModel). Give the model class"),
    (NO_JSON_SCHEMA, "{module}:Thing", "schema.pydantic: Pydantic cannot write a JSON Schema for {module}:Thing: "
     "Cannot generate a JsonSchema for core_schema.CallableSchema"),
    (REMOTE_REF, "{module}:Thing", "schema.pydantic ({module}:Thing): the JSON Schema refers to a URL ($ref "
     "'https://example.com/a.json'): batchjson does not fetch schemas"),
])
def test_a_bad_model_names_the_key_and_what_to_do(tmp_path, source, ref, message):
    from helpers import THING_MODEL, write_model

    module = write_model(tmp_path, source or THING_MODEL).split(":")[0]
    with pytest.raises(SpecError) as e:
        load_spec(pydantic_job(tmp_path, ref.format(module=module)))
    assert message.format(module=module, folder=tmp_path) in str(e.value)


def test_pydantic_is_one_of_the_schema_sources(tmp_path):
    with pytest.raises(SpecError, match="schema.pydantic: int 3 is not a Pydantic model"):
        load_spec(spec_file(tmp_path, BASE.replace(BASE.splitlines()[-1], "pydantic = 3")))
    with pytest.raises(SpecError, match=r"exactly one of path, inline, pydantic or json_object = true, got "
                                        r"\['inline', 'pydantic'\]"):
        load_spec(spec_file(tmp_path, BASE + 'pydantic = "a:B"\n'))


def test_a_removed_key_is_ignored_with_a_warning_to_delete_it(tmp_path):
    plain = load_spec(spec_file(tmp_path, BASE + "[model]\nmax_in_flight = 8\n"))
    with pytest.warns(UserWarning, match=r"model.parallel_grammar is ignored: .* Delete the line"):
        old = load_spec(spec_file(tmp_path, BASE + "[model]\nmax_in_flight = 8\nparallel_grammar = true\n"))
    assert old == plain and old.hash() == plain.hash()  # a run started before the upgrade resumes


MESSAGES = BASE.replace('template = "Read {text}"', 'messages = "messages"')


def test_a_messages_column_is_the_whole_prompt(tmp_path):
    spec = load_spec(spec_file(tmp_path, MESSAGES))
    assert spec.prompt.columns == ("messages",) and spec.prompt.template == ""
    # a template job's hash does not see the key it does not set
    assert "messages" not in load_spec(spec_file(tmp_path, BASE)).fingerprint()["prompt"]
    assert spec.hash() != load_spec(spec_file(tmp_path, BASE)).hash()


@pytest.mark.parametrize("prompt, message", [
    ('messages = "messages"\ntemplate = "Read {text}"', "prompt.messages is the whole prompt"),
    ('messages = "messages"\nsystem = "Be brief."', "prompt.messages is the whole prompt"),
    ('system = "Be brief."', r"\[prompt\] needs template .* or messages"),
])
def test_messages_and_template_are_one_or_the_other(tmp_path, prompt, message):
    with pytest.raises(SpecError, match=message):
        load_spec(spec_file(tmp_path, BASE.replace('template = "Read {text}"', prompt)))

"""Job specs: good ones load, bad ones fail at load with a message naming the key and what is allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchjson.errors import SpecError
from batchjson.spec import load_spec

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
    assert spec.speculative.method == "ngram" and spec.prompt.columns == ("text",)


@pytest.mark.parametrize("extra, message", [
    ("[input.extra]\n", "unknown key input.extra; allowed keys in [input]"),
    ("[sampling]\ntemprature = 0.5\n", "unknown key sampling.temprature"),
    ("[sampling]\ntemperature = -1.0\n", "sampling.temperature must be >= 0"),
    ("[sampling]\nmax_tokens = 'many'\n", "sampling.max_tokens must be int, got str 'many'"),
    ("[output]\nif_exists = 'append'\n", "output.if_exists must be one of ['resume', 'fail', 'overwrite']"),
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
    with pytest.raises(SpecError, match="exactly one of path, inline or json_object"):
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
    with pytest.raises(SpecError, match=r"refers to another document \(\$ref 'https://example.com/address.json'\)"
                                        r".*Inline the referenced schema under \"\$defs\""):
        load_spec(schema_job(tmp_path, schema))
    # Refs into the document itself, through its own $id, and to the meta-schemas are not remote.
    local = {"$id": "https://example.com/job.json", "type": "object", "$defs": {"n": {"type": "integer"}},
             "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"$ref": "https://example.com/job.json#/$defs/n"},
                            "c": {"$ref": "https://json-schema.org/draft/2020-12/schema"}}}
    assert load_spec(schema_job(tmp_path, local)).schema_doc == local


def test_backend_and_format_keys(tmp_path):
    spec = load_spec(schema_job(tmp_path, {"type": "object"}, "[model]\nstructured_output_backend = 'guidance'\n"))
    assert spec.model.structured_output_backend == "guidance"
    with pytest.raises(SpecError, match="model.structured_output_backend must be one of"):
        load_spec(spec_file(tmp_path, BASE + "[model]\nstructured_output_backend = 'xgrammer'\n"))
    spec = load_spec(spec_file(tmp_path, BASE.replace("[schema]\n", "[schema]\ncheck_format = false\n")))
    assert spec.schema.check_format is False


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

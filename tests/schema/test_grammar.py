"""Grammar backend choice and coverage, on the real backends (xgrammar, llguidance) as vLLM configures them."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from batchjson.schema import grammar
from batchjson.schema.grammar import choose, coverage, grammar_accepts, relax

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "multipleOf": 5},
                                           "tags": {"type": "array", "uniqueItems": True}},
          "required": ["name"]}
ROOT = Path(__file__).resolve().parents[2]


def test_auto_picks_a_backend_and_says_why():
    choice = choose(PERSON)
    assert choice.backend == "xgrammar" and "auto" in choice.reason
    assert grammar_accepts(choice.relaxed, '{"name":"Ann","age":35,"tags":[1,"x"]}')
    assert not grammar_accepts(choice.relaxed, '{"age":35}')  # required is decoded


def test_auto_chooses_alike_on_a_busy_machine(monkeypatch):
    """A build slowed by a loaded machine (12 s, where the sample's grammar took 4.5-6.2 s on a busy one) changes
    nothing: auto still takes xgrammar, because it builds the schema; only a refusal passes a backend over."""
    real = grammar.build

    def slow(relaxed, disable_any_whitespace=True):
        if relaxed.backend == "xgrammar":
            time.sleep(12)
        return real(relaxed, disable_any_whitespace)

    monkeypatch.setattr(grammar, "build", slow)
    monkeypatch.setattr(grammar, "_CACHE", {})
    schema = json.loads((ROOT / "sample_data" / "schema.json").read_text())
    choice = choose(schema)
    assert choice.backend == "xgrammar", choice.reason
    assert re.fullmatch(r"auto: the first of xgrammar/guidance, and it builds this schema; built in \d+ ms", choice.reason)


def test_a_build_that_never_ends_counts_as_a_refusal_and_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(grammar, "build", lambda relaxed, *_: time.sleep(3) if relaxed.backend == "xgrammar" else None)
    monkeypatch.setattr(grammar, "_CACHE", {})
    choice = choose(PERSON, limit_s=0.5)
    assert choice.backend == "guidance"
    assert choice.reason.startswith("auto: xgrammar refused it: its build ran over 0.5s; guidance built it in ")


def test_explicit_backend_is_kept_and_relaxed_so_vllm_accepts_it():
    choice = choose(PERSON, "xgrammar")
    assert choice.backend == "xgrammar" and choice.reason == "set in the spec"
    # vLLM refuses multipleOf and uniqueItems for xgrammar: they are left to validation, not sent.
    assert {k for _, k, _ in choice.relaxed.dropped} == {"multipleOf", "uniqueItems"}
    assert "multipleOf" not in json.dumps(choice.grammar_schema)
    assert grammar_accepts(choice.relaxed, '{"name":"Ann","age":33,"tags":[1,1]}')  # a hole: validation catches it


def test_auto_falls_back_when_the_first_backend_refuses(monkeypatch):
    # Two patternProperties that overlap: llguidance refuses them, xgrammar decodes the object with any keys.
    monkeypatch.setattr(grammar, "AUTO_ORDER", ("guidance", "xgrammar"))
    schema = {"type": "object", "patternProperties": {"^a": {"type": "string"}, ".*": {"type": "integer"}}}
    choice = choose(schema)
    assert choice.backend == "xgrammar" and "guidance refused" in choice.reason


def test_coverage_names_holes_and_over_constraint():
    lines = coverage(PERSON, choose(PERSON, "xgrammar")).lines()
    assert lines[0].startswith("grammar enforces: type, properties, required")
    assert "multipleOf" in lines[1] and "uniqueItems" in lines[1]
    assert "over-constrained" in lines[2] and "undeclared properties" in lines[2]
    # The over-constraint is real: xgrammar refuses an answer with an extra property, which the schema allows.
    assert not grammar_accepts(choose(PERSON, "xgrammar").relaxed, '{"name":"Ann","nick":"A"}')
    assert grammar_accepts(choose(PERSON, "guidance").relaxed, '{"name":"Ann","nick":"A"}')
    assert not any("over-constrained" in line for line in coverage(PERSON, choose(PERSON, "guidance")).lines())


def test_xgrammar_gets_no_minimum_length_and_the_bounded_strings_hole_is_named():
    """xgrammar's length-bounded strings take no escape and let a raw tab through: with minLength given to
    validation, an escaped quote or a newline can be decoded; maxLength stays (it ends a string) and check names its
    hole. The second assertion fails once xgrammar mends its strings: then minLength can go back in the grammar."""
    name = {"type": "object", "properties": {"a": {"type": "string", "minLength": 1}}, "required": ["a"]}
    choice = choose(name, "xgrammar")
    assert choice.relaxed.schema["properties"]["a"] == {"type": "string"}
    assert grammar_accepts(choice.relaxed, '{"a":"say \\"hi\\"\\nbye"}')
    assert not grammar_accepts(grammar.Relaxed("xgrammar", name), '{"a":"say \\"hi\\""}')
    assert grammar_accepts(grammar.Relaxed("xgrammar", name), '{"a":"x\ty"}')  # not JSON
    lines = coverage(name, choice).lines()
    assert "minLength (xgrammar's bounded strings take no escapes" in lines[1]
    bounded = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 9}}, "required": ["a"]}
    lines = coverage(bounded, choose(bounded, "xgrammar")).lines()
    assert "maxLength" in lines[0] and "/properties/a: a string with maxLength or a pattern" in lines[-1]
    assert "minLength" in choose(name, "guidance").relaxed.schema["properties"]["a"]  # llguidance keeps it
    assert relax(name, "outlines").schema["properties"]["a"] == {"type": "string", "minLength": 1}  # xgrammar's hole
    counted = {"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}
    assert relax(counted, "outlines").schema["minProperties"] == 1  # llguidance's relaxation is llguidance's alone


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "array", "items": {"type": "string", "enum": ["a", "b"]}}, '["a","b"]', '["c"]'),
    ({"type": "string", "enum": ["yes", "no"]}, '"yes"', '"maybe"'),
    ({"type": "integer", "minimum": 0}, "7", "-1"),
])
def test_non_object_roots_have_a_grammar(schema, good, bad):
    for backend in ("auto", "xgrammar"):
        relaxed = choose(schema, backend).relaxed
        assert grammar_accepts(relaxed, good) and not grammar_accepts(relaxed, bad)


def test_no_free_whitespace_in_either_backend():
    for backend in ("guidance", "xgrammar"):
        relaxed = relax({"type": "object", "properties": {"a": {"type": "integer"}}}, backend)
        assert grammar_accepts(relaxed, '{"a":1}') and not grammar_accepts(relaxed, '{"a": 1}')


@pytest.mark.engine
def test_array_root_runs_on_the_auto_backend(tmp_path, tiny_model, engines):
    """A non-object root through the real engine: every output is an array of the enum, in the typed value column."""
    import pyarrow.dataset as ds

    from batchjson.job import run_job
    from batchjson.spec import load_spec
    from helpers import write_job, write_rows

    schema = {"type": "array", "items": {"type": "string", "enum": ["red", "green"]}, "maxItems": 3}
    write_rows(tmp_path / "in.parquet", 6)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", schema=schema, speculative="ngram")
    report = run_job(load_spec(job), engine_factory=engines, progress=False)
    assert report.passes["pass1"].grammar.startswith("xgrammar (auto: the first of xgrammar/guidance, and it builds")
    out = ds.dataset(sorted(str(p) for p in (tmp_path / "out").glob("*.parquet"))).to_table()
    assert report.valid == out.num_rows > 0
    assert all(set(v) <= {"red", "green"} for v in out.column("value").to_pylist())


@pytest.mark.engine
def test_a_schema_referring_to_a_sibling_file_runs(tmp_path, tiny_model, engines):
    """The bundled schema through the real engine: the grammar decodes the sibling's enum, validation agrees."""
    import json

    import pyarrow.dataset as ds

    from batchjson.job import run_job
    from batchjson.spec import load_spec
    from helpers import write_job, write_rows

    (tmp_path / "colors.json").write_text(json.dumps({"definitions": {"color": {"type": "string",
                                                                               "enum": ["red", "green"]}}}))
    schema = {"type": "object", "properties": {"color": {"$ref": "colors.json#/definitions/color"}},
              "required": ["color"], "additionalProperties": False}
    write_rows(tmp_path / "in.parquet", 6)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", schema=schema, speculative="none")
    report = run_job(load_spec(job), engine_factory=engines, progress=False)
    out = ds.dataset(sorted(str(p) for p in (tmp_path / "out").glob("*.parquet"))).to_table()
    assert report.valid == out.num_rows > 0 and report.rejected == 0
    assert {json.loads(v)["color"] for v in out.column("json").to_pylist()} <= {"red", "green"}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_both_backends_decode_what_pydantic_writes(tmp_path, backend):
    """$defs + $ref (a nested model, an enum) and anyOf [..., null] are in the grammar, not left to validation."""
    from helpers import import_model, write_model

    schema = import_model(tmp_path, write_model(tmp_path)).model_json_schema()
    choice = choose(schema, backend)
    assert choice.relaxed.dropped == () and coverage(schema, choice).validation_only == ()

    def accepts(**fields) -> bool:  # keys in the model's order: the grammar writes properties in declared order
        value = {"name": "ab", "n": 3, "color": "red", "place": {"city": "Oslo"}, "tags": ["x"], **fields}
        value = {k: value[k] for k in schema["properties"] if k in value}
        return grammar_accepts(choice.relaxed, json.dumps(value, separators=(",", ":")))

    assert accepts() and accepts(note=None, place={"city": "Oslo", "zip": None})
    assert accepts(note="hi", place={"city": "Oslo", "zip": "0150"}, color="blue")
    for bad in ({"color": "green"}, {"place": {}}, {"place": {"city": "Oslo", "zip": 150}}, {"note": 3},
                {"tags": ["x", "y", "z"]}, {"name": "toolong"}):
        assert not accepts(**bad), bad

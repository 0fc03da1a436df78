"""The Python API: a job built in Python (with a Pydantic model class as its schema) is the job its TOML gives, and
runs, checks and verifies as the command line does."""

from __future__ import annotations

import tomllib

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

import batchjson
from batchjson.errors import SpecError
from helpers import assert_exactly_once, import_model, write_job, write_model, write_rows

THING_COLUMNS = {"name": pa.string(), "n": pa.int64(), "color": pa.string(), "note": pa.string(),
                 "tags": pa.list_(pa.string())}


def thing_jobs(tmp_path, tiny_model, rows: int = 3, **job):
    """The same job twice: from its TOML file (schema.pydantic = 'module:Thing'), and built in Python from the
    TOML's tables with the class itself (writing to `py-out`); and the class."""
    write_rows(tmp_path / "in.parquet", rows)
    ref = write_model(tmp_path)
    toml = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", pydantic=ref, **job)
    thing = import_model(tmp_path, ref)
    sections = tomllib.loads(toml.read_text())
    sections["schema"] = {"pydantic": thing}
    sections["output"]["path"] = "py-out"
    return batchjson.load_job(toml), batchjson.build_job(tmp_path, **sections), thing


def test_a_job_built_in_python_with_the_model_class_is_its_toml_job(tmp_path, tiny_model):
    from_toml, from_python, thing = thing_jobs(tmp_path, tiny_model)
    assert from_python.schema_doc == from_toml.schema_doc == thing.model_json_schema()
    assert from_python.hash() == from_toml.hash()  # either can resume a folder the other began
    assert from_python.schema.pydantic == from_toml.schema.pydantic  # the class's import path, as in the TOML
    result = batchjson.check_job(from_python)
    assert (result.files, result.rows, result.spec_hash) == (1, 3, from_toml.hash())
    assert result.typed_columns == {name: str(kind) for name, kind in THING_COLUMNS.items()}
    assert result.grammar == {"pass1": "xgrammar", "pass2": "xgrammar"}


def test_build_job_refuses_what_is_not_a_model_class(tmp_path):
    thing = import_model(tmp_path, write_model(tmp_path))
    sections = {"input": {"path": "in.parquet"}, "prompt": {"template": "Describe: {text}"}}
    with pytest.raises(SpecError, match="schema.pydantic: the class builtins.dict is not a Pydantic model"):
        batchjson.build_job(tmp_path, schema={"pydantic": dict}, **sections)
    instance = thing.model_validate({"name": "a", "n": 1, "color": "red", "place": {"city": "b"}, "tags": []})
    with pytest.raises(SpecError, match="schema.pydantic: an instance of Thing: give the class itself"):
        batchjson.build_job(tmp_path, schema={"pydantic": instance}, **sections)
    with pytest.raises(SpecError, match=r"unknown section \[outputs\]"):
        batchjson.build_job(tmp_path, schema={"pydantic": thing}, outputs={"path": "x"}, **sections)


def output_table(folder):
    return ds.dataset(sorted(str(p) for p in folder.glob("*.parquet")), format="parquet").to_table()


@pytest.mark.engine
def test_a_pydantic_job_runs_from_python_and_from_toml_exactly_once(tmp_path, tiny_model, engines):
    """Both forms on the real engine (one engine start: no speculation, so pass 2 reuses pass 1's engine): every
    row once in output or rejects, valid rows parse as the model, and typed columns hold the model's values."""
    from_toml, from_python, thing = thing_jobs(tmp_path, tiny_model, rows=12, speculative="none", max_tokens=128,
                                               fallback_max_tokens=160)
    ids = [f"r{i:05d}" for i in range(12)]
    for job, out in ((from_python, tmp_path / "py-out"), (from_toml, tmp_path / "out")):
        report = batchjson.run_job(job, engine_factory=engines, progress=False)
        assert report.input_rows == 12 and report.valid + report.rejected == 12
        assert report.valid > 0, report.summary()  # else the checks of typed values below check nothing
        assert_exactly_once(ids, out, out / "_rejects")
        verdict = batchjson.verify_job(job)
        assert verdict.complete and (verdict.output_rows, verdict.reject_rows) == (report.valid, report.rejected)
        table = output_table(out)
        assert {name: table.schema.field(name).type for name in THING_COLUMNS} == THING_COLUMNS
        assert "place" not in table.column_names  # a nested model: in the json column only
        for row in table.to_pylist():
            value = thing.model_validate_json(row["json"])
            assert row["color"] == value.color.value and row["tags"] == value.tags and row["note"] == value.note
            assert (row["name"], row["n"]) == (value.name, value.n)

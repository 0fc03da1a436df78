"""The command line on real files: messages and exit codes a pipeline can rely on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchjson.cli import main
from helpers import ENV, write_job, write_rows

ROOT = Path(__file__).parent.parent


def test_check_reports_rows_and_columns():
    result = CliRunner().invoke(main, ["check", str(ROOT / "jobs" / "sample.toml")])
    assert result.exit_code == 0, result.output
    assert "120 rows" in result.output and "['id', 'text', 'source']" in result.output


def test_check_names_each_engine_patch_the_installed_vllm_leaves_off_and_why():
    """`batchjson check` says which of batchjson's engine patches are off on the installed vLLM, each with its
    reason, without starting an engine (the CPU build, 0.32: the grammars' work beside the launch, the drafted
    fills)."""
    from batchjson.engine.vllm import versions

    result = CliRunner().invoke(main, ["check", str(ROOT / "jobs" / "sample.toml")])
    assert result.exit_code == 0, result.output
    version = versions.installed_version()
    off = versions.off_here(version, {})
    assert f"vLLM {version}: batchjson's engine patches on: " in result.output
    for name, why in off.items():
        assert f"  off: {name} (" in result.output and why in result.output, name
    if version.startswith("0.32."):
        assert set(off) == {"grammar_ahead", "drafted_fills"}
        assert "off: grammar_ahead (the grammars' work beside the forward's launch; ahead.py): vLLM 0.32.0 is not a " \
               "version this patch was read on (0.26.x, 0.34.x)" in result.output.replace(version, "0.32.0")


def test_the_command_keeps_its_exit_codes_and_its_whole_output(tmp_path):
    """`batchjson` ends without Python's teardown (cli.entry): what it printed into a pipe still arrives, and the
    exit code is the command's."""
    command = [sys.executable, "-m", "batchjson", "check"]
    done = subprocess.run([*command, str(ROOT / "jobs" / "sample.toml")], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert done.returncode == 0 and "120 rows" in done.stdout, done.stderr[-2000:]
    job = tmp_path / "job.toml"
    job.write_text((ROOT / "jobs" / "sample.toml").read_text().replace("[sampling]", "[sampling]\ntop_k = 3"))
    done = subprocess.run([*command, str(job)], capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 2 and "unknown key sampling.top_k" in done.stderr
    done = subprocess.run([sys.executable, "-m", "batchjson", "--version"], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert done.returncode == 0 and "version" in done.stdout


def test_check_bad_spec_exits_2_with_the_key(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text((ROOT / "jobs" / "sample.toml").read_text().replace("[sampling]", "[sampling]\ntop_k = 3"))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 2
    assert "unknown key sampling.top_k" in result.output


def test_check_missing_input_column_exits_2(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 3)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    job.write_text(job.read_text().replace('passthrough = ["source"]', 'passthrough = ["origin"]'))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 2 and "column 'origin' is missing" in result.output


def test_input_can_be_overridden_per_run(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 3)
    write_rows(tmp_path / "dt=2026-11-30" / "part.parquet", 5)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    result = CliRunner().invoke(main, ["check", str(job), "--input", str(tmp_path / "dt=2026-11-30")])
    assert result.exit_code == 0 and "5 rows" in result.output
    result = CliRunner().invoke(main, ["check", str(job), "--input", str(tmp_path / "dt=2026-12-01")])
    assert result.exit_code == 2 and "no Parquet file at" in result.output


def test_shard_argument_is_checked(tmp_path):
    result = CliRunner().invoke(main, ["run", str(ROOT / "jobs" / "sample.toml"), "--shard", "3/3"])
    assert result.exit_code == 2 and "expected I/N" in result.output


@pytest.mark.engine
def test_run_exits_3_when_rejects_exceed_the_threshold(tmp_path, tiny_model, engines, monkeypatch):
    monkeypatch.setattr("batchjson.engine.VllmEngines", lambda: engines)  # the command's run on the session's engines
    write_rows(tmp_path / "in.parquet", 6)
    # Three tokens cannot hold an object and the fallback is off: every row is rejected as truncated.
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", max_tokens=3, speculative="none")
    job.write_text(job.read_text().replace("max_reject_rate = 1.0", "max_reject_rate = 0.5")
                   .replace("[fallback]", "[fallback]\nenabled = false"))
    result = CliRunner().invoke(main, ["run", str(job), "--json-report"])
    assert result.exit_code == 3, result.output
    report = json.loads(result.output[result.output.index("{"):result.output.rindex("}") + 1])
    assert report["rejects_by_reason"] == {"truncated": 6} and report["over_threshold"]
    assert "exceed output.max_reject_rate" in result.output


def test_check_reports_grammar_coverage_and_formats(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 3)
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                               "v": {"type": "string", "format": "semver"},
                                               "n": {"type": "integer", "multipleOf": 5}}}
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", schema=schema)
    job.write_text(job.read_text().replace("[model]", "[model]\nstructured_output_backend = \"xgrammar\""))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "pass1 grammar: xgrammar (set in the spec)" in lines
    assert any(line.startswith("  validation only") and "multipleOf" in line for line in lines)
    assert any("over-constrained" in line and "undeclared properties" in line for line in lines)
    assert "format: validation checks date-time" in lines
    assert any(line.startswith("format: nothing checks semver") for line in lines)


def test_check_names_the_value_column_of_a_non_object_root(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 3)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", schema={"type": "string", "enum": ["yes", "no"]})
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 0, result.output
    assert "schema: root string -> output column json and value (string)" in result.output
    assert "pass1 grammar: xgrammar (auto" in result.output


def test_check_a_schema_file_referring_to_a_sibling_file(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 3)
    schema = {"type": "object", "properties": {"who": {"$ref": "people.json#/definitions/person"}}, "required": ["who"]}
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", schema=schema)
    result = CliRunner().invoke(main, ["check", str(job)])
    missing = f"refers to the file {tmp_path / 'people.json'}, which does not exist"
    assert result.exit_code == 2 and missing in " ".join(result.output.split()), result.output
    (tmp_path / "people.json").write_text(json.dumps({"definitions": {"person": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}}}))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 0, result.output
    assert "pass1 grammar: xgrammar (auto" in result.output and "maxLength" in result.output


def test_check_a_pydantic_schema_names_its_columns_and_grammar(tmp_path, tiny_model):
    from helpers import write_model

    write_rows(tmp_path / "in.parquet", 3)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", pydantic=write_model(tmp_path))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert ("schema: root object -> output column json and typed columns name (string), n (int64), color (string), "
            "note (string), tags (list<item: string>); only in json: place") in lines
    grammar = next(i for i, line in enumerate(lines) if line.startswith("pass1 grammar: xgrammar (auto"))
    assert lines[grammar + 1].startswith("  grammar enforces: ")
    assert all(k in lines[grammar + 1].split(", ") for k in ("$ref", "anyOf", "enum", "maxLength", "maxItems"))
    # Pydantic leaves additionalProperties unset, which xgrammar's strict mode reads as false.
    assert "undeclared properties" in lines[grammar + 2] and "pass2 grammar: same as pass1" in lines


def test_a_model_that_does_not_import_exits_2_naming_the_key(tmp_path, tiny_model):
    from helpers import write_model

    write_rows(tmp_path / "in.parquet", 3)
    ref = write_model(tmp_path, "from pydantic import BaseModel\n\n\nclass Thing(BaseModel):\n    n: itn\n")
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", pydantic=ref)
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 2, result.output
    assert f"schema.pydantic: importing {ref.split(':')[0]} failed at " in result.output
    assert "NameError: name 'itn' is not defined" in result.output and "Traceback" not in result.output


def test_check_the_sample_job_with_its_schema_as_a_pydantic_model(tmp_path):
    """jobs/invoice_model.py, the README's example, gives the sample job's columns and grammar."""
    import shutil

    shutil.copy(ROOT / "jobs" / "invoice_model.py", tmp_path)
    text = (ROOT / "jobs" / "sample.toml").read_text()
    job = tmp_path / "job.toml"
    job.write_text(text.replace("../sample_data/sample.parquet", str(ROOT / "sample_data" / "sample.parquet"))
                   .replace('path = "../sample_data/schema.json"', 'pydantic = "invoice_model:Invoice"')
                   .replace('path = "../out/sample"', f'path = "{tmp_path / "out"}"'))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 0, result.output
    assert ("schema: root object -> output column json and typed columns vendor (string), currency (string), "
            "category (string), total (double); only in json: items") in result.output.splitlines()
    assert "pass1 grammar: xgrammar (auto" in result.output
    over = next(line for line in result.output.splitlines() if "over-constrained" in line)
    assert "undeclared properties" not in over  # the model forbids extra fields: only its bounded strings' hole
    assert "/properties/vendor, /$defs/Item/properties/description: a string with maxLength" in over


def test_check_names_a_model_folder_a_run_could_not_load_and_an_empty_method(tmp_path, tiny_model):
    """`check` finds what a run would stop on at its engine's start: a model.path without a model, and an empty
    speculative.method, each exit 2 with the key; a model that is there is named."""
    write_rows(tmp_path / "in.parquet", 3)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 0 and f"model: {tiny_model}" in result.output, result.output
    (tmp_path / "empty").mkdir()
    job.write_text(job.read_text().replace(f'path = "{tiny_model}"', f'path = "{tmp_path / "empty"}"'))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 2 and "model.path: no Hugging Face model folder" in result.output, result.output
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="")
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 2 and "speculative.method is empty" in result.output, result.output

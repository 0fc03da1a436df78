"""OpenAI Batch files in and out: the mapping of requests to jobs, the refusals (exit 2, naming line and field), and
the round trip (each custom_id once, in the requests' order, errors with their reasons) parsed by the `openai`
package's own models. The round trips run on the fake engine; the last test runs the real one (SmolLM2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from openai.types.chat import ChatCompletion

from batchjson.api import load_job, run_job
from batchjson.cli import main
from batchjson.engine.fake import Answer, FakeEngines
from batchjson.openai_batch import export_results, import_requests

URL = "/v1/chat/completions"
# The two requests of OpenAI's Batch API guide ("Preparing your batch file"), verbatim: plain text answers.
DOC_EXAMPLE = """\
{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are a helpful assistant."},{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}
{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are an unhelpful assistant."},{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}
"""
GREETING = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 24}}, "required": ["reply"],
            "additionalProperties": False}
COUNTED = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 24},
                                            "n": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["reply"]}


def structured(schema: dict = GREETING, name: str = "greeting") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


def doc_example() -> str:
    """The guide's example with the Structured Outputs response_format each request of a JSON job carries."""
    lines = [json.loads(line) for line in DOC_EXAMPLE.splitlines()]
    for line in lines:
        line["body"]["response_format"] = structured()
    return "".join(json.dumps(line) + "\n" for line in lines)


def request(custom_id: str, text: str = "Say hi.", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": URL,
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}],
                     "response_format": structured()} | body}


def write(path: Path, requests: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in requests))
    return path


def import_cli(*args):
    return CliRunner().invoke(main, ["import-openai", *map(str, args)])


def test_the_guides_example_maps_to_one_job_that_loads(tmp_path, tiny_model):
    requests = tmp_path / "batch.jsonl"
    requests.write_text(doc_example())
    result = import_cli(requests, tmp_path / "work", "--model", tiny_model)
    assert result.exit_code == 0, result.output
    assert "batchjson run" in result.output and "batchjson export-openai" in result.output
    job = load_job(tmp_path / "work" / "greeting" / "job.toml")
    assert job.prompt.messages == "messages" and job.input.id_column == "custom_id"
    assert job.schema_doc == GREETING and job.model.path == tiny_model
    # max_tokens is both passes' budget; the temperature the requests leave out is OpenAI's default
    assert (job.sampling.max_tokens, job.sampling.temperature, job.sampling.top_p) == (1000, 1.0, 1.0)
    assert job.fallback.max_tokens == 1000
    rows = pq.read_table(tmp_path / "work" / "greeting" / "input").to_pylist()
    assert rows[1] == {"custom_id": "request-2", "line": 2, "messages": [
        {"role": "system", "content": "You are an unhelpful assistant."}, {"role": "user", "content": "Hello world!"}]}


def test_the_guides_example_as_it_is_asks_for_text_and_is_refused(tmp_path):
    requests = tmp_path / "batch.jsonl"
    requests.write_text(DOC_EXAMPLE)
    result = import_cli(requests, tmp_path / "work")
    assert result.exit_code == 2 and "line 1: body.response_format: is missing: batchjson makes JSON" in \
        result.output and "(and 1 more lines like it, from line 2 on)" in result.output, result.output


def test_requests_group_into_one_job_per_schema_and_sampling_settings(tmp_path, tiny_model):
    lines = [request("a1", temperature=0), request("b1", response_format=structured(COUNTED, "counted")),
             request("a2", temperature=0), request("c1", temperature=0.5),
             request("d1", response_format={"type": "json_object"}),
             # the newer names: a developer turn is a system turn, text parts are one text, max_completion_tokens
             request("a3", temperature=0, max_completion_tokens=64, seed=7, user="u-1", messages=[
                 {"role": "developer", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi."}]}])]
    imported = import_requests(write(tmp_path / "batch.jsonl", lines), tmp_path / "work", model=tiny_model)
    assert imported.requests == 6
    assert imported.jobs == {"greeting": 2, "counted": 1, "greeting-2": 1, "json_object": 1, "greeting-3": 1}
    work = tmp_path / "work"
    assert json.loads((work / "openai_batch.json").read_text())["jobs"] == imported.jobs
    assert load_job(work / "greeting-2" / "job.toml").sampling.temperature == 0.5
    assert load_job(work / "json_object" / "job.toml").schema.json_object
    assert load_job(work / "counted" / "job.toml").schema_doc == COUNTED
    newer = load_job(work / "greeting-3" / "job.toml")
    assert (newer.sampling.max_tokens, newer.sampling.seed, newer.sampling.temperature) == (64, 7, 0.0)
    assert pq.read_table(work / "greeting-3" / "input").to_pylist()[0]["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say\nhi."}]
    assert pq.read_table(work / "greeting" / "input").column("line").to_pylist() == [1, 3]


@pytest.mark.parametrize("line, where", [
    ('{"custom_id": "x", "method": "POST"', "line 2: is not valid JSON"),
    ('["a list"]', "line 2: is not a JSON object"),
    (request("r1"), "line 2: custom_id: 'r1' is also the custom_id of line 1"),
    ({**request("x"), "custom_id": 7}, "line 2: custom_id: is missing or not a non-empty string"),
    ({**request("x"), "url": "/v1/embeddings"}, "line 2: url: must be /v1/chat/completions"),
    ({**request("x"), "method": "GET"}, "line 2: method: must be POST"),
    ({**request("x"), "extra": 1}, "line 2: extra: is not a field of a Batch request"),
    ({k: v for k, v in request("x").items() if k != "body"}, "line 2: body: is missing"),
    (request("x", n=2), "line 2: body.n: asks for 2 answers"),
    (request("x", tools=[{"type": "function"}]), "line 2: body.tools: is not supported"),
    (request("x", stop=["\n"]), "line 2: body.stop: is not supported"),
    (request("x", messages=[]), "line 2: body.messages: must be a non-empty list"),
    (request("x", messages=[{"role": "tool", "content": "3"}]), "line 2: body.messages[0].role: must be one of"),
    (request("x", messages=[{"role": "user", "content": "hi", "name": "ann"}]),
     "line 2: body.messages[0].name: is not supported"),
    (request("x", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "line 2: body.messages[0].content[0]: only text parts"),
    (request("x", response_format=None), "line 2: body.response_format: is missing: batchjson makes JSON"),
    (request("x", response_format={"type": "text"}), "line 2: body.response_format.type: must be json_schema"),
    (request("x", response_format=structured({"type": "objekt"})),
     "line 2: body.response_format.json_schema.schema: the JSON Schema is invalid"),
    (request("x", response_format=structured({"$ref": "https://example.com/s.json"})),
     "line 2: body.response_format.json_schema.schema: the JSON Schema refers to a URL"),
    (request("x", max_tokens="ten"), "line 2: body.max_tokens: must be a whole number, got 'ten'"),
    (request("x", temperature=-1), "line 2: body.temperature: must be >= 0"),
    (request("x", max_tokens=5, max_completion_tokens=6), "line 2: body.max_completion_tokens: differs"),
])
def test_a_request_that_does_not_fit_is_refused_naming_its_line_and_field(tmp_path, line, where):
    requests = write(tmp_path / "batch.jsonl", [request("r1"), line, request("r3")])
    result = import_cli(requests, tmp_path / "work")
    assert result.exit_code == 2 and where in result.output, result.output
    assert "Traceback" not in result.output and "nothing was written" in result.output
    assert not (tmp_path / "work").exists()


def test_alike_faults_are_named_once_with_their_count(tmp_path):
    lines = [request(f"r{i}", n=3) for i in range(50)] + [request("ok"), "{"]
    result = import_cli(write(tmp_path / "batch.jsonl", lines), tmp_path / "work")
    assert result.exit_code == 2
    assert "51 request(s) cannot be imported" in result.output
    assert "line 1: body.n: asks for 3 answers per request; batchjson makes one (and 49 more lines like it, from " \
           "line 2 on)" in result.output and "line 52: is not valid JSON" in result.output


def test_import_wants_a_new_folder(tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "x").write_text("")
    result = import_cli(write(tmp_path / "batch.jsonl", [request("a")]), tmp_path / "work")
    assert result.exit_code == 2 and "is not an empty folder" in result.output


SCHEMAS = [("greeting", GREETING, 0.0), ("counted", COUNTED, 0.0), ("greeting", GREETING, 0.7)]


def interleaved(n: int) -> list[dict]:
    """n requests dealt over three jobs (two schemas, two temperatures), so that the export has to merge them."""
    out = []
    for i in range(n):
        name, schema, temperature = SCHEMAS[i % 7 % 3]
        out.append(request(f"req-{i}", f"Say hi to {i}.", temperature=temperature, max_tokens=32,
                           response_format=structured(schema, name)))
    return out


ANSWER = Answer('{"reply":"hi"}', "stop", 6)


def run_all(work: Path, valid: float = 0.6):
    engines = FakeEngines(valid=valid, seed=5, answers=[ANSWER])
    for job in sorted(work.glob("*/job.toml")):
        run_job(load_job(job), engine_factory=engines, progress=False)


def test_round_trip_each_request_once_in_order_with_reasons(tmp_path, tiny_model):
    n = 2500  # the jobs' units are 1024 rows: several units per job, each unit's rows over both passes
    requests = write(tmp_path / "batch.jsonl", interleaved(n))
    work = tmp_path / "work"
    imported = import_requests(requests, work, model=tiny_model)
    assert len(imported.jobs) == 3 and sum(imported.jobs.values()) == n
    first, second, _ = sorted(work.glob("*/job.toml"))
    run_job(load_job(first), engine_factory=FakeEngines(valid=1.0, answers=[ANSWER]),
            progress=False)
    unfinished = CliRunner().invoke(main, ["export-openai", str(work), str(tmp_path / "out.jsonl")])
    assert unfinished.exit_code == 2 and f"{second}: not run yet. Run `batchjson run {second}`" in \
        unfinished.output, unfinished.output
    assert not (tmp_path / "out.jsonl").exists()

    run_all(work)
    result = CliRunner().invoke(main, ["export-openai", str(work), str(tmp_path / "out.jsonl"),
                                       "--errors", str(tmp_path / "err.jsonl")])
    assert result.exit_code == 0, result.output
    answers = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    errors = [orjson.loads(line) for line in (tmp_path / "err.jsonl").read_bytes().splitlines()]
    order = {f"req-{i}": i for i in range(n)}
    for lines in (answers, errors):  # each file in the requests' order
        assert [order[a["custom_id"]] for a in lines] == sorted(order[a["custom_id"]] for a in lines)
    assert sorted(order[a["custom_id"]] for a in answers + errors) == list(range(n))  # each request once
    assert answers and errors and f"wrote {len(answers)} answers" in result.output
    for a in answers:
        assert a["error"] is None and a["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(a["response"]["body"])
        assert completion.choices[0].message.content == '{"reply":"hi"}'
        assert completion.choices[0].finish_reason == "stop" and completion.model == "tiny-model"
        assert completion.usage.completion_tokens == 6 and completion.usage.total_tokens == 6 + \
            completion.usage.prompt_tokens
    reasons = {"json_parse", "truncated", "repetition", "schema"}
    assert all(e["response"] is None and e["error"]["code"] in reasons and e["error"]["message"] for e in errors)
    assert len({a["id"] for a in answers + errors}) == n
    assert len({a["response"]["body"]["system_fingerprint"] for a in answers}) == 3  # each job's own spec hash

    # Again, without --errors: one file, the same lines in the requests' order, the same bytes for the answers.
    export_results(work, tmp_path / "all.jsonl")
    both = [orjson.loads(line) for line in (tmp_path / "all.jsonl").read_bytes().splitlines()]
    assert [a["custom_id"] for a in both] == [f"req-{i}" for i in range(n)]
    assert [a for a in both if a["error"] is None] == answers


@pytest.mark.engine
def test_the_guides_example_round_trip_on_the_real_engine(tmp_path):
    """import-openai, batchjson run, export-openai as a user types them, on the embedded SmolLM2 (CPU)."""
    requests = tmp_path / "batch.jsonl"
    requests.write_text(doc_example())
    env = os.environ | {"PYTHONUNBUFFERED": "1"}

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "batchjson", *map(str, args)], capture_output=True, text=True,
                              timeout=1200, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    cli("import-openai", requests, tmp_path / "work")
    cli("run", tmp_path / "work" / "greeting" / "job.toml")
    cli("export-openai", tmp_path / "work", tmp_path / "out.jsonl", "--errors", tmp_path / "err.jsonl")
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    errors = [json.loads(line) for line in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert sorted(a["custom_id"] for a in answers + errors) == ["request-1", "request-2"]
    for a in answers:
        completion = ChatCompletion.model_validate(a["response"]["body"])
        assert isinstance(json.loads(completion.choices[0].message.content)["reply"], str)
        assert completion.model == "SmolLM2-135M-Instruct" and completion.usage.prompt_tokens > 10
    assert all(e["error"]["code"] and e["error"]["message"] for e in errors)


def test_a_folder_changed_after_its_run_is_refused_not_exported(tmp_path, tiny_model):
    work = tmp_path / "work"
    import_requests(write(tmp_path / "batch.jsonl", interleaved(40)), work, model=tiny_model)
    run_all(work, valid=1.0)
    job = sorted(work.glob("*/job.toml"))[0]
    (job.parent / "out" / "_report.json").unlink()  # no report: the export verifies the job itself
    assert export_results(work, tmp_path / "all.jsonl").answers == 40

    other = sorted(work.glob("*/job.toml"))[1]
    for changed, says in ((other, "batchjson verify"), (job, "missing")):  # with its run's report, and without
        next((changed.parent / "out").glob("p1-*.parquet")).unlink()
        result = CliRunner().invoke(main, ["export-openai", str(work), str(tmp_path / "again.jsonl")])
        assert result.exit_code == 2 and says in result.output and "batchjson run" in result.output, result.output
        assert not (tmp_path / "again.jsonl").exists()
    result = CliRunner().invoke(main, ["export-openai", str(tmp_path), str(tmp_path / "again.jsonl")])
    assert result.exit_code == 2 and "no openai_batch.json here" in result.output

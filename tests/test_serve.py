"""`batchjson serve`: the Batch API's documented flow through the official `openai` client (the real CPU engine, once),
the errors OpenAI would return for bad input, a SIGKILLed server that resumes to exactly once, cancel, expiry and the
API key (the fake engine)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn
from click.testing import CliRunner
from openai import OpenAI
from openai.types.chat import ChatCompletion

from batchjson.cli import main
from batchjson.engine.fake import FakeEngines
from batchjson.serve import listen
from batchjson.serve.app import make_app
from batchjson.serve.runner import Runner
from batchjson.serve.store import Store
from helpers import ENV, HERE, TINY_SCHEMA

URL = "/v1/chat/completions"


def request(custom_id: str, text: str = "Name a city.", **body) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "strict": True, "schema": TINY_SCHEMA}}
    return {"custom_id": custom_id, "method": "POST", "url": URL,
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}],
                     "response_format": fmt, "max_tokens": 48} | body}


def jsonl(requests: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in requests).encode()


@contextlib.contextmanager
def server(state, engines, model: str, api_key: str | None = None, **runner):
    """The server in this process (a thread), on a free port; its base URL."""
    store = Store(state)
    sock = listen("127.0.0.1", 0)
    app = make_app(store, Runner(store, model, engines, **runner), api_key)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        srv.should_exit = True
        thread.join(60)
        store.close()


def raw(url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """A request without the client: (status, the JSON body)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers or {}), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def client(base_url: str, api_key: str = "unused") -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def wait(c: OpenAI, batch_id: str, until=("completed", "failed", "expired", "cancelled"), timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        batch = c.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)


def answering(c: OpenAI, batch_id: str, n: int, timeout: float = 120) -> None:
    """Wait until the running batch has answered `n` requests."""
    deadline = time.monotonic() + timeout
    while (batch := c.batches.retrieve(batch_id)).request_counts.completed < n:
        assert batch.status in ("validating", "in_progress") and time.monotonic() < deadline, batch
        time.sleep(0.05)


def lines(c: OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


def run_batch(c: OpenAI, requests: list, window: str = "24h"):
    upload = c.files.create(file=("batch.jsonl", jsonl(requests)), purpose="batch")
    return c.batches.create(input_file_id=upload.id, endpoint=URL, completion_window=window)


@pytest.mark.engine
def test_the_documented_flow_with_the_openai_client_on_the_real_engine(tmp_path, tiny_model, engines):
    """OpenAI's Batch guide, step by step, with only base_url changed: upload, create, poll, download."""
    requests = [request(f"request-{i}", f"Describe item {i}.") for i in range(4)]
    with server(tmp_path / "state", engines, tiny_model) as base_url:
        c = client(base_url)
        batch_input_file = c.files.create(file=io.BytesIO(jsonl(requests)), purpose="batch")
        assert batch_input_file.purpose == "batch" and batch_input_file.bytes == len(jsonl(requests))
        batch = c.batches.create(input_file_id=batch_input_file.id, endpoint=URL, completion_window="24h",
                                 metadata={"description": "nightly eval job"})
        assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 4
        batch = wait(c, batch.id, timeout=600)
        assert batch.status == "completed", batch
        answers, errors = lines(c, batch.output_file_id), lines(c, batch.error_file_id)
        assert sorted(a["custom_id"] for a in answers + errors) == [f"request-{i}" for i in range(4)]
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (4, len(answers), len(errors))
        for a in answers:
            completion = ChatCompletion.model_validate(a["response"]["body"])
            assert set(json.loads(completion.choices[0].message.content)) <= {"name", "n"}
        assert all(e["response"] is None and e["error"]["code"] for e in errors)
        assert batch.metadata == {"description": "nightly eval job"} and batch.completed_at >= batch.created_at
        assert [b.id for b in c.batches.list()] == [batch.id]


@pytest.fixture
def fake(tmp_path, tiny_model):
    """An in-process server on the fake engine (60% of first answers valid)."""
    with server(tmp_path / "state", FakeEngines(valid=0.6, seed=3), tiny_model) as base_url:
        yield client(base_url)


def test_a_batch_on_the_fake_engine_answers_each_request_once_with_failures_in_the_error_file(fake):
    batch = run_batch(fake, [request(f"r{i}") for i in range(30)])
    batch = wait(fake, batch.id)
    answers, errors = lines(fake, batch.output_file_id), lines(fake, batch.error_file_id)
    assert batch.status == "completed" and batch.request_counts.completed == len(answers) > 0
    assert batch.request_counts.failed == len(errors) > 0  # the fake's failures that pass 2 did not rescue
    assert [a["custom_id"] for a in answers + errors].count("r0") == 1
    assert sorted(a["custom_id"] for a in answers + errors) == sorted(f"r{i}" for i in range(30))
    assert {e["error"]["code"] for e in errors} <= {"json_parse", "schema", "truncated"}
    out, err = fake.files.retrieve(batch.output_file_id), fake.files.retrieve(batch.error_file_id)
    assert out.purpose == err.purpose == "batch_output" and out.bytes > 0  # the API's purpose of both
    assert fake.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        fake.files.retrieve(batch.input_file_id)


def test_bad_input_gets_openai_errors_and_stores_nothing(fake, tmp_path):
    files = tmp_path / "state" / "files"
    with pytest.raises(openai.BadRequestError) as refused:  # the upload: each line checked alone
        fake.files.create(file=("b.jsonl", jsonl([request("a"), "{not json", request("c", n=2)])), purpose="batch")
    error = refused.value.body
    assert refused.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert "line 2: is not valid JSON" in error["message"] and "line 3: body.n: asks for 2" in error["message"]
    assert list(files.iterdir()) == []  # nothing half-written, nothing kept

    dup = fake.files.create(file=("d.jsonl", jsonl([request("a"), request("a")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:  # the batch: the file as a whole
        fake.batches.create(input_file_id=dup.id, endpoint=URL, completion_window="24h")
    assert "line 2: custom_id: 'a' is also the custom_id of line 1" in refused.value.body["message"]
    assert refused.value.body["param"] == "input_file_id"
    assert list((tmp_path / "state" / "batches").iterdir()) == []

    with pytest.raises(openai.NotFoundError) as unknown:
        fake.batches.create(input_file_id="file-nope", endpoint=URL, completion_window="24h")
    assert unknown.value.body["message"] == "No such File object: file-nope"
    with pytest.raises(openai.NotFoundError):
        fake.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        fake.files.content("../../etc/passwd")
    good = fake.files.create(file=("g.jsonl", jsonl([request("a")])), purpose="batch")
    for field, kwargs in (("endpoint", {"endpoint": "/v1/embeddings", "completion_window": "24h"}),
                          ("completion_window", {"endpoint": URL, "completion_window": "1 week"})):
        with pytest.raises(openai.BadRequestError) as refused:
            fake.batches.create(input_file_id=good.id, **kwargs)
        assert refused.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as refused:
        fake.files.create(file=("g.jsonl", b"{}\n"), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"
    status, body = raw(str(fake.base_url) + "batches", b"{", {"content-type": "application/json"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "not JSON" in body["error"]["message"]
    form = b'--x\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n{}\r\n--x--\r\n'
    status, body = raw(str(fake.base_url) + "files", form, {"content-type": "multipart/form-data; boundary=x"})
    assert status == 400 and body["error"]["param"] == "purpose"  # no purpose
    status, body = raw(str(fake.base_url) + "nothing")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


def test_over_the_request_limit_is_refused(tmp_path, tiny_model):
    with server(tmp_path / "state", FakeEngines(), tiny_model, max_requests=3) as base_url:
        c = client(base_url)
        upload = c.files.create(file=("b.jsonl", jsonl([request(f"r{i}") for i in range(4)])), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:
            c.batches.create(input_file_id=upload.id, endpoint=URL, completion_window="24h")
        assert "holds 4 requests; a batch takes at most 3" in refused.value.body["message"]


def test_cancel_delivers_what_finished_and_the_rest_as_cancelled(tmp_path, tiny_model):
    import batchjson.openai_batch.requests as imports

    engines = FakeEngines(valid=1.0, delay=0.01)
    with server(tmp_path / "state", engines, tiny_model) as base_url:
        c = client(base_url)
        rows, imports.ROWS_PER_GROUP = imports.ROWS_PER_GROUP, 10
        try:
            running = run_batch(c, [request(f"r{i}") for i in range(400)])
            queued = run_batch(c, [request(f"q{i}") for i in range(5)])
        finally:
            imports.ROWS_PER_GROUP = rows
        answering(c, running.id, 20)
        assert c.batches.cancel(queued.id).status == "cancelled"  # waiting its turn: ends at once
        assert c.batches.cancel(running.id).status == "cancelling"
        done = wait(c, running.id)
        assert done.status == "cancelled" and done.cancelled_at
        answers, errors = lines(c, done.output_file_id), lines(c, done.error_file_id)
        assert sorted(a["custom_id"] for a in answers + errors) == sorted(f"r{i}" for i in range(400))
        assert 20 <= len(answers) < 400 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        assert done.request_counts.completed == len(answers) and done.request_counts.failed == len(errors)
        q = c.batches.retrieve(queued.id)
        assert q.output_file_id is None and len(lines(c, q.error_file_id)) == 5
        with pytest.raises(openai.BadRequestError):
            c.batches.cancel(running.id)


def test_the_completion_window_expires_a_batch_with_its_finished_work(tmp_path, tiny_model):
    import batchjson.openai_batch.requests as imports

    with server(tmp_path / "state", FakeEngines(valid=1.0, delay=0.02), tiny_model) as base_url:
        c = client(base_url)
        wait(c, run_batch(c, [request("warm-up")]).id)  # a first run's imports take seconds of a short window
        rows, imports.ROWS_PER_GROUP = imports.ROWS_PER_GROUP, 10
        try:
            batch = run_batch(c, [request(f"r{i}") for i in range(400)], window="2s")
        finally:
            imports.ROWS_PER_GROUP = rows
        done = wait(c, batch.id)
        assert done.status == "expired" and done.expired_at and done.expires_at == done.created_at + 2
        answers, errors = lines(c, done.output_file_id), lines(c, done.error_file_id)
        assert sorted(a["custom_id"] for a in answers + errors) == sorted(f"r{i}" for i in range(400))
        assert answers and {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_an_api_key_refuses_other_callers(tmp_path, tiny_model):
    with server(tmp_path / "state", FakeEngines(), tiny_model, api_key="s3cret") as base_url:
        with pytest.raises(openai.AuthenticationError) as refused:
            client(base_url, "wrong").files.list()
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        assert raw(base_url + "/batches")[0] == 401
        assert client(base_url, "s3cret").files.list().data == []


def test_a_killed_server_resumes_its_batch_to_exactly_once(tmp_path, tiny_model):
    """SIGKILL mid-batch, then a new server on the same folder: the batch completes, each custom_id once."""
    state, port = tmp_path / "state", _free_port()
    env = ENV | {"FAKE_DELAY": "0.005", "FAKE_ROWS_PER_GROUP": "10", "FAKE_VALID": "0.7"}

    def start():
        proc = subprocess.Popen([sys.executable, str(HERE / "fake_server.py"), str(state), str(port), tiny_model],
                                env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                raw(f"http://127.0.0.1:{port}/v1/files")
                return proc
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)

    first = start()
    try:
        c = client(f"http://127.0.0.1:{port}/v1")
        batch = run_batch(c, [request(f"r{i}") for i in range(300)])
        answering(c, batch.id, 30)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        second = start()
        try:
            assert client(f"http://127.0.0.1:{port}/v1").batches.retrieve(batch.id).status in (
                "in_progress", "finalizing", "completed")
            done = wait(c, batch.id)
            answers, errors = lines(c, done.output_file_id), lines(c, done.error_file_id)
        finally:
            second.terminate()
            assert second.wait(30) == -signal.SIGTERM  # a clean stop (uvicorn ends by the signal it caught)
    finally:
        if first.poll() is None:
            first.kill()
    assert done.status == "completed"
    ids = [a["custom_id"] for a in answers + errors]
    assert sorted(ids) == sorted(f"r{i}" for i in range(300))  # each once: none lost, none doubled
    assert (done.request_counts.completed, done.request_counts.failed) == (len(answers), len(errors))


def _free_port() -> int:
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_user_mistakes_exit_2_with_a_message(tmp_path):
    (tmp_path / "file").touch()
    result = CliRunner().invoke(main, ["serve", "--state", str(tmp_path / "file" / "state")])
    assert result.exit_code == 2 and "cannot be written (Not a directory)" in result.output, result.output
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            result = CliRunner().invoke(main, ["serve", "--state", str(locked / "state")])
            assert result.exit_code == 2 and "cannot be written (Permission denied)" in result.output, result.output
        finally:
            locked.chmod(0o700)
    store = Store(tmp_path / "busy")
    try:
        result = CliRunner().invoke(main, ["serve", "--state", str(tmp_path / "busy")])
        assert result.exit_code == 2 and "another batchjson serve uses this folder" in result.output
    finally:
        store.close()
    sock = listen("127.0.0.1", 0)
    try:
        port = str(sock.getsockname()[1])
        result = CliRunner().invoke(main, ["serve", "--state", str(tmp_path / "s"), "--port", port])
        assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output, result.output
    finally:
        sock.close()
    result = CliRunner().invoke(main, ["serve", "--state", str(tmp_path / "s"), "--model", str(tmp_path)])
    assert result.exit_code == 2 and f"--model {tmp_path}: no Hugging Face model folder" in result.output
    result = CliRunner().invoke(main, ["serve", "--state", str(tmp_path / "s"), "--port", "99999"])
    assert result.exit_code == 2 and "--port" in result.output


def test_an_address_others_reach_needs_an_api_key_or_insecure_said_first(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--state", str(tmp_path / "s"), "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 2 and "--host 0.0.0.0: other hosts reach this address" in result.output, result.output
    assert "--api-key" in result.output and "--insecure" in result.output
    proc = subprocess.Popen([sys.executable, "-m", "batchjson", "serve", "--state", str(tmp_path / "s"), "--host",
                             "0.0.0.0", "--port", "0", "--insecure"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        first, second = proc.stdout.readline(), proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(30)
    assert first.startswith("batchjson serve: --insecure: no API key on 0.0.0.0"), first
    assert re.match(r"batchjson serve: listening on http://0\.0\.0\.0:\d+/v1 ", second), second


class NoEngines(FakeEngines):
    """A factory whose engine cannot start, as a model folder that is not one."""

    def start(self, spec, decoding, speculative):
        from batchjson.errors import EngineError

        raise EngineError("no model at /models/gone: check --model.")


def test_an_engine_that_cannot_start_fails_the_batch_and_a_bug_is_a_500_without_traceback(tmp_path, tiny_model,
                                                                                         monkeypatch):
    with server(tmp_path / "state", NoEngines(), tiny_model) as base_url:
        c = client(base_url)
        done = wait(c, run_batch(c, [request("a")]).id)
        assert done.status == "failed" and done.failed_at
        assert done.errors.data[0].message.endswith("no model at /models/gone: check --model.")

        def bug(self):
            raise RuntimeError("[internal] a bug")

        monkeypatch.setattr(Store, "files", bug)
        with pytest.raises(openai.InternalServerError) as broken:
            c.files.list()
        assert broken.value.body == {"message": "The server had an error while processing your request (see its log).",
                                     "type": "server_error", "param": None, "code": None}


def test_a_damaged_state_folder_is_set_aside_and_the_rest_is_served_and_run(tmp_path, tiny_model, caplog):
    """Records that do not parse (cut short, a stray file, `[]`) are moved to quarantine/, named in the log and as
    the error of their batch or file; a file without its bytes is a 404; the runner outlives a record damaged while
    it runs."""
    state = tmp_path / "state"
    with server(state, FakeEngines(valid=1.0), tiny_model) as base_url:
        c = client(base_url)
        cut = wait(c, run_batch(c, [request("a")]).id)
        kept = c.files.create(file=("b.jsonl", jsonl([request("b")])), purpose="batch")
    record = state / "batches" / f"{cut.id}.json"
    record.write_bytes(record.read_bytes()[:40])
    (state / "batches" / "notes.json").write_text("not json")
    (state / "files" / "README.json").write_text("[]")
    (state / "files" / kept.id).unlink()  # its bytes, not its record
    with server(state, FakeEngines(valid=1.0), tiny_model) as base_url:
        c = client(base_url)
        damaged = c.batches.retrieve(cut.id)
        assert damaged.status == "failed" and damaged.errors.data[0].code == "damaged_record"
        assert "did not parse" in damaged.errors.data[0].message and "quarantine" in damaged.errors.data[0].message
        assert [b.id for b in c.batches.list()] == [cut.id]
        assert kept.id in [f.id for f in c.files.list()]
        with pytest.raises(openai.NotFoundError):
            c.files.content(kept.id)
        (state / "batches" / "zz.json").write_text("{")  # while it runs
        batch = run_batch(c, [request("c")])
        assert wait(c, batch.id, timeout=30).status == "completed"
    assert len(list((state / "quarantine").iterdir())) == 4
    assert sum("did not parse" in r.getMessage() for r in caplog.records) == 4


def test_a_stopped_server_keeps_its_batch_running_and_the_next_one_ends_it_when_its_window_passed(tmp_path,
                                                                                                   tiny_model):
    """A clean stop (SIGTERM) leaves the running batch in_progress; a server started after its window ends it as
    expired, with what the first one finished."""
    import batchjson.openai_batch.requests as imports

    state = tmp_path / "state"
    with server(state, FakeEngines(valid=1.0, delay=0.01), tiny_model) as base_url:
        c = client(base_url)
        rows, imports.ROWS_PER_GROUP = imports.ROWS_PER_GROUP, 10
        try:
            batch = run_batch(c, [request(f"r{i}") for i in range(400)])
        finally:
            imports.ROWS_PER_GROUP = rows
        answering(c, batch.id, 20)
    saved = state / "batches" / f"{batch.id}.json"
    stopped = json.loads(saved.read_text())
    assert stopped["status"] == "in_progress"
    saved.write_text(json.dumps(stopped | {"expires_at": int(time.time()) - 1}))  # the window passed meanwhile
    with server(state, FakeEngines(valid=1.0), tiny_model) as base_url:
        c = client(base_url)
        done = wait(c, batch.id)
        answers, errors = lines(c, done.output_file_id), lines(c, done.error_file_id)
    assert done.status == "expired" and 20 <= len(answers) < 400
    assert sorted(a["custom_id"] for a in answers + errors) == sorted(f"r{i}" for i in range(400))
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}


def test_the_docs_client_code_runs_as_it_is_against_the_server(fake, tmp_path, monkeypatch):
    """docs/openai-batch.md's example, with the server's own address for its base_url and a shorter poll."""
    readme = (HERE.parent / "docs" / "openai-batch.md").read_text()
    section = readme[readme.index("## The Batch API as a server"):]
    code = section[section.index("```python\n") + 10:section.index("```\n", section.index("```python\n") + 10)]
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and "time.sleep(60)" in code
    code = code.replace("http://127.0.0.1:8000/v1", str(fake.base_url).rstrip("/")).replace("sleep(60)", "sleep(0.1)")
    (tmp_path / "batch_requests.jsonl").write_bytes(jsonl([request(f"r{i}") for i in range(10)]))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/openai-batch.md", "exec"), scope)
    assert scope["batch"].status == "completed"
    got = [json.loads(x)["custom_id"] for text in (scope["results"], scope["errors"]) for x in text.splitlines()]
    assert sorted(got) == sorted(f"r{i}" for i in range(10))

"""Nothing lost, nothing twice: kills of the runner, deaths of the engine, signals, and bad input."""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zmq
from vllm.v1.engine.exceptions import EngineDeadError

from batchjson.engine import VllmEngines
from batchjson.engine.vllm_engine import VllmEngine
from batchjson.errors import EngineDied, EngineError, InputError, OutputError, ResumeConflict
from batchjson.job import run_job
from batchjson.records import Prompt, Stage
from batchjson.storage import Storage, location
from batchjson.spec import load_spec
from helpers import (assert_exactly_once, codes, gone_within, ids_of, wait_for_engine_process, write_job,
                     write_rows)

HERE = Path(__file__).parent
pytestmark = pytest.mark.engine


def test_runner_killed_in_pass_2_with_pass_1_in_flight_then_resumed(tmp_path, tiny_model, engines):
    """The runner alone SIGKILLed after 17 results of pass 2, pass 1 maybe still in flight (every row goes through
    both passes), as the OOM killer would: its engine processes die with it, and the rerun completes, each row once.
    Kills at every step of a commit, in pass 1 and in pass 2 with pass 1 in flight, are test_exactly_once's, on the
    fake engine."""
    write_rows(tmp_path / "in.parquet", 30)
    # Three tokens hold no object: every row fails pass 1 and goes through pass 2 too.
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", max_tokens=3, batch_size=8)
    out = tmp_path / "out"
    env = os.environ | {"PYTHONPATH": f"{HERE.parent}:{HERE}"}
    run = subprocess.run([sys.executable, str(HERE / "crash_runner.py"), str(job), str(out), "2", "17"], env=env,
                         start_new_session=True, capture_output=True, text=True, timeout=600)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    (started,) = re.findall(r"^started: (.*)$", run.stdout, re.MULTILINE)
    assert started, "the engine runs in processes of its own"
    assert not gone_within(processes(started.split()), 30), "processes outlived the runner"
    committed = ids_of(out) + ids_of(out / "_rejects")
    assert not [k for k, v in collections.Counter(committed).items() if v > 1]
    assert run_job(load_spec(job), str(out), engine_factory=engines, progress=False).resumed
    assert_exactly_once([f"r{i:05d}" for i in range(30)], out, out / "_rejects")


def processes(pids: list[str]) -> list[psutil.Process]:
    """The processes of these ids still there (a zombie included)."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append(psutil.Process(int(pid)))
    return found


def engine_processes(before: set[psutil.Process]) -> list[psutil.Process]:
    """The engine core started since `before` (this process's children then) and what it started; not
    multiprocessing's helpers nor the reaper, which are no part of the engine."""
    mine = [p for p in set(psutil.Process().children(recursive=True)) - before if "EngineCore" in p.name()]
    return mine + [c for p in mine for c in p.children(recursive=True)]


class KillEngineProcess(VllmEngines):
    """An engine factory whose first engine, a fresh one, has its processes SIGKILLed after `after` results; the
    engines started after it (the restarts) are `later`'s, the session's shared ones."""

    def __init__(self, after: int, later):
        self.after, self.later, self.speculative_seen = after, later, []

    def start(self, spec, decoding, speculative):
        self.speculative_seen.append(speculative is not None)
        if len(self.speculative_seen) > 1:
            return self.later.start(spec, decoding, speculative)
        before = set(psutil.Process().children(recursive=True))
        engine = super().start(spec, decoding, speculative)
        mine = engine_processes(before)
        inner_stream = engine.stream

        def stream(prompts, stop=None):
            for i, gen in enumerate(inner_stream(prompts, stop), 1):
                yield gen
                if i == self.after:
                    for p in mine:
                        p.kill()
        engine.stream = stream
        return engine


def test_an_engine_killed_mid_pass_is_restarted_and_its_rows_decoded_again(tmp_path, tiny_model, engines):
    """The engine's processes SIGKILLed after 6 results: a new engine, still speculative, decodes the rows in flight
    and the rest, each once. Repeated deaths (speculation off after two, the run's end after three) are
    test_exactly_once's, on the fake engine."""
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", extra="")
    job.write_text(job.read_text().replace("[fallback]", "[fallback]\nenabled = false"))
    factory = KillEngineProcess(after=6, later=engines)
    report = run_job(load_spec(job), engine_factory=factory, progress=False)
    assert factory.speculative_seen == [True, True]
    assert "engine-restarted" in codes(report.passes["pass1"]) and report.passes["pass1"].engine_starts == 2
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")


class RacingClient:
    """vLLM's sync client as its monitor thread leaves it when the engine core dies between ensure_alive() and the
    send: marked dead (or, `dead` False, alive), its socket closed."""

    def __init__(self, dead: bool):
        self.resources = types.SimpleNamespace(engine_dead=dead, engine_manager=None)

    def enqueue(self, *args, **kwargs):
        raise zmq.error.ZMQError(errno.ENOTSOCK)


@pytest.mark.parametrize("dead", [True, False])
def test_a_request_added_as_the_engine_dies_is_a_death_not_a_crash(dead):
    """A prompt added while vLLM shuts a dead engine's client down fails on a closed socket, not with EngineDeadError:
    that is the engine's death (a restart re-feeds the prompt); the same error from a living engine is not."""
    engine = object.__new__(VllmEngine)
    client = RacingClient(dead)
    engine.llm = types.SimpleNamespace(enqueue=client.enqueue, llm_engine=types.SimpleNamespace(engine_core=client))
    engine.max_in_flight, engine.params, engine._closed = 4, {Stage.FIRST: None}, threading.Event()
    engine._dead, engine._refused = EngineDeadError, (ValueError,)
    prompt = Prompt("r1", "u1", "text")
    with pytest.raises(EngineDied if dead else zmq.error.ZMQError) as died:
        next(engine.stream([prompt]))
    if dead:
        assert died.value.in_flight == [prompt] and isinstance(died.value.__cause__, zmq.error.ZMQError)


def test_sigterm_stops_cleanly_and_the_rerun_finishes(tmp_path, tiny_model, engines):
    """`batchjson run` stopped by SIGTERM after its first commit exits 130 and says how to resume; the rerun (in this
    process, on a shared engine: what the command prints is the report's summary) resumes and finishes, each row
    once."""
    write_rows(tmp_path / "in.parquet", 48)  # 12 units: the signal comes within a second of the first commit
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4, max_tokens=64)
    cmd = [sys.executable, "-m", "batchjson", "run", str(job)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "out").glob("p1-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stdout and "run the same command again to resume" in stderr
    rerun = run_job(load_spec(job), engine_factory=engines, progress=False)
    assert rerun.resumed and "[resumed]" in rerun.summary()
    assert_exactly_once([f"r{i:05d}" for i in range(48)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_bad_rows_are_rejected_with_their_reason(tmp_path, tiny_model, engines):
    texts = ["fine one", None, "   ", "word " * 600, "fine two", "dupe"]
    table = pa.table({"id": ["a", "b", "c", "d", "e", "a"], "text": texts, "source": ["s"] * 6})
    pq.write_table(table, tmp_path / "in.parquet")
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))
    report = run_job(spec, engine_factory=engines, progress=False)
    rejects = {(r["id"], r["reason"]): r["detail"] for r in
               pq.ParquetDataset(tmp_path / "out" / "_rejects").read().to_pylist()}
    assert rejects[("b", "empty_prompt")] == "column 'text' is null or empty"
    assert ("c", "empty_prompt") in rejects
    assert re.search("maximum (context|model) length", rejects[("d", "prompt_too_long")])
    assert "also appears in unit" in rejects[("a", "duplicate_id")]
    assert report.input_rows == 6 and report.valid + report.rejected == 6


def test_null_id_names_file_and_row(tmp_path, tiny_model, engines):
    pq.write_table(pa.table({"id": ["a", None], "text": ["x", "y"], "source": ["s", "s"]}), tmp_path / "in.parquet")
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))
    with pytest.raises(InputError, match=r"in.parquet: row 1 has a null 'id'"):
        run_job(spec, engine_factory=engines, progress=False)
    assert not (tmp_path / "out").exists()  # nothing claimed: the fixed input starts a clean run


def test_full_disk_fails_clearly_then_resumes(tmp_path, tiny_model, engines, monkeypatch):
    write_rows(tmp_path / "in.parquet", 16)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4))
    real_write, writes = location.pq.write_table, []

    def write_until_full(table, path, **kw):
        writes.append(path)
        if len(writes) > 2:  # a narrow fault: the disk fills up after two part files
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(table, path, **kw)
    monkeypatch.setattr(location.pq, "write_table", write_until_full)
    with pytest.raises(OutputError, match=r"the disk is full \(No space left on device; .* free\)\. Free space on it "
                                          "and run the same command again"):
        run_job(spec, engine_factory=engines, progress=False)
    assert not Storage(tmp_path / "out").commits.stray(), "a visible part file always belongs to a committed unit"
    monkeypatch.setattr(location.pq, "write_table", real_write)
    report = run_job(spec, engine_factory=engines, progress=False)
    assert report.resumed
    assert_exactly_once([f"r{i:05d}" for i in range(16)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_output_folder_guards(tmp_path, tiny_model, engines):
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    spec = load_spec(job)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="cannot create"):
        run_job(spec, str(tmp_path / "file" / "out"), engine_factory=engines, progress=False)

    run_job(spec, engine_factory=engines, progress=False)
    # A change that is not the engine's (the shared engine decodes the fresh run too).
    job.write_text(job.read_text().replace('template = "Describe: {text}"', 'template = "Name it: {text}"'))
    changed = load_spec(job)
    with pytest.raises(ResumeConflict, match=r"changed: prompt.template: 'Describe: \{text\}' -> 'Name it: "
                                             r"\{text\}'.*--fresh"):
        run_job(changed, engine_factory=engines, progress=False)
    assert run_job(changed, fresh=True, engine_factory=engines, progress=False).resumed is False

    holder = Storage(tmp_path / "out")
    holder.claim()  # another run holds the folder
    with pytest.raises(OutputError, match="another batchjson run is writing to"):
        run_job(changed, engine_factory=engines, progress=False)
    holder.close()


def test_schema_no_backend_can_compile_fails_at_start(tmp_path, tiny_model):
    # A required property that no value satisfies: every grammar backend refuses it, before any engine starts.
    write_rows(tmp_path / "in.parquet", 2)
    schema = {"type": "object", "properties": {"a": False}, "required": ["a"]}
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", schema=schema, speculative="none"))
    with pytest.raises(EngineError, match=r"no grammar backend builds this schema \(xgrammar: .*; guidance: Unsatisfiable"):
        run_job(spec, progress=False)


@pytest.mark.parametrize("after", [0.0, 3.0])
def test_engine_processes_die_with_a_runner_killed_during_the_engine_start(tmp_path, tiny_model, after):
    """Killed as its engine process has just been spawned, or while that process imports vLLM (before vLLM's
    handshake, where the plugin ties it to the runner): nothing is left, the resource tracker included."""
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="none")
    proc = subprocess.Popen([sys.executable, "-m", "batchjson", "run", str(job)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    runner = wait_for_engine_process(proc)
    time.sleep(after)
    children = runner.children(recursive=True)
    proc.kill()  # the runner alone, as the OOM killer would
    proc.wait()
    assert not gone_within(children, 10), "processes outlived the runner"


class StopEngineProcess(VllmEngines):
    """An engine factory whose first engine has its processes stopped (SIGSTOP) after `after` results: alive, silent."""

    def __init__(self, after: int):
        self.after, self.stopped = after, []

    def start(self, spec, decoding, speculative):
        before = set(psutil.Process().children(recursive=True))
        engine = super().start(spec, decoding, speculative)
        if self.stopped:
            return engine
        mine = engine_processes(before)
        inner_stream = engine.stream

        def stream(prompts, stop=None):
            for i, gen in enumerate(inner_stream(prompts, stop), 1):
                yield gen
                if i == self.after and not self.stopped:
                    for p in mine:
                        p.send_signal(signal.SIGSTOP)
                    self.stopped = mine
        engine.stream = stream
        return engine


def test_a_hung_engine_is_killed_restarted_and_its_rows_decoded_again(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 24)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="none",
                    extra="")
    job.write_text(job.read_text().replace("max_in_flight = 16", "max_in_flight = 16\nhang_timeout_s = 5"))
    factory = StopEngineProcess(after=4)
    report = run_job(load_spec(job), engine_factory=factory, progress=False)
    assert factory.stopped, "the engine was never stopped"
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in factory.stopped)
    assert report.passes["pass1"].hung == 1 and report.passes["pass1"].engine_starts == 2
    assert "engine-hung" in codes(report.passes["pass1"])
    assert_exactly_once([f"r{i:05d}" for i in range(24)], tmp_path / "out", tmp_path / "out" / "_rejects")

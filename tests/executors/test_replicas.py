"""Several engine replicas on one queue (local processes): every unit once, whoever dies.

The engine is the fake one (batchjson/engine/fake.py) except where marked `engine`, or none where a test drives the
pool itself."""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from batchjson.engine.fake import FakeEngines
from batchjson.errors import EngineError
from batchjson.executors import Layout, Queue
from batchjson.executors.base import queue_channel
from batchjson.executors.local import LocalPool
from batchjson.executors.placement import Placement
from batchjson.job import run_job
from batchjson.records import WAIT, Stage
from batchjson.spec import load_spec
from helpers import ENV, HERE, assert_exactly_once, codes, write_job, write_rows


class HeldReplicaEngines(FakeEngines):
    """Fake engines of which one replica answers nothing until `until` pass-1 units are committed in `units` (or
    `wait_s` have passed): the local pool names each replica's process by its slot."""

    def __init__(self, held: int, units: Path, until: int, wait_s: float = 120, **kwargs):
        super().__init__(**kwargs)
        self.held, self.units, self.until, self.wait_s = held, units, until, wait_s

    def start(self, spec, decoding, speculative):
        engine = super().start(spec, decoding, speculative)
        if multiprocessing.current_process().name == f"batchjson-replica-{self.held}":
            answer, deadline = engine.answer, time.monotonic() + self.wait_s

            def held(prompt):
                while len(list(self.units.glob("p1-*.json"))) < self.until and time.monotonic() < deadline:
                    time.sleep(0.05)
                return answer(prompt)
            engine.answer = held
        return engine


def records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (out / "_batchjson" / "units").glob("p*.json")]


def test_two_replicas_share_the_units(tmp_path, tiny_model):
    """Replica 0 answers nothing until a unit is committed, so replica 1 commits one whichever process starts first;
    then replica 0 finishes its own."""
    write_rows(tmp_path / "in.parquet", 120)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    engines = HeldReplicaEngines(held=0, units=tmp_path / "out" / "_batchjson" / "units", until=1, valid=0.7,
                                 delay=0.01)
    report = run_job(load_spec(job), replicas=2, progress=False, engine_factory=engines)
    assert report.replicas == 2
    assert report.verified["ok"] and report.verified["complete"], report.verified
    assert_exactly_once([f"r{i:05d}" for i in range(120)], tmp_path / "out", tmp_path / "out" / "_rejects")
    by_replica = collections.Counter(r["replica"] for r in records(tmp_path / "out") if r["stage"] == "p1")
    assert set(by_replica) == {0, 1}, by_replica  # both pulled units from the one queue
    assert report.passes["pass1"].rows == 120  # the replicas' counts add up in one report
    assert report.passes["pass2"].rows == report.passes["pass1"].rows - report.passes["pass1"].valid


def test_the_driver_reads_back_no_record_its_replicas_committed(tmp_path, tiny_model, monkeypatch):
    """A replica hands the driver its commit record with "done": the driver counts the progress, folds the index,
    checks each unit and tallies the report from it, reading no record back (on object storage a GET per unit)."""
    from batchjson.storage.location import Location

    write_rows(tmp_path / "in.parquet", 80)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    read, read_bytes = [], Location.read_bytes

    def counted(self):
        if self.name.startswith(("p1-", "p2-")) and self.name.endswith(".json"):
            read.append(self.name)
        return read_bytes(self)

    monkeypatch.setattr(Location, "read_bytes", counted)  # the driver's process only: the replicas are spawned
    report = run_job(load_spec(job), replicas=2, progress=False, engine_factory=FakeEngines(valid=0.5, seed=1))
    assert report.replicas == 2 and report.verified["ok"] and report.verified["complete"], report.verified
    assert report.passes["pass2"].rows > 0 and read == [], read
    assert_exactly_once([f"r{i:05d}" for i in range(80)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_a_slow_replica_does_not_hold_the_others_up(tmp_path, tiny_model):
    """Pull, not a static split: while one replica holds its units (its engine answers nothing until the other 47 of
    the 50 are committed), the other replica takes every other unit, however loaded the machine. A replica holds at
    most three: the one it decodes, the next (fetched ahead) and the one its fetch thread waits to hand over."""
    write_rows(tmp_path / "in.parquet", 200)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    engines = HeldReplicaEngines(held=1, units=tmp_path / "out" / "_batchjson" / "units", until=47, valid=1.0,
                                 delay=0.01)
    report = run_job(load_spec(job), replicas=2, progress=False, engine_factory=engines)
    by_replica = collections.Counter(r["replica"] for r in records(tmp_path / "out"))
    assert by_replica[1] <= 3 and by_replica[0] + by_replica[1] == 50, by_replica
    assert report.verified["ok"] and report.verified["complete"]


def kill_a_replica(out: Path, args: list[str], env: dict, count: int, which: int, after: int) -> dict:
    """Run fake_runner.py with `args`, SIGKILL replica `which` of `count` once `after` units are committed; the report
    of the run, which must finish exactly once all the same."""
    runner = subprocess.Popen([sys.executable, str(HERE / "fake_runner.py"), *args], env=ENV | env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_commits(out, after, runner)
        replicas = [c for c in psutil.Process(runner.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(replicas) == count, replicas
        replicas[which].send_signal(signal.SIGKILL)
        _, stderr = runner.communicate(timeout=300)
    finally:
        runner.kill()
    assert runner.returncode == 0, stderr[-3000:]
    report = json.loads((out / "_report.json").read_text())
    assert report["verified"]["ok"] and report["verified"]["complete"], report["verified"]
    # Its units went to the others; the note is on the pass of the work it held (pass 2's alone, at times).
    assert any("replica-died" in codes(p) for p in report["passes"].values()), report["passes"]
    return report


def test_a_replica_killed_mid_run_has_its_units_redone(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 200)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    out = tmp_path / "out"
    kill_a_replica(out, [str(job), str(out), "none", "0", "", "2"], {"FAKE_DELAY": "0.02"}, count=2, which=0, after=5)
    assert_exactly_once([f"r{i:05d}" for i in range(200)], out, out / "_rejects")


class SlowReplacementEngines(FakeEngines):
    """Fake engines whose replica 0 dies (SIGKILL) once `after` units are committed, and whose replica started in
    its place takes `start_s` to start its engine."""

    def __init__(self, marker: Path, units: Path, after: int, start_s: float, **kwargs):
        super().__init__(**kwargs)
        self.marker, self.units, self.after, self.start_s = marker, units, after, start_s

    def start(self, spec, decoding, speculative):
        if multiprocessing.current_process().name != "batchjson-replica-0":
            return super().start(spec, decoding, speculative)
        if self.marker.exists():  # the replacement
            time.sleep(self.start_s)
            return super().start(spec, decoding, speculative)
        self.marker.touch()
        engine, answer = super().start(spec, decoding, speculative), None
        answer = engine.answer

        def dying(prompt):
            if len(list(self.units.glob("p1-*.json"))) >= self.after:
                os.kill(os.getpid(), signal.SIGKILL)
            return answer(prompt)
        engine.answer = dying
        return engine


def test_a_replica_started_in_a_dead_ones_place_holds_no_unit_through_its_start(tmp_path, tiny_model):
    """Replica 0 dies once 3 units are committed; its replacement's engine takes two minutes to start. The
    replacement takes no unit before its engine is up, so replica 1 decodes every unit left, the dead one's included,
    and the run ends without waiting for the replacement (which committed nothing and holds nothing)."""
    write_rows(tmp_path / "in.parquet", 120)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    out = tmp_path / "out"
    engines = SlowReplacementEngines(tmp_path / "died", out / "_batchjson" / "units", after=3, start_s=120, valid=1.0,
                                     delay=0.01)
    began = time.monotonic()
    report = run_job(load_spec(job), replicas=2, progress=False, engine_factory=engines)
    assert time.monotonic() - began < 90, "the run waited for the replacement's engine start"
    assert (tmp_path / "died").exists() and "replica-died" in codes(report.passes["pass1"])
    assert report.verified["ok"] and report.verified["complete"], report.verified
    assert_exactly_once([f"r{i:05d}" for i in range(120)], out, out / "_rejects")
    by_replica = collections.Counter(r["replica"] for r in records(out))
    assert by_replica[1] >= 27 and sum(by_replica.values()) == 30, by_replica


def test_no_more_engines_start_for_the_pending_units_than_there_are_units():
    """A worker asks which stage comes before it starts an engine (no unit taken): while as many workers as there
    are pending units have been told so, another is told to wait, and is told once one of them dies or more work
    comes (a unit's pass 2)."""
    work = Queue({Stage.FIRST: ["u0"]}, {Stage.FIRST: Stage.SECOND})
    stages = (Stage.FIRST, Stage.SECOND)
    assert work.want(0, stages, take=False) == ("unit", Stage.FIRST, "u0")
    assert work.want(0, stages, take=False) == ("unit", Stage.FIRST, "u0")  # asked again: still its own
    assert work.want(1, stages, take=False)[0] == "idle"
    assert work.lost(0) == []  # died during its start, holding nothing
    assert work.want(1, stages, take=False) == ("unit", Stage.FIRST, "u0")
    assert work.want(1, stages) == ("unit", Stage.FIRST, "u0")
    assert work.want(2, stages, take=False)[0] == "idle"
    assert work.done(1, Stage.FIRST, "u0", requeued=3)
    assert work.want(2, stages, take=False) == ("unit", Stage.SECOND, "u0")
    assert work.want(2, stages) == ("unit", Stage.SECOND, "u0") and not work.starting
    assert work.done(2, Stage.SECOND, "u0", requeued=0) and work.want(1, stages, take=False) == ("end",)


class CountedStartEngines(FakeEngines):
    """Fake engines that note each start in `starts` (a line per start, whichever replica process made it)."""

    def __init__(self, starts: Path, **kwargs):
        super().__init__(**kwargs)
        self.starts = starts

    def start(self, spec, decoding, speculative):
        with open(self.starts, "a") as f:
            f.write(f"{os.getpid()}\n")
        return super().start(spec, decoding, speculative)


def test_a_job_of_fewer_units_than_replicas_starts_an_engine_per_unit_only(tmp_path, tiny_model):
    """One unit, two replicas, engines that take a second to start: one engine starts; the other replica waits for
    work that never comes, and the run ends."""
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=8)
    engines = CountedStartEngines(tmp_path / "starts", start_delay=1.0, valid=1.0)
    report = run_job(load_spec(job), replicas=2, progress=False, engine_factory=engines)
    assert report.verified["ok"] and report.verified["complete"], report.verified
    assert len((tmp_path / "starts").read_text().split()) == 1


def cut_short(marker: str, placement: Placement, slot: int, count: int, inbox, outbox) -> None:
    """A replica that commits each unit it is handed at once. Slot 0's first process is killed a second into sending
    a message larger than a pipe holds, which nobody reads meanwhile: it dies in the middle of the message."""
    if slot == 0 and not os.path.exists(marker):
        Path(marker).touch()
        threading.Timer(1, os.kill, (os.getpid(), signal.SIGKILL)).start()
        outbox.put(("stats", slot, {"p1": {"note": "x" * (8 << 20)}}))
    channel = queue_channel(slot, inbox, outbox)
    for pair in channel.work(lambda: (Stage.FIRST,)):
        if pair is WAIT:
            time.sleep(0.01)
        else:
            channel.send("done", {"stage": pair[0], "key": pair[1], "files": {}, "rows": {"output": 1}})
    channel.send("stats", {})


def test_a_replica_killed_in_the_middle_of_a_message_holds_up_no_other(tmp_path):
    """The driver starts reading once replica 0 is dead, half a message in its pipe: it drops that, hears replica 1
    (which sent its want meanwhile), and hands out every unit once, replica 0's replacement among the takers. A queue
    shared by the replicas hangs here: the rest of the message never comes, and its write lock is never released."""
    keys = [f"u{i:02d}" for i in range(20)]
    work, done, notes, errors = Queue({Stage.FIRST: keys}, {}), [], [], []

    def drive():
        try:
            pool.drive(work, threading.Event(), lambda record: done.append(record["key"]),
                       lambda counts: None, lambda stage, code, text: notes.append(code))
        except BaseException as e:  # noqa: BLE001 - told by the assertion below
            errors.append(e)

    pool = LocalPool(cut_short, (str(tmp_path / "killed"),), Layout((Placement(),) * 2))
    try:
        deadline = time.monotonic() + 60
        while pool.live[0].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.live[0].exitcode == -signal.SIGKILL
        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        driver.join(timeout=60)
        assert not driver.is_alive(), "the driver hangs behind the killed replica's message"
    finally:
        for p in list(pool.live.values()):
            p.kill()
        pool.close()
    assert not errors, errors
    assert sorted(done) == keys and work.finished
    assert "replica-died" in notes


def _runner(job, out, delay="0.02"):
    return subprocess.Popen([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "none", "0", "", "2"],
                            env=ENV | {"FAKE_DELAY": delay}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_commits(out: Path, n: int, runner) -> None:
    deadline = time.monotonic() + 120
    while len(records(out)) < n and time.monotonic() < deadline and runner.poll() is None:
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_runner_killed_or_stopped_takes_its_replicas_with_it_and_a_rerun_finishes(tmp_path, tiny_model, sig):
    write_rows(tmp_path / "in.parquet", 200)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    out = tmp_path / "out"
    runner = _runner(job, out)
    try:
        _wait_for_commits(out, 5, runner)
        replicas = [c for c in psutil.Process(runner.pid).children(recursive=True)
                    if "spawn_main" in " ".join(c.cmdline())]
        assert len(replicas) >= 2
        runner.send_signal(sig)
        runner.communicate(timeout=120)
    finally:
        runner.kill()
    # SIGKILL: the replicas die with the runner (PR_SET_PDEATHSIG); SIGTERM: they stop at their next step.
    gone, alive = psutil.wait_procs(replicas, timeout=30)
    assert not alive, alive
    if sig == signal.SIGTERM:
        assert runner.returncode == 130
    again = _runner(job, out, delay="0")
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    assert "exactly-once check ok" in stdout
    assert_exactly_once([f"r{i:05d}" for i in range(200)], out, out / "_rejects")


# -- several replicas on one GPU (CUDA_VISIBLE_DEVICES fakes the GPUs: the fake engine uses none) -------------------

class RecordingEngines(FakeEngines):
    """Fake engines that log each start and close (when, which replica, what it saw) to a file, one JSON line each."""

    def __init__(self, log: str, **kwargs):
        super().__init__(**kwargs)
        self.log = log

    def _write(self, event: str, t0: float, spec=None) -> None:
        line = {"event": event, "t0": t0, "t1": time.time(), "replica": multiprocessing.current_process().name,
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "threads": os.environ.get("OMP_NUM_THREADS")}
        if spec is not None:
            line["memory"] = spec.model.engine.get("gpu_memory_utilization")
        with open(self.log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def start(self, spec, decoding, speculative):
        t0 = time.time()
        engine = super().start(spec, decoding, speculative)
        self._write("start", t0, spec)
        close = engine.close

        def closing():
            t = time.time()
            time.sleep(self.start_delay / 2)
            close()
            self._write("close", t)

        engine.close = closing
        return engine


def shared_gpu_job(tmp_path, tiny_model, rows: int, per_gpu: int, extra: str = "") -> Path:
    write_rows(tmp_path / "in.parquet", rows)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4, speculative="none", extra=extra)
    job.write_text(job.read_text().replace("[model]\n", f"[model]\nreplicas_per_gpu = {per_gpu}\n"))
    return job


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_three_replicas_on_one_gpu_start_one_at_a_time_each_with_a_third_of_its_memory(tmp_path, tiny_model,
                                                                                        monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    job = shared_gpu_job(tmp_path, tiny_model, 120, 3)
    log = tmp_path / "engines.jsonl"
    report = run_job(load_spec(job), progress=False,
                     engine_factory=RecordingEngines(str(log), valid=0.7, delay=0.01, start_delay=0.4))
    assert report.replicas == 3 and report.replicas_per_gpu == 3
    assert report.verified["ok"] and report.verified["complete"], report.verified
    assert_exactly_once([f"r{i:05d}" for i in range(120)], tmp_path / "out", tmp_path / "out" / "_rejects")
    seen = events(log)
    starts = [e for e in seen if e["event"] == "start"]
    assert len({e["replica"] for e in starts}) == 3
    assert {(e["gpus"], e["memory"]) for e in starts} == {("0", 0.3)}
    assert all(e["threads"] for e in starts)  # each its share of the cores for torch
    # A start (each measures here) overlaps no other start or close: it profiles a GPU whose other engines hold
    # still. Closes may overlap one another.
    for start in starts:
        others = [e for e in seen if e is not start]
        assert all(e["t1"] <= start["t0"] or e["t0"] >= start["t1"] for e in others), (start, others)
    by_replica = collections.Counter(r["replica"] for r in records(tmp_path / "out") if r["stage"] == "p1")
    assert len(by_replica) == 3, by_replica  # all three pulled units from the one queue


def test_replicas_whose_starts_measure_nothing_start_side_by_side(tmp_path, tiny_model, monkeypatch):
    """Engines given a KV cache size vLLM measured before (engine/kv_sizes.py) start together on a shared GPU; a
    close never overlaps a start that measures (here none does)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    job = shared_gpu_job(tmp_path, tiny_model, 60, 3)
    log = tmp_path / "engines.jsonl"
    report = run_job(load_spec(job), progress=False, engine_factory=RecordingEngines(
        str(log), valid=1.0, delay=0.01, start_delay=2.0, measures=False))
    assert report.replicas == 3 and report.verified["ok"] and report.verified["complete"]
    starts = sorted((e["t0"], e["t1"]) for e in events(log) if e["event"] == "start")
    assert len(starts) == 3
    assert any(a[1] > b[0] for a, b in zip(starts, starts[1:])), starts  # one after another, they would not overlap


class KeptSizeFailsEngines(RecordingEngines):
    """Each replica's first start is given a kept size, and fails (as vLLM's does when another process took the
    memory since); the failure forgets the size, so the next start measures."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, measures=False, **kwargs)

    def start(self, spec, decoding, speculative):
        if not self._measures:
            self._measures = True
            self._write("failed", time.time())
            raise EngineError("vLLM could not start: CUDA out of memory")
        return super().start(spec, decoding, speculative)


def test_a_start_with_a_kept_size_that_fails_measures_again_alone(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    job = shared_gpu_job(tmp_path, tiny_model, 60, 2)
    log = tmp_path / "engines.jsonl"
    report = run_job(load_spec(job), progress=False,
                     engine_factory=KeptSizeFailsEngines(str(log), valid=1.0, delay=0.01, start_delay=0.3))
    assert report.replicas == 2 and report.verified["ok"] and report.verified["complete"]
    assert_exactly_once([f"r{i:05d}" for i in range(60)], tmp_path / "out", tmp_path / "out" / "_rejects")
    seen = events(log)
    assert collections.Counter(e["event"] for e in seen)["failed"] == 2
    starts = sorted((e["t0"], e["t1"]) for e in seen if e["event"] == "start")
    assert len(starts) == 2 and starts[0][1] <= starts[1][0], starts  # measuring, one at a time


def test_the_users_gpu_memory_utilization_is_kept_on_a_shared_gpu(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    job = shared_gpu_job(tmp_path, tiny_model, 160, 2, extra="[model.engine]\ngpu_memory_utilization = 0.3\n")
    log = tmp_path / "engines.jsonl"
    report = run_job(load_spec(job), progress=False,
                     engine_factory=RecordingEngines(str(log), valid=1.0, delay=0.03, start_delay=0.2))
    assert report.replicas == 4 and report.verified["ok"] and report.verified["complete"]
    starts = [e for e in events(log) if e["event"] == "start"]
    assert sorted(e["gpus"] for e in starts) == ["0", "0", "1", "1"]
    assert {e["memory"] for e in starts} == {0.3}


def test_a_replica_killed_among_replicas_sharing_a_gpu_has_its_units_redone(tmp_path, tiny_model):
    job = shared_gpu_job(tmp_path, tiny_model, 200, 3)
    out = tmp_path / "out"
    report = kill_a_replica(out, [str(job), str(out), "none", "0"], {"FAKE_DELAY": "0.02", "FAKE_START_DELAY": "0.2",
                            "CUDA_VISIBLE_DEVICES": "0"}, count=3, which=1, after=8)
    assert (report["replicas"], report["replicas_per_gpu"]) == (3, 3)
    assert_exactly_once([f"r{i:05d}" for i in range(200)], out, out / "_rejects")

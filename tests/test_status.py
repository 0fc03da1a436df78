"""A run operated from outside: `status` read beside a committing run, `cancel` from another process, a stale
cancel marker, a deadline mid-run and its rerun, and the mistakes that must end in exit 2 with a message."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from batchjson import watch
from batchjson.cli import main
from batchjson.engine import WrappedEngines
from batchjson.engine.fake import FakeEngines
from batchjson.job import JobRun, run_job
from batchjson.spec import load_spec
from batchjson.status import status_job
from batchjson.storage import STATE, Location
from batchjson.storage.progress import ProgressFile, write_cancel
from batchjson.verify import UnitChecks, verify_job
from helpers import ENV, HERE, assert_exactly_once, at_commit_step, wait_for_engine_process, write_job, write_rows

IDS = [f"r{i:05d}" for i in range(64)]


def counts(status) -> tuple:
    """What must never go down while a run commits: rows valid and rejected, and units committed, by pass."""
    return (status.valid, status.rejected, *(status.passes.get(p, {}).get("units", 0) for p in ("p1", "p2")))


@pytest.mark.engine
def test_status_read_while_a_run_commits_only_grows_and_ends_at_the_report(tmp_path, tiny_model, engines,
                                                                           monkeypatch):
    write_rows(tmp_path / "in.parquet", 64)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))
    out = str(tmp_path / "out")
    monkeypatch.setattr(ProgressFile, "WRITE_EVERY", 0.0)  # every commit shows: the test sees each step
    seen, at_commits, done = [], [], threading.Event()

    def reader():  # another reader of the folder, as `batchjson status` from another shell is
        while not done.is_set():
            if (tmp_path / "out" / STATE / "progress-0of1.json").exists():
                seen.append(counts(status_job(spec, out)))

    at_commit_step("committed", 3, lambda: at_commits.append(status_job(spec, out)), monkeypatch.setattr)
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        report = run_job(spec, engine_factory=engines, progress=False)
    finally:
        done.set()
        thread.join()
    final = status_job(spec, out)
    assert all(a <= b for a, b in zip(seen, seen[1:] + [counts(final)])), seen
    assert final.state == "ended" and final.outcome == "done" and final.left == 0
    assert (final.valid, final.rejected) == (report.valid, report.rejected)
    by_pass = {f"pass{p[1]}": t["output"] for p, t in final.passes.items() if t["output"]}
    assert by_pass == report.valid_by_pass
    reasons = {}
    for t in final.passes.values():
        for reason, n in t["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    assert reasons == report.rejects_by_reason
    # The read at the third commit saw a run under way, holding the folder, counted up to its last write.
    mid = at_commits[0]
    assert mid.state == "running" and mid.runs[0]["alive"] is True and 0 < mid.left < 64
    assert counts(mid) <= counts(final)


def fake_run(tmp_path, rows: int, delay: str):
    """A run of `rows` rows (units of 8) on the fake engine, slowed by `delay` s a row, in its own process: the job,
    its output folder and the process."""
    write_rows(tmp_path / "in.parquet", rows, row_group_size=8)
    job = write_job(tmp_path, "default", tmp_path / "in.parquet")
    out = tmp_path / "out"
    runner = subprocess.Popen([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "none", "0"],
                              env=ENV | {"FAKE_DELAY": delay}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    return job, out, runner


def test_status_beside_a_run_in_another_process_never_goes_backwards(tmp_path):
    """The fake engine, slowed, in its own process; this process reads status until the run ends."""
    job, out, runner = fake_run(tmp_path, 240, "0.01")
    seen, running = [], 0
    while runner.poll() is None:
        if (out / STATE / "progress-0of1.json").exists():
            status = status_job(output=str(out))
            seen.append(counts(status))
            running += status.state == "running"
        time.sleep(0.2)
    assert runner.returncode == 0, runner.stderr.read()[-2000:]
    final = status_job(output=str(out))
    report = json.loads((out / "_report.json").read_text())
    assert running and all(a <= b for a, b in zip(seen, seen[1:] + [counts(final)])), seen
    assert (final.valid, final.rejected, final.left) == (report["valid"], report["rejected"], 0)


def wait_for_commits(out, n: int, process: subprocess.Popen) -> None:
    """Until the run in `out` has committed n units of pass 1 (its progress file says so)."""
    give_up = time.monotonic() + 120
    while time.monotonic() < give_up and process.poll() is None:
        if (out / STATE / "progress-0of1.json").exists() and counts(status_job(output=str(out)))[2] >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"the run never committed {n} units: {process.poll()} {process.stderr.read()[-2000:]}")


def test_cancel_from_a_second_process_stops_the_run_cleanly_and_a_rerun_finishes(tmp_path):
    job, out, runner = fake_run(tmp_path, 400, "0.02")
    wait_for_commits(out, 2, runner)
    cancel = subprocess.run([sys.executable, "-m", "batchjson", "cancel", "--output", str(out)], env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert cancel.returncode == 0 and "cancel requested" in cancel.stdout, cancel.stderr
    _, err = runner.communicate(timeout=120)
    assert runner.returncode == 130 and "Traceback" not in err, err[-2000:]
    status = status_job(output=str(out))
    assert (status.state, status.outcome) == ("ended", "cancelled") and status.left > 0
    assert verify_job(load_spec(job), str(out)).ok  # what is committed is each row once
    again = CliRunner().invoke(main, ["cancel", "--output", str(out)])
    assert again.exit_code == 2 and "nothing to cancel" in again.output
    report = run_job(load_spec(job), str(out), engine_factory=FakeEngines(), progress=False)
    assert report.outcome == "done" and not report.interrupted
    assert_exactly_once([f"r{i:05d}" for i in range(400)], out, out / "_rejects")


@pytest.mark.engine
def test_cancel_during_the_engine_start_stops_the_run_within_seconds(tmp_path, tiny_model):
    """The engine's start (a minute on a busy CPU) is cut short: the run does not wait for an engine it will not
    use."""
    write_rows(tmp_path / "in.parquet", 8)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="none")
    runner = subprocess.Popen([sys.executable, "-m", "batchjson", "run", str(job)], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    wait_for_engine_process(runner)
    asked = time.monotonic()
    cancel = CliRunner().invoke(main, ["cancel", str(job)])
    assert cancel.exit_code == 0 and "cancel requested" in cancel.output, cancel.output
    _, err = runner.communicate(timeout=120)
    assert time.monotonic() - asked < 10
    assert runner.returncode == 130 and "cancelled: finished units are committed" in err, err[-2000:]
    assert status_job(load_spec(job)).outcome == "cancelled"


@pytest.mark.parametrize("names", ["this run", "an earlier run"])
def test_a_cancel_marker_stops_only_the_run_it_names(tmp_path, monkeypatch, names):
    """A marker left for a run that is gone (its canceller or its run died first) must not stop the next run;
    the same marker naming the run going now stops it."""
    write_rows(tmp_path / "in.parquet", 160, row_group_size=8)
    job = write_job(tmp_path, "default", tmp_path / "in.parquet")
    monkeypatch.setattr(watch, "CANCEL_POLL", 0.01)
    state = Location.of(tmp_path / "out" / STATE)

    def leave_marker():
        run = runner.watch.id if names == "this run" else "5f0e1d2c3b4a"
        write_cancel(state, [run], "elsewhere", 4242)

    at_commit_step("committed", 1, leave_marker, monkeypatch.setattr)
    runner = JobRun(load_spec(job), engine_factory=FakeEngines(delay=0.02), progress=False)
    report = runner.run()
    if names == "this run":
        assert report.interrupted and report.outcome == "cancelled" and report.rows_left > 0
    else:
        assert not report.interrupted and report.outcome == "done" and report.rows_left == 0
        assert_exactly_once([f"r{i:05d}" for i in range(160)], tmp_path / "out", tmp_path / "out" / "_rejects")


@pytest.mark.engine
def test_a_deadline_mid_run_commits_what_is_in_flight_and_the_rerun_completes(tmp_path, tiny_model, engines,
                                                                              monkeypatch):
    write_rows(tmp_path / "in.parquet", 64)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))
    out = tmp_path / "out"
    at_commit_step("committed", 2, lambda: setattr(runner.watch, "deadline", time.time()), monkeypatch.setattr)
    runner = JobRun(spec, engine_factory=engines, progress=False, deadline="8h")
    report = runner.run()
    assert report.outcome == "deadline" and not report.interrupted and 0 < report.rows_left < 64
    assert report.valid + report.rejected + report.rows_left == 64
    assert report.verified["ok"] and not report.verify_failed
    status = status_job(spec)
    assert (status.outcome, status.left) == ("deadline", report.rows_left)
    monkeypatch.undo()
    again = run_job(spec, engine_factory=engines, progress=False)
    assert again.resumed and again.outcome == "done" and again.rows_left == 0
    assert_exactly_once(IDS, out, out / "_rejects")


@pytest.mark.engine
def test_the_command_line_stops_at_its_deadline_with_exit_4_and_status_says_what_is_left(tmp_path, tiny_model,
                                                                                         engines, monkeypatch):
    """A deadline of one second passes while the engine starts (the session's engine, two seconds late): a worker
    takes its first unit once its engine is up, and none is handed out past the deadline, so none is begun: exit 4,
    and status says every row is left. (Units held when the deadline comes are finished: test_a_deadline_mid_run_*.)"""
    late = WrappedEngines(engines, lambda engine: (time.sleep(2), engine)[1])
    monkeypatch.setattr("batchjson.engine.VllmEngines", lambda: late)  # the command's run on the session's engines
    write_rows(tmp_path / "in.parquet", 32)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    done = CliRunner().invoke(main, ["run", str(job), "--deadline", "1s"])
    assert done.exit_code == 4 and "deadline: " in done.stderr and "rows left" in done.stderr, done.output[-2000:]
    shown = CliRunner().invoke(main, ["status", str(job), "--json"])
    assert shown.exit_code == 0, shown.output
    status = json.loads(shown.output)
    assert status["outcome"] == "deadline" and status["left"] == 32 and status["valid"] + status["rejected"] == 0


@pytest.mark.parametrize("deadline, where", [("--deadline=2020-01-01T06:00", "--deadline"),
                                             ("--deadline=soon", "--deadline"), ("", "output.deadline"),
                                             ("--deadline=100000000h", "--deadline"), ("--deadline=", "--deadline")])
def test_a_deadline_in_the_past_or_not_a_time_is_exit_2_naming_it(tmp_path, deadline, where):
    write_rows(tmp_path / "in.parquet", 8)
    job = write_job(tmp_path, "default", tmp_path / "in.parquet",
                    extra="" if deadline else 'deadline = "half past six"')
    result = CliRunner().invoke(main, ["run", str(job), *filter(None, [deadline])])
    assert result.exit_code == 2 and where in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_status_of_what_holds_no_run_is_exit_2_naming_it(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part.parquet").write_bytes(b"not ours")
    (tmp_path / "file").write_text("x")
    for folder, message in [(tmp_path / "missing", "is not a folder"), (tmp_path / "file", "is not a folder"),
                            (tmp_path / "data", "holds no batchjson run")]:
        for command in ("status", "cancel"):
            result = CliRunner().invoke(main, [command, "--output", str(folder)])
            assert result.exit_code == 2 and str(folder) in result.output and message in result.output, result.output
    result = CliRunner().invoke(main, ["status"])
    assert result.exit_code == 2 and "--output" in result.output


def test_status_of_an_unreachable_bucket_is_exit_2_naming_it(s3):
    missing = s3.replace("s3://", "s3://no-such-") + "/out"
    result = CliRunner().invoke(main, ["status", "--output", missing])
    assert result.exit_code == 2 and "no-such-" in result.output and "Traceback" not in result.output, result.output


def test_status_on_object_storage_reads_the_run_state_alone(tmp_path, s3, s3_server, monkeypatch):
    """Beside a run that holds its lease, and after it: no commit record or part file is read, a handful of
    requests whatever the number of units."""
    from s3_proxy import FaultProxy

    write_rows(tmp_path / "in.parquet", 40, row_group_size=4)
    job = write_job(tmp_path, "default", tmp_path / "in.parquet", batch_size=4)
    out, mid = f"{s3}/out", []
    # The run's own checks of its units read the folder beside it (verify.py), and the proxy counts every request:
    # they are off here, so that what is counted during `look` is the status command's alone.
    monkeypatch.setattr(UnitChecks, "add", lambda self, key: None)
    with FaultProxy(s3_server.endpoint) as proxy:  # no faults: it counts the requests
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{proxy.endpoint}")

        def look():
            proxy.paths.clear()
            status = status_job(output=out)
            return status, [path for (op, path), n in proxy.paths.items() for _ in range(n)]

        at_commit_step("committed", 3, lambda: mid.append(look()), monkeypatch.setattr)
        report = run_job(load_spec(job), out, engine_factory=FakeEngines(), progress=False)
        final, read = look()
    status, read_mid = mid[0]
    assert status.state == "running" and status.runs[0]["alive"] is True  # its lease, by host and pid
    assert (final.state, final.outcome, final.valid, final.rejected) == ("ended", "done", report.valid, report.rejected)
    for paths in (read_mid, read):
        assert not [p for p in paths if "/units/" in p or p.endswith(".parquet")] and len(paths) <= 6, paths


def test_a_run_logs_its_progress_for_a_log_without_a_bar(tmp_path, monkeypatch, caplog):
    """An Airflow task's log: a progress line now and then (here at every commit), counts that only grow."""
    write_rows(tmp_path / "in.parquet", 64, row_group_size=8)
    job = write_job(tmp_path, "default", tmp_path / "in.parquet")
    monkeypatch.setattr(watch, "LOG_EVERY", 0.0)
    monkeypatch.setattr(ProgressFile, "WRITE_EVERY", 0.0)
    with caplog.at_level(logging.INFO, logger="batchjson"):
        report = run_job(load_spec(job), str(tmp_path / "out"), engine_factory=FakeEngines(), progress=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ")]
    done = [int(re.match(r"progress: (\d+) of 64 rows finished", line)[1]) for line in lines]
    assert len(done) >= 8 and done == sorted(done) and done[-1] == report.valid + report.rejected, lines


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_status_and_cancel_without_a_folder_say_to_pass_one(command):
    """Given neither a job nor --output there is no spec to speak of: the message names what to pass."""
    result = CliRunner().invoke(main, [command])
    assert result.exit_code == 2
    assert "no output folder: pass --output OUT, or the job's TOML file" in result.output
    assert "spec" not in result.output

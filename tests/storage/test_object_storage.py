"""Input and output on object storage (a real S3 server, tests/s3_server.py): the same rows as a local run, exactly
once across kills, leases instead of file locks, and user mistakes that end in a message (exit 2)."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pyarrow import fs

from batchjson.cli import main
from batchjson.errors import OutputError
from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.spec import load_spec, with_input
from batchjson.storage import Lease, PartName
from batchjson.verify import verify_job
from helpers import ENV, HERE, codes, write_job, write_rows
from s3_proxy import FaultProxy

LEASE = 3.0  # seconds: the lease expiry of the runs these tests kill


def put_rows(uri: str, local, n: int, start: int = 0) -> None:
    """Write the test rows (conftest.write_rows) to a Parquet object at `uri`."""
    filesystem, path = fs.FileSystem.from_uri(uri)
    pq.write_table(pq.read_table(write_rows(local, n, start)), path, filesystem=filesystem)


def table_at(uri: str, columns=None) -> pa.Table | None:
    """Every Parquet file directly under a prefix (as a dataset reader sees the folder), sorted by id."""
    filesystem, path = fs.FileSystem.from_uri(uri)
    files = sorted(i.path for i in filesystem.get_file_info(fs.FileSelector(path, allow_not_found=True))
                   if i.type == fs.FileType.File and i.base_name.endswith(".parquet")
                   and not i.base_name.startswith(("_", ".")))
    if not files:
        return None
    table = pa.concat_tables(pq.read_table(f, filesystem=filesystem, columns=columns) for f in files)
    return table.sort_by("id")


def ids_at(uri: str) -> list[str]:
    table = table_at(uri, ["id"])
    return table.column("id").to_pylist() if table is not None else []


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.mark.engine
def test_a_job_on_s3_writes_what_the_same_job_writes_locally(tmp_path, tiny_model, engines, s3):
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 20)
    put_rows(f"{s3}/in/part/b.parquet", tmp_path / "b.parquet", 7, start=20)
    write_rows(tmp_path / "in" / "a.parquet", 20)
    write_rows(tmp_path / "in" / "part" / "b.parquet", 7, start=20)
    # Greedy, no speculation, no sampled fallback: the two runs must decode the same tokens.
    job = write_job(tmp_path, tiny_model, tmp_path / "in", speculative="none", max_tokens=24)
    job.write_text(job.read_text().replace("[fallback]\n", "[fallback]\nenabled = false\n"))
    spec = load_spec(job)
    local = run_job(spec, str(tmp_path / "out"), engine_factory=engines, progress=False)
    remote = run_job(with_input(spec, f"{s3}/in"), f"{s3}/out", engine_factory=engines, progress=False)

    assert remote.verified["complete"] and local.verified["complete"]
    assert (remote.valid, remote.rejected) == (local.valid, local.rejected)
    columns = ["id", "source", "json"]
    mine = table_at(f"file://{tmp_path}/out", columns)
    theirs = table_at(f"{s3}/out", columns)
    assert mine is not None and theirs is not None and theirs.equals(mine)
    mine_rejects, theirs_rejects = table_at(f"file://{tmp_path}/out/_rejects"), table_at(f"{s3}/out/_rejects")
    assert (mine_rejects is None) == (theirs_rejects is None)
    if mine_rejects is not None:
        assert theirs_rejects.select(["id", "reason"]).equals(mine_rejects.select(["id", "reason"]))
    assert sorted(ids_at(f"{s3}/out") + ids_at(f"{s3}/out/_rejects")) == [f"r{i:05d}" for i in range(27)]
    report, path = fs.FileSystem.from_uri(f"{s3}/out/_report.json")
    assert report.get_file_info(path).type == fs.FileType.File
    assert cli("verify", job, "--input", f"{s3}/in", "--output", f"{s3}/out").exit_code == 0


def runner_env(**extra) -> dict:
    """The fake runner's environment: the test's S3 settings (set by the s3 fixture) and short leases."""
    return ENV | {k: v for k, v in os.environ.items() if k.startswith("AWS_")} | {"FAKE_LEASE_EXPIRY": str(LEASE)} \
        | extra


def runner(job, output, step="none", n=0, **extra):
    return subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), output, step, str(n)],
                          env=runner_env(**extra), capture_output=True, text=True, timeout=300)


def test_runs_killed_mid_commit_on_s3_lose_and_double_nothing(tmp_path, tiny_model, s3):
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 24)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    out = f"{s3}/out"
    # Each killed run must reach its step twice, whatever the dice: all valid until the rejects' turn, then none.
    for step, valid in (("staged output", 1), ("committed", 1), ("published output", 1), ("published rejects", 0)):
        p = runner(job, out, step, 2, FAKE_VALID=str(valid))
        assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
        committed = ids_at(out) + ids_at(f"{out}/_rejects")
        assert not [k for k, v in collections.Counter(committed).items() if v > 1], f"doubled after {step}"
        time.sleep(LEASE + 1)  # the killed run's lease expires
    final = runner(job, out)
    assert final.returncode == 0, final.stderr[-2000:]
    assert "exactly-once check ok" in final.stdout
    assert sorted(ids_at(out) + ids_at(f"{out}/_rejects")) == [f"r{i:05d}" for i in range(24)]
    result = cli("verify", job, "--output", out)
    assert result.exit_code == 0 and "exactly-once check ok: " in result.output, result.output


def test_a_second_run_is_refused_while_the_first_holds_its_lease(tmp_path, tiny_model, s3):
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 8)
    job = write_job(tmp_path, tiny_model, f"{s3}/in")
    out = f"{s3}/out"
    marker = tmp_path / "starting"
    first = subprocess.Popen([sys.executable, str(HERE / "fake_runner.py"), str(job), out, "none", "0"],
                             env=runner_env(FAKE_START_DELAY="600", FAKE_START_MARKER=str(marker)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the first run did not reach its engine start"
        for wait in (0, LEASE + 1):  # refused at once, and still after the expiry: the first run renews
            time.sleep(wait)
            result = cli("run", job, "--output", out)
            assert result.exit_code == 2, result.output
            assert f"another batchjson run is writing to {out} right now" in result.output
            assert "expires in" in result.output and "Traceback" not in result.output
        assert cli("verify", job, "--output", out).exit_code == 2
    finally:
        first.kill()
        first.wait()
    time.sleep(LEASE + 1)  # the killed run's lease expires: the next run takes over
    report = run_job(load_spec(job), out, engine_factory=FakeEngines(), progress=False)
    assert report.verified["complete"]
    assert cli("verify", job, "--output", out).exit_code == 0
    leases = [i.base_name for i in fs.FileSystem.from_uri(f"{out}/_batchjson")[0].get_file_info(
        fs.FileSelector(f"{s3[5:]}/out/_batchjson")) if i.base_name.startswith("lease-")]
    assert leases == [], "leases are released when a run ends"
    again = run_job(load_spec(job), out, fresh=True, engine_factory=FakeEngines(), progress=False)
    assert not again.resumed and again.passes["pass1"].rows == 8 and again.verified["complete"]


def test_shards_share_a_layout_and_a_lost_lease_stops_commits(s3, monkeypatch):
    from batchjson.storage import Storage

    monkeypatch.setattr(Lease, "RENEW_EVERY", 0.2)
    out = f"{s3}/out"
    shards = [Storage(out, shard=(i, 2)) for i in range(2)]
    for s in shards:
        s.claim()
    for other in (Storage(out), Storage(out, shard=(0, 2)), Storage(out, shard=(0, 3))):
        with pytest.raises(OutputError, match="another batchjson run is writing"):
            other.claim()
    time.sleep(1)  # renewals keep the leases
    # Shard 0 stalls (its renewals stop, as in a suspended process), and another run takes its lease over, deleting
    # it. Deleting it while renewals go on would race with a renewal's write (nothing takes over a renewed lease).
    lease = shards[0]._lease
    lease._stop.set()
    lease._thread.join()
    lease.file.unlink()
    with pytest.raises(OutputError, match="taken over by another run"):
        shards[0].commits.commit("p1", "u", {}, {})
    for s in shards:
        s.close()
    whole = Storage(out)
    whole.claim()
    whole.close()


@pytest.mark.parametrize("where, message", [
    ("--output=foo://bucket/out", "foo://bucket/out: not a usable location"),
    ("--output=s3://", "no bucket in the URI"),
    ("--output=s3://no-such-bucket-here/out", "the bucket s3://no-such-bucket-here does not exist"),
    ("--input=s3://no-such-bucket-here/in", "no-such-bucket-here"),
    ("--output={s3}/in/out", "is inside the input"),
])
def test_bad_locations_are_named_with_exit_2(tmp_path, tiny_model, s3, where, message):
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 4)
    job = write_job(tmp_path, tiny_model, f"{s3}/in")
    for command in ("check", "run"):
        result = cli(command, job, where.format(s3=s3))
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output


def test_locations_with_options_are_compared_as_locations(tmp_path, tiny_model, s3, s3_server, monkeypatch):
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 4)
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the URIs' options are the only way to the server
    options = f"endpoint_override={s3_server.endpoint}&scheme=http"
    job = write_job(tmp_path, tiny_model, f"{s3}/in?{options}")
    result = cli("check", job, "--output", f"{s3}/in/out?{options}")
    assert result.exit_code == 2 and f"the output folder {s3}/in/out is inside the input" in result.output, \
        result.output
    with pytest.raises(OutputError, match="is inside the input"):
        run_job(load_spec(job), f"{s3}/in/out?{options}", engine_factory=FakeEngines(), progress=False)
    filesystem, path = fs.FileSystem.from_uri(f"{s3}/in?{options}")
    assert [i.path for i in filesystem.get_file_info(fs.FileSelector(path, recursive=True))] == [f"{path}/a.parquet"]
    assert cli("check", job, "--output", f"{s3}/out?{options}").exit_code == 0


def rows_read(uri: str) -> int:
    """The rows pyarrow.dataset reads from a prefix (sub-folders too, no _ or . names)."""
    filesystem, path = fs.FileSystem.from_uri(uri)
    return ds.dataset(path, filesystem=filesystem, format="parquet").count_rows()


def finished_run(tmp_path, tiny_model, s3):
    """A finished run of 12 valid rows in 3 units on S3; the job, the output prefix and its first part file."""
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 12)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    out = f"{s3}/out"
    run_job(load_spec(job), out, engine_factory=FakeEngines(valid=1.0), progress=False)
    verdict = verify_job(load_spec(job), out)
    assert verdict.complete and rows_read(out) == verdict.output_rows == 12
    filesystem, path = fs.FileSystem.from_uri(out)
    part = min(i.path for i in filesystem.get_file_info(fs.FileSelector(path)) if i.base_name.startswith("p1-"))
    return job, out, filesystem, part


def test_a_copy_of_a_part_in_a_sub_folder_on_s3_fails_verify(tmp_path, tiny_model, s3):
    job, out, filesystem, part = finished_run(tmp_path, tiny_model, s3)
    copy = f"{part.rsplit('/', 1)[0]}/backup/copy.parquet"
    filesystem.copy_file(part, copy)
    assert rows_read(out) > 12
    result = cli("verify", job, "--output", out)
    assert result.exit_code == 3 and f"s3://{copy} is read by readers of the folder" in result.output, result.output
    filesystem.delete_file(copy)
    assert cli("verify", job, "--output", out).exit_code == 0


def test_a_truncated_part_on_s3_fails_verify_and_a_rerun_redoes_its_unit(tmp_path, tiny_model, s3):
    job, out, filesystem, part = finished_run(tmp_path, tiny_model, s3)
    data = filesystem.open_input_stream(part).read()
    with filesystem.open_output_stream(part) as f:
        f.write(data[:len(data) // 2])
    result = cli("verify", job, "--output", out)
    assert result.exit_code == 3 and f"s3://{part} does not read as Parquet" in result.output, result.output
    report = run_job(load_spec(job), out, engine_factory=FakeEngines(valid=1.0), progress=False)
    assert codes(report) == ["unit-redone"] and report.passes["pass1"].rows == 4
    assert report.events[0]["text"].startswith(f"unit {PartName.parse(part.rsplit('/', 1)[1]).key}: ")
    assert cli("verify", job, "--output", out).exit_code == 0 and rows_read(out) == 12
    assert sorted(ids_at(out)) == [f"r{i:05d}" for i in range(12)]


def test_no_credentials_is_exit_2_naming_the_path(tmp_path, tiny_model, s3, monkeypatch):
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 4)
    job = write_job(tmp_path, tiny_model, f"{s3}/in")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = cli("run", job, "--output", str(tmp_path / "out"))
    assert result.exit_code == 2 and f"{s3}/in" in result.output and "AWS_ACCESS_KEY_ID" in result.output, \
        result.output


def test_replicas_on_s3_share_one_queue_and_one_ledger(tmp_path, tiny_model, s3):
    """Two replicas (local processes) reading and writing S3: every id once, both replicas committed units, and
    the runner's lease is the folder's only one, released at the end."""
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 80)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    out = f"{s3}/out"
    # Enough work (80 rows at 0.05 s) that the second replica, a process that starts in seconds on a busy machine,
    # finds units left to take.
    report = run_job(load_spec(job), out, replicas=2, progress=False, engine_factory=FakeEngines(delay=0.05))
    assert report.replicas == 2 and report.verified["ok"] and report.verified["complete"], report.verified
    assert sorted(ids_at(out) + ids_at(f"{out}/_rejects")) == [f"r{i:05d}" for i in range(80)]
    filesystem, path = fs.FileSystem.from_uri(f"{out}/_batchjson/units")
    replicas = {json.loads(filesystem.open_input_stream(i.path).read())["replica"]
                for i in filesystem.get_file_info(fs.FileSelector(path)) if i.base_name.startswith("p1-")}
    assert replicas == {0, 1}
    state = fs.FileSystem.from_uri(f"{out}/_batchjson")
    assert not [i for i in state[0].get_file_info(fs.FileSelector(state[1])) if i.base_name.startswith("lease-")]


def test_a_resume_reads_no_commit_record_and_no_part_file(tmp_path, tiny_model, s3, s3_server, monkeypatch):
    """A finished run resumed on S3 plans from the index and trusts its part files by a listing (no GET or HEAD of
    one); its end check reads each commit record once, to compare with the index's copy. A folder without the index
    (written before it) reads each record once too, and its end check every part file, and gets one."""
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 40)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    out = f"{s3}/out"
    with FaultProxy(s3_server.endpoint) as proxy:  # no faults: it counts the requests
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{proxy.endpoint}")

        def resume() -> list[str]:
            """The record and part files a resume reads (GET or HEAD)."""
            proxy.paths.clear()
            report = run_job(load_spec(job), out, engine_factory=FakeEngines(valid=0.6, seed=1), progress=False)
            assert report.resumed and report.verified["complete"], report.verified
            assert report.verified["output_rows"] + report.verified["reject_rows"] == 40
            return sorted(path for (op, path), n in proxy.paths.items() for _ in range(n)
                          if op in ("GET", "HEAD") and ("/units/" in path or path.endswith(".parquet") and "/out/" in path))

        run_job(load_spec(job), out, engine_factory=FakeEngines(valid=0.6, seed=1), progress=False)
        filesystem, state = fs.FileSystem.from_uri(f"{out}/_batchjson")
        records = sorted(2 * [f"/{i.path}" for i in filesystem.get_file_info(fs.FileSelector(f"{state}/units"))])
        assert resume() == records  # a HEAD and a GET of each record, none of a part file
        filesystem.delete_file(f"{state}/index.arrows")
        read = resume()
        assert [p for p in read if "/units/" in p] == records
        assert len(records) > 20 and len(read) > len(records)  # and its end check reads every file
        assert resume() == records
        assert cli("verify", job, "--output", out).exit_code == 0


@pytest.mark.parametrize("left", [1, 2])
def test_a_resume_on_s3_hands_out_work_without_waiting_for_the_index(tmp_path, tiny_model, s3, s3_server,
                                                                     monkeypatch, left):
    """On object storage too, the units no pass hands out are surveyed beside the run (`Survey.later`): before its
    first hand-out a resume reads only the records of the units waiting for pass 2 and does not wait for the index
    (its read held back here, as a slow store would); the survey beside the run then finds a finished unit's output
    cut short. `left`: units waiting for pass 2, whose files are looked at one by one (1) or found in a listing of
    each part folder (2: more looks than the listings' pages)."""
    from batchjson.storage import Storage
    from batchjson.storage.index_file import Index
    from batchjson.storage.survey import survey_units

    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 48)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    out = f"{s3}/out"
    assert run_job(load_spec(job), out, engine_factory=FakeEngines(valid=0.5, seed=3),
                   progress=False).verified["complete"]
    filesystem, root = fs.FileSystem.from_uri(out)
    units = f"{root}/_batchjson/units"
    records = [json.loads(filesystem.open_input_stream(i.path).read())
               for i in filesystem.get_file_info(fs.FileSelector(units)) if i.base_name.startswith("p1-")]
    waiting = [r for r in records if "requeue" in r["files"]][:left]  # their pass 2 undone: handed out again
    for unit in waiting:
        second = json.loads(filesystem.open_input_stream(f"{units}/p2-{unit['key']}.json").read())
        filesystem.delete_file(f"{units}/p2-{unit['key']}.json")
        for kind, name in second["files"].items():
            filesystem.delete_file(f"{root}/{'_rejects/' if kind == 'rejects' else ''}{name}")
    done = next(r for r in records if "output" in r["files"] and r not in waiting)
    output = f"{root}/{done['files']['output']}"
    data = filesystem.open_input_stream(output).read()
    with filesystem.open_output_stream(output) as f:
        f.write(data[:-10])
    held, read_all, read = threading.Event(), threading.Event(), Index._read

    def held_back(index, files):
        held.wait(10)
        read(index, files)
        read_all.set()

    monkeypatch.setattr(Index, "_read", held_back)
    with FaultProxy(s3_server.endpoint) as proxy:  # no faults: it counts the requests
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{proxy.endpoint}")
        commits = Storage(out).commits
        commits.read_index()
        commits.recover()
        proxy.paths.clear()
        found = survey_units(commits, sorted(r["key"] for r in records), "id", defer=True)
        assert not read_all.is_set()  # handed out before the index was read
        got = sorted(path.rsplit("/", 1)[1] for op, path in proxy.paths if op == "GET" and "/units/" in path)
        assert got == sorted(f"p1-{unit['key']}.json" for unit in waiting), got
        looks = sum(n for (op, path), n in proxy.paths.items() if op == "HEAD" and path.endswith(".parquet"))
        assert (looks > 0) == (left == 1), proxy.paths  # each file looked at, or the folders listed
        assert found.second == {unit["key"]: unit["rows"]["requeue"] for unit in waiting} and not found.damaged
        held.set()
        damaged, _ = found.later()
    assert list(damaged) == [done["key"]] and "bytes, not the" in damaged[done["key"]], damaged

"""Object storage that fails: a fault-injecting proxy (tests/s3_proxy.py) in front of the test S3 server answers a
share of requests with 503 SlowDown, 500 InternalError, a connection reset (before the answer, or halfway through
its body) or a slow answer, commits included. pyarrow's retries ride through them; a fault that outlasts them ends
the run with one line that says to run again, and the rerun completes. Each id ends up once in output or rejects."""

from __future__ import annotations

import collections
import time

import pytest
from click.testing import CliRunner
from pyarrow import fs

from batchjson.cli import main
from batchjson.engine.fake import FakeEngines
from batchjson.errors import StorageFault
from batchjson.job import run_job
from batchjson.spec import load_spec
from batchjson.storage import Lease, location
from helpers import write_job
from s3_proxy import FaultProxy
from storage.test_object_storage import ids_at, put_rows

@pytest.fixture
def proxy(s3, s3_server, monkeypatch):
    """The proxy, faultless until a test sets its rate; runs reach the store through it."""
    with FaultProxy(s3_server.endpoint) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{p.endpoint}")
        yield p


def run(job, out, **kwargs):
    return run_job(load_spec(job), out, engine_factory=FakeEngines(valid=0.6, seed=1), progress=False, **kwargs)


def assert_once(s3, out, n):
    got = ids_at(out) + ids_at(f"{out}/_rejects")
    assert not [k for k, v in collections.Counter(got).items() if v > 1], "rows written twice"
    assert sorted(got) == [f"r{i:05d}" for i in range(n)], "rows lost"


def check_fault(e: StorageFault, out: str):
    message = str(e)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(out.split("://")[0] + "://") and "This looks transient" in message
    assert "run the same command again" in message and "Check the URI" not in message


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_runs_through_faults_on_every_kind_of_request(tmp_path, tiny_model, s3, proxy, rate):
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 48)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    out = f"{s3}/out"
    proxy.rate, proxy.slow_s = rate, 0.2
    try:
        report = run(job, out)
        assert report.verified["complete"], report.verified
    except StorageFault as e:  # every attempt of one request failed: the rerun resumes
        check_fault(e, out)
        proxy.rate = 0
        assert run(job, out).verified["complete"]
    assert proxy.injected() >= 20 and set(proxy.faults) == {"503", "500", "reset", "cut", "slow"}, proxy.faults
    proxy.rate = 0
    assert_once(s3, out, 48)


def test_reads_cut_midway_are_retried_and_counted(tmp_path, tiny_model, s3, proxy):
    """A GET whose body broke off, then refused (503), is not retried by pyarrow (location.reading): batchjson
    retries the read as a whole, and the report counts it. 48 rows: enough GETs for 5 cuts at the proxy's seed."""
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 48)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    out = f"{s3}/out"
    proxy.rate, proxy.kinds, proxy.only = 0.5, ("cut", "503"), {"GET"}
    report = run(job, out)
    assert report.verified["complete"] and proxy.faults["cut"] >= 5, proxy.faults
    assert sum(report.storage_retries.values()) >= 5 and "reads retried" in report.summary(), report.storage_retries
    proxy.rate = 0
    assert_once(s3, out, 48)


def test_a_fault_that_outlasts_the_retries_ends_the_run_and_the_rerun_resumes(tmp_path, tiny_model, s3, proxy,
                                                                              monkeypatch):
    monkeypatch.setattr(location, "RETRIES", fs.AwsDefaultS3RetryStrategy(max_attempts=3))  # fail in 0.2 s
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 24)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    run(job, f"{s3}/probe")
    whole = sum(proxy.requests.values())  # what a run takes
    # Every part file's upload fails from midway through the run (POST: its multipart upload); the lease's
    # release (a DELETE) gets through, or the rerun would wait for it to expire.
    proxy.start_after, proxy.rate, proxy.kinds, proxy.only = whole + whole // 2, 1.0, ("503", "reset"), {"POST"}
    out = f"{s3}/out"
    with pytest.raises(StorageFault) as e:
        run(job, out)
    check_fault(e.value, out)
    assert proxy.faults["503"] + proxy.faults["reset"] >= 3, proxy.faults  # every attempt of one upload failed
    proxy.rate = 0
    kept = len(ids_at(out) + ids_at(f"{out}/_rejects"))
    assert 0 < kept < 24, "units committed before the fault are kept"
    report = run(job, out)
    assert report.resumed and report.verified["complete"]
    assert_once(s3, out, 24)


def test_a_lease_whose_delete_failed_too_is_explained_and_taken_over_once_expired(tmp_path, tiny_model, s3, proxy,
                                                                                  s3_server, monkeypatch):
    """The store fails every request from midway: the run ends, and its lease's DELETE fails too. The failing run
    says so; a rerun meanwhile is refused saying when the lease expires; after that it takes the lease over."""
    monkeypatch.setattr(location, "RETRIES", fs.AwsDefaultS3RetryStrategy(max_attempts=3))
    monkeypatch.setattr(Lease, "EXPIRY", 4.0)
    monkeypatch.setattr(Lease, "RENEW_EVERY", 1.0)
    put_rows(f"{s3}/in/a.parquet", tmp_path / "a.parquet", 24)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=4)
    run(job, f"{s3}/probe")
    whole = sum(proxy.requests.values())
    proxy.start_after, proxy.rate, proxy.kinds = whole + whole // 2, 1.0, ("503",)
    out = f"{s3}/out"
    with pytest.raises(StorageFault) as e:
        run(job, out)
    check_fault(e.value, out)
    assert proxy.injected() > 0, proxy.faults
    assert "could not be deleted" in str(e.value) and "expires" in str(e.value), e.value
    direct = s3_server.filesystem()
    state = f"{s3[len('s3://'):]}/out/_batchjson"
    assert [i for i in direct.get_file_info(fs.FileSelector(state)) if i.base_name.startswith("lease-")]
    proxy.rate = 0
    result = CliRunner().invoke(main, ["run", str(job), "--output", out])
    assert result.exit_code == 2 and "expires in" in result.output and "Traceback" not in result.output, result.output
    time.sleep(Lease.EXPIRY + 1)
    report = run(job, out)
    assert report.resumed and report.verified["complete"]
    assert_once(s3, out, 24)
    assert not [i for i in direct.get_file_info(fs.FileSelector(state)) if i.base_name.startswith("lease-")]


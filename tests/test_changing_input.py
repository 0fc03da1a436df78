"""An input file that changes under a running job: refused before a unit read from it is committed (exit 2, naming
the file); the units committed before stay whole, and a rerun on the old file, or --fresh on the new, completes."""

from __future__ import annotations

import functools
import os

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pyarrow import fs

from batchjson import api, cli
from batchjson.engine.fake import FakeEngines
from helpers import assert_exactly_once, at_commit_step, ids_of, write_job, write_rows
from storage.test_object_storage import ids_at


def change_after_commits(monkeypatch, n: int, change) -> None:
    """Call `change()` once the n-th unit is committed (the next commit is of rows read before or after it)."""
    at_commit_step("committed", n, change, monkeypatch.setattr)


def cli_run(monkeypatch, job, *args):
    monkeypatch.setattr(cli, "run_job", functools.partial(api.run_job, engine_factory=FakeEngines(valid=0.5)))
    return CliRunner().invoke(cli.main, ["run", str(job), *args])


@pytest.mark.parametrize("how", ["append", "overwrite"])
def test_an_input_file_changed_mid_run_is_refused_before_its_next_commit(tmp_path, monkeypatch, tiny_model, how):
    old = [f"r{i:05d}" for i in range(80)]
    src = write_rows(tmp_path / "in" / "a.parquet", 80, row_group_size=40)
    kept = src.read_bytes()
    write_rows(tmp_path / "in" / "b.parquet", 16, start=500)  # unchanged
    job = write_job(tmp_path, tiny_model, tmp_path / "in", batch_size=8)
    out = tmp_path / "out"
    new = tmp_path / "new.parquet"
    if how == "append":
        write_rows(new, 88)  # the same rows and 8 more
    else:
        write_rows(new, 80, start=1000)  # other rows, same count (likely the same size)

    def change():
        stat = src.stat()
        os.replace(new, src)
        os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a clock that did not tick meanwhile

    change_after_commits(monkeypatch, 2, change)
    result = cli_run(monkeypatch, job)
    assert result.exit_code == 2, result.output
    assert f"input file {src} changed" in result.output and "was not committed" in result.output, result.output
    assert "--fresh" in result.output
    committed = ids_of(out) + ids_of(out / "_rejects")
    assert committed and len(committed) == len(set(committed))
    assert set(committed) <= set(old), "rows of the new file were committed"
    monkeypatch.undo()

    # With the file changed, a rerun refuses (units of it are committed) and says what to do.
    result = cli_run(monkeypatch, job)
    assert result.exit_code == 2 and "changed since" in result.output and "--fresh" in result.output, result.output
    # The old file back: the run resumes and completes, each row once.
    src.write_bytes(kept)
    result = cli_run(monkeypatch, job)
    assert result.exit_code == 0 and "exactly-once check ok" in result.output, result.output
    assert_exactly_once(old + [f"r{i:05d}" for i in range(500, 516)], out, out / "_rejects")
    verdict = CliRunner().invoke(cli.main, ["verify", str(job)])
    assert verdict.exit_code == 0, verdict.output


@pytest.mark.parametrize("how", ["append", "overwrite"])
def test_s3_input_changed_mid_run(tmp_path, monkeypatch, tiny_model, s3, how):
    """The same on object storage, where a file's time is the store's (to the second): an overwrite of the same size
    within that second must be seen too."""
    filesystem, key = fs.FileSystem.from_uri(f"{s3}/in/a.parquet")
    rows = pq.read_table(write_rows(tmp_path / "rows.parquet", 88))
    pq.write_table(rows.slice(0, 80), tmp_path / "old.parquet", row_group_size=40, compression="none")
    old = (tmp_path / "old.parquet").read_bytes()
    if how == "append":
        pq.write_table(rows, tmp_path / "new.parquet", row_group_size=40, compression="none")
        new = (tmp_path / "new.parquet").read_bytes()
    else:  # one id rewritten in place: the same size, and most likely the same second
        assert old.count(b"r00041") == 1
        new = old.replace(b"r00041", b"r09941")

    def put(data: bytes) -> None:
        with filesystem.open_output_stream(key) as f:
            f.write(data)

    put(old)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=8)
    out = f"{s3}/out"
    with pytest.MonkeyPatch.context() as changing:  # the s3 fixture's environment stays
        change_after_commits(changing, 2, lambda: put(new))
        result = cli_run(changing, job, "--output", out)
    assert result.exit_code == 2, result.output
    assert f"input file {s3}/in/a.parquet changed" in result.output and "Traceback" not in result.output, result.output
    committed = ids_at(out) + ids_at(f"{out}/_rejects")
    assert committed and len(committed) == len(set(committed))
    assert set(committed) <= {f"r{i:05d}" for i in range(80)}, "rows of the new object were committed"

    put(old)  # put back: the run resumes and completes, each row once
    result = cli_run(monkeypatch, job, "--output", out)
    assert result.exit_code == 0 and "exactly-once check ok" in result.output, result.output
    got = ids_at(out) + ids_at(f"{out}/_rejects")
    assert sorted(got) == [f"r{i:05d}" for i in range(80)]


def test_a_run_refused_for_an_overwritten_s3_input_touches_nothing(tmp_path, monkeypatch, tiny_model, s3):
    """A finished job on S3 whose input object is then overwritten: the rerun is refused (exit 2, naming the object)
    and leaves every object of the output folder as it was, the index included (its lease comes and goes)."""
    filesystem, key = fs.FileSystem.from_uri(f"{s3}/in/a.parquet")
    pq.write_table(pq.read_table(write_rows(tmp_path / "a.parquet", 24)), key, filesystem=filesystem)
    job = write_job(tmp_path, tiny_model, f"{s3}/in", batch_size=8)
    out = f"{s3}/out"
    assert cli_run(monkeypatch, job, "--output", out).exit_code == 0

    def objects() -> dict[str, bytes]:
        below = fs.FileSystem.from_uri(out)[1]
        return {i.path: filesystem.open_input_stream(i.path).read()
                for i in filesystem.get_file_info(fs.FileSelector(below, recursive=True))
                if i.type == fs.FileType.File and not i.base_name.startswith("lease-")}

    before = objects()
    assert any(name.endswith("/_batchjson/index.arrows") for name in before)
    pq.write_table(pq.read_table(write_rows(tmp_path / "b.parquet", 24, start=100)), key, filesystem=filesystem)
    result = cli_run(monkeypatch, job, "--output", out)
    assert result.exit_code == 2 and f"input file a.parquet changed since {out} began" in result.output, result.output
    after = objects()
    assert sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name)) == []

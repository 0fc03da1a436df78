"""Row ids: the ids digest kept in the run state, repeated ids found a partition at a time, generated ids for
inputs without an id column, and a resume that reads only the input it has left. Real Parquet files, fake engine."""

from __future__ import annotations

import hashlib
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjson.cli import main
from batchjson.engine.fake import FakeEngines
from batchjson.ids import IdsDigest
from batchjson.job import run_job
from batchjson.source import ParquetSource
from batchjson.spec import load_spec
from helpers import assert_exactly_once, at_commit_step, ids_of, write_job, write_rows


def run(job, **kwargs):
    kwargs.setdefault("engine_factory", FakeEngines(valid=1.0))
    return run_job(load_spec(job), progress=False, **kwargs)


def legacy_digest(path) -> str:
    """How the run state's ids digest was computed before: every id a Python string, per chunk read_table made."""
    digest = hashlib.sha256()
    for chunk in pq.read_table(path, columns=["id"]).column(0).cast(pa.string()).chunks:
        digest.update("\x00".join(chunk.to_pylist()).encode() + b"\x01")
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("ids, row_group_size", [
    ([f"row-{i}" for i in range(300_000)], 200_000),  # row groups of several read chunks
    (list(range(50)), 7),  # integers, many small row groups
    (["", "a", "", "é"], None),  # empty ids
    ([], None),  # an empty file
])
def test_the_ids_digest_is_the_one_the_run_state_kept(tmp_path, ids, row_group_size):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64() if ids and isinstance(ids[0], int) else pa.string())}),
                   path, row_group_size=row_group_size)
    digest = IdsDigest()
    pf = pq.ParquetFile(path)
    for rg in range(pf.metadata.num_row_groups):
        digest.update(pf.read_row_group(rg).column(0).combine_chunks().cast(pa.string()))
    assert digest.hexdigest() == legacy_digest(path)


def test_repeated_ids_across_units_are_found_a_partition_at_a_time(tmp_path, tiny_model, monkeypatch):
    """A cap of 16 ids held at once over 120 ids in 3 files: the repeats across files and units are still found,
    and the run rejects each later occurrence as duplicate_id."""
    monkeypatch.setenv("BATCHJSON_ID_PARTITION_ROWS", "16")
    for k in range(3):
        write_rows(tmp_path / "in" / f"{k}.parquet", 40, start=k * 40, row_group_size=10)
    pq.write_table(pa.table({"id": ["r00005", "r00077", "new", "r00005"], "text": ["a", "b", "c", "d"],
                             "source": ["x"] * 4}), tmp_path / "in" / "3.parquet")
    job = write_job(tmp_path, tiny_model, tmp_path / "in", batch_size=5)
    spec = load_spec(job)
    scan = ParquetSource(spec.input, spec.prompt.columns).scan()
    assert 0 < scan.held < 124 / 2, scan.held  # no one set of every id
    assert {i: len(p) for i, p in scan.repeated.items()} == {"r00005": 3, "r00077": 2}
    (key, row), *later = scan.repeated["r00005"]  # in input order: file 0.parquet's row 5 (its second unit) first
    assert key.startswith("0-") and key.endswith("-00000-00001") and row == 0
    assert [k.split("-")[0] for k, _ in later] == ["3", "3"]
    report = run(job)
    rejects = pq.read_table(tmp_path / "out" / "_rejects").to_pylist()
    assert sorted((r["id"], r["reason"]) for r in rejects) == [("r00005", "duplicate_id")] * 2 + [
        ("r00077", "duplicate_id")]
    assert sorted(set(ids_of(tmp_path / "out"))) == sorted(ids_of(tmp_path / "out"))
    assert report.verified["ok"]


def generated_job(tmp_path, tiny_model, files=2, rows=12):
    """Input files without an id column (rows in row groups of 5), and a job that generates the ids."""
    (tmp_path / "in").mkdir()
    for k in range(files):
        pq.write_table(pa.table({"text": [f"thing {k}-{i}" for i in range(rows)], "source": ["s"] * rows}),
                       tmp_path / "in" / f"part-{k}.parquet", row_group_size=5)
    return _with_generated(write_job(tmp_path, tiny_model, tmp_path / "in", batch_size=3))


def _with_generated(job):
    job.write_text(job.read_text().replace("[input]\n", "[input]\ngenerate_ids = true\n", 1))
    return job


def expected_generated(files=2, rows=12, group=5):
    return [f"part-{k}.parquet:{i // group}:{i % group}" for k in range(files) for i in range(rows)]


def test_an_input_without_ids_is_refused_with_the_setting_that_takes_it(tmp_path, tiny_model):
    job = generated_job(tmp_path, tiny_model)
    job.write_text(job.read_text().replace("generate_ids = true\n", ""))
    result = CliRunner().invoke(main, ["run", str(job)])
    assert result.exit_code == 2 and "part-0.parquet" in result.output and "input.generate_ids = true" in result.output


def test_generated_ids_survive_a_resume(tmp_path, tiny_model):
    """Killed after two commits, resumed: every row once, under the id its place gives it, on both runs."""
    job = generated_job(tmp_path, tiny_model)

    class Killed(Exception):
        pass

    def kill():
        raise Killed

    with pytest.MonkeyPatch.context() as mp:
        at_commit_step("committed", 3, kill, mp.setattr)
        with pytest.raises(Killed):
            run(job, engine_factory=FakeEngines(valid=0.6))
    first = set(ids_of(tmp_path / "out") + ids_of(tmp_path / "out" / "_rejects"))
    assert first and first < set(expected_generated())
    report = run(job, engine_factory=FakeEngines(valid=0.6))
    assert report.resumed and report.verified["ok"]
    assert_exactly_once(expected_generated(), tmp_path / "out", tmp_path / "out" / "_rejects")
    assert CliRunner().invoke(main, ["verify", str(job)]).exit_code == 0


def test_generated_ids_refuse_a_changed_input_file(tmp_path, tiny_model):
    """The same rows written again (same size and footer): with generated ids nothing but the file vouches for a
    row's place, so the rewrite is refused (exit 2, naming the file); restored with its time, it is taken again."""
    job = generated_job(tmp_path, tiny_model)
    run(job)
    victim = tmp_path / "in" / "part-1.parquet"
    data, stat = victim.read_bytes(), victim.stat()
    victim.write_bytes(data)
    result = CliRunner().invoke(main, ["run", str(job)])
    assert result.exit_code == 2, result.output
    assert "part-1.parquet changed since" in result.output and "stamp" in result.output
    assert "input.generate_ids" in result.output
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert CliRunner().invoke(main, ["run", str(job)]).exit_code == 0


def test_generated_ids_refuse_an_input_that_has_the_id_column(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 4)
    job = _with_generated(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 2 and "in.parquet has a column 'id'" in result.output


def _spoil_row_groups(path, keep: int) -> None:
    """Overwrite the data of every row group but `keep` with 0xFF, keeping the file's size, footer and time: a
    reader of those row groups fails, a reader of the footer or of row group `keep` does not."""
    stat, md = path.stat(), pq.ParquetFile(path).metadata
    with open(path, "r+b") as f:
        for rg in range(md.num_row_groups):
            if rg == keep:
                continue
            for c in range(md.num_columns):
                col = md.row_group(rg).column(c)
                start = min(x for x in (col.dictionary_page_offset, col.data_page_offset) if x is not None)
                f.seek(start)
                f.write(b"\xff" * col.total_compressed_size)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_resume_reads_only_the_input_it_has_left(tmp_path, tiny_model):
    """A finished run, one unit's output deleted: the rerun redoes that unit reading its row group and the
    footers, nothing else of the input (the other row groups are made unreadable, in place, to prove it)."""
    path = write_rows(tmp_path / "in.parquet", 40, row_group_size=8)
    job = write_job(tmp_path, tiny_model, path, batch_size=8)
    run(job)
    victim = sorted((tmp_path / "out").glob("p1-*-00002-00000.parquet"))[0]
    victim.unlink()
    _spoil_row_groups(path, keep=2)
    with pytest.raises(OSError):
        pq.ParquetFile(path).read_row_group(0)  # the spoiling works
    report = run(job)
    # The redone unit was checked as it committed: the end check reads no unit again
    assert report.passes["pass1"].rows == 8 and report.verified["ok"] and report.verified["read"] == 0
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")

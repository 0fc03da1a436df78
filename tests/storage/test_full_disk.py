"""A full disk at each write of a run, on a real tmpfs: a message naming the file (exit 2), no temporary file left,
nothing half-published that a reader sees, and the rerun after space is freed completes exactly once."""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjson import api, cli
from batchjson.engine.fake import FakeEngines
from helpers import assert_exactly_once, at_commit_step, write_job, write_rows

IDS = [f"r{i:05d}" for i in range(120)]


@pytest.fixture
def disk(tmp_path):
    """A 2 MiB tmpfs: a real file system that runs out of space."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> None:
    """Take every free byte of the disk (a ballast file), so that the next write fails with ENOSPC."""
    with open(disk / "ballast", "ab", buffering=0) as f:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                continue


def free(disk: Path) -> None:
    (disk / "ballast").unlink(missing_ok=True)


def fill_after(monkeypatch, disk: Path, step: str, n: int) -> None:
    """Fill the disk the n-th time the commit protocol reaches `step` ("p2:<step>": in pass 2 only)."""
    at_commit_step(step, n, lambda: fill(disk), monkeypatch.setattr)


def cli_run(monkeypatch, job, out):
    monkeypatch.setattr(cli, "run_job", functools.partial(api.run_job, engine_factory=FakeEngines(valid=0.5)))
    return CliRunner().invoke(cli.main, ["run", str(job), "--output", str(out)])


def assert_nothing_half(disk: Path, out: Path) -> None:
    """No temporary file anywhere; what readers of the output and rejects read reads, each row at most once."""
    temps = [str(p) for p in disk.rglob("*") if p.name.startswith(".tmp-")
             or (p.name.endswith(".tmp") and not _listed(out, p))]
    assert not temps, f"temporary files left: {temps}"
    seen = []
    for folder in (out, out / "_rejects"):
        dataset = ds.dataset(str(folder), format="parquet") if folder.is_dir() else None
        if dataset is not None and dataset.files:
            seen += dataset.to_table(columns=["id"]).column("id").to_pylist()
            for f in folder.glob("*.parquet"):  # DuckDB's read_parquet('OUT/*.parquet')
                pq.read_table(f)
    assert len(seen) == len(set(seen)), "a row is there twice"


def _listed(out: Path, staged: Path) -> bool:
    """A staged file whose unit's record exists (committed, to be published at the next open) is not a temp file."""
    from batchjson.storage.names import PartName

    kind = "requeue" if staged.parent.name == "requeue" else None
    part = PartName.parse(staged.name, kind)
    return (out / "_batchjson" / "units" / part.unit.file_name()).exists()


@pytest.mark.parametrize("step, n", [
    ("start", 0),             # the run state: spec.json, the input fingerprints
    ("begin", 3),             # a staged output (or rejects) file
    ("staged output", 2),     # the next staged file of the unit: rejects or requeue, or its commit record
    ("staged requeue", 4),    # the commit record (a unit that requeues has staged all its files)
    ("committed", 5),         # the next unit's files, after this one is published (a rename takes no space)
    ("p2:staged output", 1),  # a pass-2 unit
])
def test_a_full_disk_at_each_write_then_the_rerun_completes_once(tmp_path, disk, monkeypatch, tiny_model, step, n):
    write_rows(tmp_path / "in.parquet", len(IDS))
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=8)  # 15 units
    out = disk / "out"
    if step == "start":
        fill(disk)
    else:
        fill_after(monkeypatch, disk, step, n)
    result = cli_run(monkeypatch, job, out)
    assert result.exit_code == 2, result.output
    message = result.output.strip().splitlines()[-1]
    assert "the disk is full" in message and f"cannot write {out}" in message, message
    assert "run the same command again" in message
    assert_nothing_half(disk, out)

    free(disk)
    monkeypatch.undo()
    result = cli_run(monkeypatch, job, out)
    assert result.exit_code == 0, result.output
    assert "exactly-once check ok" in result.output
    assert_exactly_once(IDS, out, out / "_rejects")
    assert not [p for p in disk.rglob("*") if p.name.startswith(".")], "hidden files left after the rerun"


def test_a_full_disk_at_the_run_report(tmp_path, disk, monkeypatch, tiny_model):
    """A finished run whose report cannot be written: exit 2 naming _report.json, the old report untouched."""
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=8)
    out = disk / "out"
    assert cli_run(monkeypatch, job, out).exit_code == 0
    before = (out / "_report.json").read_text()
    fill(disk)
    result = cli_run(monkeypatch, job, out)
    assert result.exit_code == 2, result.output
    assert f"cannot write {out / '_report.json'}: the disk is full" in result.output
    assert (out / "_report.json").read_text() == before
    assert_nothing_half(disk, out)
    free(disk)
    assert cli_run(monkeypatch, job, out).exit_code == 0
    assert_exactly_once(IDS[:40], out, out / "_rejects")


def test_a_full_temporary_folder_while_the_ids_are_spilled(tmp_path, disk, monkeypatch, tiny_model):
    """Repeated ids are looked for in partitions spilled to TMPDIR: a full one is exit 2 naming it and the fix,
    before the output folder is touched, and leaves nothing in it."""
    write_rows(tmp_path / "in.parquet", 400, row_group_size=100)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=100)
    monkeypatch.setenv("BATCHJSON_ID_PARTITION_ROWS", "50")
    monkeypatch.setattr(tempfile, "tempdir", str(disk))  # TMPDIR as Python took it, before the disk filled up
    fill(disk)
    result = cli_run(monkeypatch, job, tmp_path / "out")
    message = result.output.strip().splitlines()[-1]
    assert result.exit_code == 2 and f"cannot write {disk}/batchjson-ids-" in message and "TMPDIR" in message, message
    assert [p.name for p in disk.iterdir()] == ["ballast"] and not (tmp_path / "out").exists()
    free(disk)
    assert cli_run(monkeypatch, job, tmp_path / "out").exit_code == 0

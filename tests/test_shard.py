"""Sharding: N shards cover the input exactly once, by whole row groups, and together write the rows of one run."""

from __future__ import annotations

import collections

import pyarrow.dataset as ds
import pytest

from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.source import ParquetSource
from batchjson.spec import load_spec
from helpers import write_job, write_rows

INPUT_IDS = [f"r{i:05d}" for i in range(45)]


def write_input(folder):
    """Three files: 3 row groups of 8 (batch_size 4 splits each in two units), 4 groups of 3, and 9 rows in one."""
    write_rows(folder / "a.parquet", 24, row_group_size=8)
    write_rows(folder / "b.parquet", 12, start=24, row_group_size=3)
    write_rows(folder / "c.parquet", 9, start=36)
    return folder


def ids_of(folder):
    files = sorted(str(p) for p in folder.glob("*.parquet"))
    return ds.dataset(files, format="parquet").to_table(columns=["id"]).column("id").to_pylist() if files else []


def units_by_shard(source, n):
    return [[(u.key, u.batch.column("id").to_pylist()) for u in source.read(source.plan((i, n)))] for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 8, 20])
def test_shards_partition_the_units_by_whole_row_groups(tmp_path, n):
    spec = load_spec(write_job(tmp_path, "no-model", write_input(tmp_path / "in"), batch_size=4))
    source = ParquetSource(spec.input, spec.prompt.columns)
    everything = [key for key, _ in units_by_shard(source, 1)[0]]
    per_shard = units_by_shard(source, n)
    keys = [key for shard in per_shard for key, _ in shard]
    assert sorted(keys) == sorted(everything) and len(set(keys)) == len(keys)
    assert sorted(i for shard in per_shard for _, ids in shard for i in ids) == INPUT_IDS
    # A row group (the key without its batch number) belongs to exactly one shard.
    groups = [{key.rsplit("-", 1)[0] for key, _ in shard} for shard in per_shard]
    assert sum(len(g) for g in groups) == len(set().union(*groups)) == 8
    assert units_by_shard(source, n) == per_shard  # deterministic


def test_an_empty_shard_starts_no_engine(tmp_path):
    write_rows(tmp_path / "in.parquet", 5)
    spec = load_spec(write_job(tmp_path, "no-model", tmp_path / "in.parquet"))

    class NoEngine(FakeEngines):
        def start(self, *args):
            raise AssertionError("shard 1/2 of a one-row-group input has no work")

    report = run_job(spec, shard=(1, 2), engine_factory=NoEngine(), progress=False)
    assert report.passes == {} and report.valid == report.rejected == 0


@pytest.mark.engine
def test_sharded_runs_write_exactly_the_rows_of_one_run(tmp_path, tiny_model, engines):
    # 3 tokens finish no object: every row goes through both passes, and each shard's pass 2 takes only its own.
    spec = load_spec(write_job(tmp_path, tiny_model, write_input(tmp_path / "in"), batch_size=4, max_tokens=3))
    whole = run_job(spec, str(tmp_path / "whole"), engine_factory=engines, progress=False)
    sharded = tmp_path / "sharded"
    reports = [run_job(spec, str(sharded), shard=(i, 3), engine_factory=engines, progress=False) for i in range(3)]

    got = ids_of(sharded) + ids_of(sharded / "_rejects")
    assert not [k for k, v in collections.Counter(got).items() if v > 1], "a row was written by two shards"
    assert sorted(got) == sorted(ids_of(tmp_path / "whole") + ids_of(tmp_path / "whole" / "_rejects")) == INPUT_IDS
    for name in ("pass1", "pass2"):
        assert sum(r.passes[name].rows for r in reports) == whole.passes[name].rows == 45
    # Which rows pass can differ (the fallback samples, in other batches); every shard's report tallies the shared
    # folder, so the last one to finish accounts for every row.
    assert reports[-1].valid + reports[-1].rejected == 45 and reports[-1].valid > 0

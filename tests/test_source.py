"""Parquet input: files, folders and globs; clear messages for missing columns and unreadable files."""

from __future__ import annotations

import pytest

from batchjson.errors import InputError
from batchjson.source import ParquetSource
from batchjson.spec import InputSpec
from helpers import write_rows


def test_folder_is_read_in_batches_with_stable_keys(tmp_path):
    write_rows(tmp_path / "a.parquet", 10, row_group_size=4)
    write_rows(tmp_path / "b.parquet", 3, start=10)
    (tmp_path / "_skip").mkdir()
    write_rows(tmp_path / "_skip" / "c.parquet", 5, start=100)
    src = ParquetSource(InputSpec(path=str(tmp_path), batch_size=3), ("text",))
    assert src.check() == 13
    units = list(src.read(src.plan()))
    ids = [i for u in units for i in u.batch.column("id").to_pylist()]
    assert ids == [f"r{i:05d}" for i in range(13)]
    assert [u.key for u in units] == [u.key for u in src.plan()]
    assert len({u.key for u in units}) == len(units)
    assert max(u.batch.num_rows for u in units) <= 3


def test_shards_split_row_groups_exactly(tmp_path):
    write_rows(tmp_path / "a.parquet", 50, row_group_size=7)
    src = ParquetSource(InputSpec(path=str(tmp_path)), ("text",))
    every = sorted(i for u in src.read(src.plan()) for i in u.batch.column("id").to_pylist())
    shards = [[i for u in src.read(src.plan((k, 3))) for i in u.batch.column("id").to_pylist()] for k in range(3)]
    assert sorted(sum(shards, [])) == every and all(shards)


def test_a_unit_is_made_from_its_key_as_planning_makes_it(tmp_path):
    """`ref` (what a replica does with the keys it is handed) gives each shard's units as `plan` does, and no other
    shard's, nor a key no plan makes."""
    write_rows(tmp_path / "a-b.parquet", 10, row_group_size=4)
    write_rows(tmp_path / "c.parquet", 9, start=10, row_group_size=5)
    src = ParquetSource(InputSpec(path=str(tmp_path), batch_size=3), ("text",))
    for shard in [(0, 1), (0, 2), (1, 2)]:
        planned = src.plan(shard)
        refs = ParquetSource(InputSpec(path=str(tmp_path), batch_size=3), ("text",)).refs(shard)
        assert [refs[u.key] for u in planned] == planned
        for other in {u.key for u in src.plan()} - {u.key for u in planned}:
            with pytest.raises(KeyError):
                refs[other]
    key = src.plan()[0].key
    for bad in ["", "x", key[:-1] + "9", key[:-5] + "0000", key.replace("-00000-", "-00009-"), "p1-" + key]:
        with pytest.raises(KeyError):
            src.ref(bad)


def test_glob_and_missing_paths(tmp_path):
    write_rows(tmp_path / "a.parquet", 2)
    assert ParquetSource(InputSpec(path=str(tmp_path / "*.parquet")), ("text",)).check() == 2
    with pytest.raises(InputError, match="no Parquet file at"):
        ParquetSource(InputSpec(path=str(tmp_path / "nope")), ("text",))


def test_missing_column_names_file_and_column(tmp_path):
    f = write_rows(tmp_path / "a.parquet", 2)
    with pytest.raises(InputError, match=r"a.parquet: column 'body' is missing"):
        ParquetSource(InputSpec(path=str(f)), ("body",)).check()
    with pytest.raises(InputError, match="column 'key' is missing.*input.id_column"):
        ParquetSource(InputSpec(path=str(f), id_column="key"), ("text",)).check()


def test_corrupt_file_among_good_ones_is_named(tmp_path):
    write_rows(tmp_path / "a.parquet", 2)
    (tmp_path / "b.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputError, match="b.parquet: not a readable Parquet file"):
        ParquetSource(InputSpec(path=str(tmp_path)), ("text",)).check()

"""Parquet input -> units of work (record batches keyed by file, row group and batch), streamed with pyarrow."""

from __future__ import annotations

import glob
import os
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchjson.errors import InputError
from batchjson.spec import InputSpec


@dataclass(slots=True)
class Unit:
    """One committed unit of work: a record batch of one row group of one file."""

    key: str
    file: str
    batch: pa.RecordBatch


def list_files(path: str) -> list[Path]:
    """The Parquet files a file, folder or glob names, in a stable order."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.parquet") if not any(s.startswith(("_", ".")) for s in f.parts[len(p.parts):]))
    elif any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True))
    else:
        files = [p] if p.exists() else []
    if not files:
        raise InputError(f"input.path: no Parquet file at {path}. Check the path (relative paths start at the spec's folder).")
    return files


class ParquetSource:
    """Reads the input files lazily, one record batch at a time; never holds the dataset in memory."""

    def __init__(self, spec: InputSpec, prompt_columns: tuple[str, ...]):
        self.spec = spec
        self.files = list_files(spec.path)
        root = Path(spec.path)
        self.root = root if root.is_dir() else Path(os.path.commonpath([f.parent for f in self.files]))
        self.columns = list(dict.fromkeys((spec.id_column, *prompt_columns, *spec.passthrough)))

    def _open(self, path: Path) -> pq.ParquetFile:
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"{path}: not a readable Parquet file ({e}). Remove or repair it and run again; "
                             "finished work is kept.") from None
        missing = [c for c in self.columns if c not in pf.schema_arrow.names]
        if missing:
            raise InputError(f"{path}: column {missing[0]!r} is missing (the spec needs {self.columns}; the file has "
                             f"{pf.schema_arrow.names}). Fix input.id_column, input.passthrough or the prompt template.")
        return pf

    def check(self) -> int:
        """Open every file's footer and check the columns; returns the number of input rows."""
        return sum(self._open(f).metadata.num_rows for f in self.files)

    def units(self, shard: tuple[int, int] = (0, 1)) -> Iterator[Unit]:
        """Every unit of the input (of one shard: whole row groups dealt round-robin), in a stable order."""
        index, count = shard
        n = 0
        for path in self.files:
            pf = self._open(path)
            # Keyed by the path below the input root, so nodes that mount the input elsewhere agree on the keys.
            tag = hashlib.sha1(str(path.relative_to(self.root)).encode()).hexdigest()[:10]
            for rg in range(pf.num_row_groups):
                n += 1
                if (n - 1) % count != index:
                    continue
                try:
                    batches = pf.iter_batches(batch_size=self.spec.batch_size, row_groups=[rg], columns=self.columns)
                    for b, batch in enumerate(batches):
                        yield Unit(f"{path.stem}-{tag}-{rg:05d}-{b:05d}", str(path), batch)
                except (OSError, pa.ArrowException) as e:
                    raise InputError(f"{path}: row group {rg} cannot be read ({e}). Repair or remove the file and "
                                     "run again; finished work is kept.") from None

    def check_ids(self) -> dict[str, tuple[str, int]]:
        """Read only the id column of every file. A null id is an input error (a row without a key cannot be
        tracked); ids that occur more than once map to the unit and row of their first occurrence, and later
        occurrences are rejected as duplicate_id."""
        columns = []
        for f in self.files:
            column = pq.read_table(f, columns=[self.spec.id_column]).column(0)
            if column.null_count:
                row = pc.index(pc.is_null(column), True).as_py()
                raise InputError(f"{f}: row {row} has a null {self.spec.id_column!r}; every row needs an id. "
                                 "Fill or drop such rows, or choose another input.id_column.")
            columns.append(column.cast(pa.string()))
        counts = pc.value_counts(pa.chunked_array(columns, pa.string()))
        repeated = {v.as_py() for v, n in zip(counts.field("values"), counts.field("counts")) if n.as_py() > 1}
        first: dict[str, tuple[str, int]] = {}
        if repeated:
            for unit in self.units():
                for i, row_id in enumerate(unit.batch.column(self.spec.id_column).cast(pa.string()).to_pylist()):
                    if row_id in repeated:
                        first.setdefault(row_id, (unit.key, i))
        return first

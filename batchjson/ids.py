"""The input's row ids: their text form, generated ids, each file's ids digest, and the ids the input repeats, found
in memory that does not grow with the input (hash partitions spilled to a temporary folder, checked one at a time).

No id becomes a Python object here except the repeated ones: digests and partitions work on Arrow buffers.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchjson.errors import InputError, StorageFull, is_full

PARTITION_ROWS = 1_000_000
"""Ids held at once while repeated ids are looked for: the input's ids are split by a hash into partitions of about
this many, and each partition is counted alone. BATCHJSON_ID_PARTITION_ROWS overrides it (tests force a small one)."""
MAX_PARTITIONS = 256  # each partition is an open file while the ids are spilled; beyond it, partitions grow instead
HASH_CHUNK = 65_536  # ids hashed at once: the hash holds 8 bytes per byte of them
READ_CHUNK = 131_072  # pyarrow's read_table batch size: the ids digest goes chunk by chunk as it always did
_ROW = pa.schema([("id", pa.string()), ("file", pa.int32()), ("row", pa.int64())])


def id_strings(column: pa.Array | pa.ChunkedArray, where: str = "") -> pa.Array | pa.ChunkedArray:
    """The row identity: the id column as text, the same way everywhere (duplicate check, prompts, resume,
    verify). Arrow's cast is the one rule: 1.0 -> "1", True -> "true", so 1.0 and 1 are the same row."""
    try:
        ids = column.cast(pa.string())
        ids.validate(full=True)  # invalid UTF-8 would only fail later, in the middle of a unit
        return ids
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise InputError(f"{where}: the id column ({column.type}) cannot be used as row ids ({e}). Use a column of "
                         "strings or integers (valid UTF-8) as input.id_column.") from None


def row_ids(column: pa.Array | pa.ChunkedArray, where: str = "") -> list[str]:
    return id_strings(column, where).to_pylist()


def generated(below: str, row_group: int, start: int, rows: int) -> pa.Array:
    """Generated ids (input.generate_ids): "<path below the input root>:<row group>:<row in the row group>" for rows
    [start, start + rows) of one row group. They name where the row is, so they are unique and the same on every
    run over the same files."""
    rows_text = pa.array(np.arange(start, start + rows, dtype=np.int64)).cast(pa.string())
    return pc.binary_join_element_wise(f"{below}:{row_group}:", rows_text, "")


class IdsDigest:
    """A file's ids in order, digested: sha256 of the ids joined by NUL, each read chunk ended by \\x01 (the form the
    run state has always kept), from the Arrow buffers rather than one Python string per id."""

    def __init__(self):
        self._sha = hashlib.sha256()
        self._chunks = 0

    def update(self, ids: pa.Array) -> None:
        """Add one row group's ids, in the chunks pyarrow's read_table would have made of them."""
        for start in range(0, len(ids), READ_CHUNK):
            chunk = ids.slice(start, READ_CHUNK)
            if len(chunk):
                joined = pc.binary_join_element_wise(chunk, "", "\x00")  # each id with a NUL after it
                offsets = np.frombuffer(joined.buffers()[1], np.int32, len(joined) + 1, joined.offset * 4)
                data = memoryview(joined.buffers()[2])[offsets[0]:offsets[-1] - 1]  # the last NUL is the \x01
                self._sha.update(data)
            self._sha.update(b"\x01")
            self._chunks += 1

    def hexdigest(self) -> str:
        if not self._chunks:  # read_table makes one empty chunk of a file without rows
            self._sha.update(b"\x01")
            self._chunks = 1
        return self._sha.hexdigest()[:16]


def _hash(ids: pa.Array) -> np.ndarray:
    """A 64-bit hash of each id (a polynomial over its UTF-8 bytes, then mixed), computed with numpy per byte."""
    offsets = np.frombuffer(ids.buffers()[1], np.int32, len(ids) + 1, ids.offset * 4).astype(np.int64)
    lo, hi = offsets[0], offsets[-1]
    lengths = np.diff(offsets)
    h = lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    if hi > lo:
        data = np.frombuffer(ids.buffers()[2], np.uint8)[lo:hi].astype(np.uint64)
        starts = offsets[:-1] - lo
        powers = np.cumprod(np.full(int(lengths.max()), 0x100000001B3, np.uint64))
        with np.errstate(over="ignore"):
            data *= powers[np.arange(hi - lo) - np.repeat(starts, lengths)]
            some = lengths > 0
            h[some] += np.add.reduceat(data, starts[some])
    with np.errstate(over="ignore"):
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
    return h


class RepeatedIds:
    """Finds the ids that occur more than once in the input, holding about `cap` ids at a time.

    `add` takes each row group's ids as they are read; with more ids than the cap they are split by hash into
    partitions spilled to a temporary folder (TMPDIR), and `repeated` counts one partition at a time. An id's
    occurrences all land in one partition, so no set of every id is ever held. `largest`: the most ids held at once."""

    def __init__(self, rows: int, cap: int | None = None):
        cap = cap or int(os.environ.get("BATCHJSON_ID_PARTITION_ROWS") or PARTITION_ROWS)
        self.count = min(MAX_PARTITIONS, max(1, math.ceil(rows / cap)))
        self.largest = 0
        self._held: list[pa.Table] = []
        self._folder = tempfile.TemporaryDirectory(prefix="batchjson-ids-") if self.count > 1 else None
        self._writers = []
        with self._spilling():
            for p in range(self.count if self._folder else 0):
                self._writers.append(pa.ipc.new_stream(os.path.join(self._folder.name, f"{p}.arrows"), _ROW))

    @contextlib.contextmanager
    def _spilling(self) -> Iterator[None]:
        """A full TMPDIR is the user's to fix: say so, and leave nothing behind."""
        try:
            yield
        except OSError as e:
            if not is_full(e):
                raise
            self._close()
            raise StorageFull(f"{StorageFull.at(self._folder.name, e)} It holds the input's ids while repeated ids "
                              "are looked for (about their size): or point TMPDIR at a larger disk.") from None

    def __enter__(self) -> RepeatedIds:
        return self

    def __exit__(self, *exc) -> None:
        self._close()

    def _close(self) -> None:
        writers, self._writers, self._held = self._writers, [], []
        for writer in writers:
            with contextlib.suppress(OSError):  # a full disk: its last bytes go with the folder anyway
                writer.close()
        if self._folder:
            self._folder.cleanup()

    def add(self, ids: pa.Array, file: int, first_row: int) -> None:
        """One row group's ids (text, no nulls) of input file number `file`, whose first row is `first_row`."""
        rows = pa.table([ids, pa.array(np.full(len(ids), file, np.int32)),
                         pa.array(np.arange(first_row, first_row + len(ids), dtype=np.int64))], schema=_ROW)
        if self._folder is None:
            self._held.append(rows)
            return
        part = np.concatenate([_hash(ids.slice(i, HASH_CHUNK)) for i in range(0, len(ids), HASH_CHUNK)] or
                              [np.empty(0, np.uint64)]) % np.uint64(self.count)
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(self.count + 1))
        rows = rows.take(pa.array(order))
        with self._spilling():
            for p in range(self.count):
                if bounds[p + 1] > bounds[p]:
                    self._writers[p].write_table(rows.slice(bounds[p], bounds[p + 1] - bounds[p]))

    def _partitions(self) -> Iterator[pa.Table]:
        if self._folder is None:
            yield pa.concat_tables(self._held) if self._held else _ROW.empty_table()
            return
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()
        for p in range(self.count):
            with pa.ipc.open_stream(os.path.join(self._folder.name, f"{p}.arrows")) as reader:
                yield reader.read_all()
            os.unlink(os.path.join(self._folder.name, f"{p}.arrows"))

    def repeated(self) -> list[tuple[str, int, int]]:
        """(id, file number, row in the file) of every occurrence of each repeated id, in input order."""
        found = []
        for table in self._partitions():
            self.largest = max(self.largest, table.num_rows)
            counts = pc.value_counts(table.column("id").combine_chunks())
            twice = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
            if len(twice):
                found.append(table.filter(pc.is_in(table.column("id"), value_set=twice)))
            del table, counts
        self._close()
        if not found:
            return []
        every = pa.concat_tables(found).sort_by([("file", "ascending"), ("row", "ascending")])
        return list(zip(*(every.column(c).to_pylist() for c in ("id", "file", "row"))))

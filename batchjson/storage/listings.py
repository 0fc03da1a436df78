"""The listings of an output folder's sub-folders as Arrow tables (name, size, mtime), and those begun early.

A resume lists the records' folder and the part folders, hundreds of thousands of files at 100 million rows: a
table of three columns holds them where tuples would be a Python object each, and is compared with the index's
columns by look-ups of names (survey.py). `Listings` begins some on a thread of its own, beside the rest of the
run's start (`Commits.read_index`), to be taken once by whoever needs them first.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa

from batchjson.storage.location import Location
from batchjson.storage.names import UnitName

LISTED = pa.schema([("name", pa.string()), ("size", pa.int64()), ("mtime", pa.int64())])
CHUNK = 65536  # the entries built into one record batch: no Python object per entry outlives its chunk


def _batch(names: list, sizes: list, mtimes: list) -> pa.RecordBatch:
    return pa.record_batch([pa.array(names, pa.string()), pa.array(sizes, pa.int64()), pa.array(mtimes, pa.int64())],
                           schema=LISTED)


def list_folder(folder: Location, stat: bool = True) -> pa.Table:
    """The files directly in `folder` as a table (name, size, mtime), as `Location.listing` lists them; locally
    without a tuple or a generator's step per file (a stat each: at 100 million rows, 585,000 files). `stat`:
    False, locally the names alone (sizes and times 0), no file looked at beyond its directory entry (x5 faster)."""
    if not folder.local:
        return table_of(folder.listing())
    if not stat:
        try:
            with os.scandir(folder.path) as entries:
                names = [entry.name for entry in entries if entry.is_file()]
        except (FileNotFoundError, NotADirectoryError):
            names = []
        zeros = pa.repeat(pa.scalar(0, pa.int64()), len(names))
        return pa.Table.from_arrays([pa.array(names, pa.string()), zeros, zeros], schema=LISTED)
    try:
        entries = os.scandir(folder.path)
    except (FileNotFoundError, NotADirectoryError):
        return table_of(iter(()))
    batches, names, sizes, mtimes = [], [], [], []
    with entries:
        for entry in entries:
            try:
                if entry.is_file():
                    info = entry.stat()
                    names.append(entry.name)
                    sizes.append(info.st_size)
                    mtimes.append(info.st_mtime_ns)
            except FileNotFoundError:
                continue  # gone since the directory was read
            if len(names) == CHUNK:
                batches.append(_batch(names, sizes, mtimes))
                names, sizes, mtimes = [], [], []
    batches.append(_batch(names, sizes, mtimes))
    return pa.Table.from_batches(batches, schema=LISTED)


def stat_files(folder: Location, names: Iterable[str]) -> pa.Table:
    """These files of a local `folder` as `list_folder` lists them, each looked at (a stat); one that is not there
    is left out."""
    found = []
    for name in names:
        try:
            info = os.stat(os.path.join(folder.path, name))
        except (FileNotFoundError, NotADirectoryError):
            continue
        found.append((name, info.st_size, info.st_mtime_ns))
    return table_of(iter(found))


def table_of(entries: Iterator[tuple[str, int, int]]) -> pa.Table:
    """A listing's (name, size, mtime) as an Arrow table, built CHUNK entries at a time."""
    batches, chunk = [], []
    for entry in entries:
        chunk.append(entry)
        if len(chunk) == CHUNK:
            batches.append(_batch(*map(list, zip(*chunk))))
            chunk = []
    if chunk:
        batches.append(_batch(*map(list, zip(*chunk))))
    return pa.Table.from_batches(batches, schema=LISTED)


class Listings:
    """Folders' listings begun early (`begin`), each taken once (`take`), else listed when asked for."""

    def __init__(self):
        self._begun: dict[str, Future] = {}  # folder path -> its listing as a table, under way

    def begin(self, folders: Iterable[Location]) -> None:
        """List these folders, one after the other, by name (locally a stat of each file is what most of a listing
        costs), on a thread of their own."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="batchjson-listing")
        self._begun = {folder.path: pool.submit(list_folder, folder, False) for folder in
                       {f.path: f for f in folders}.values()}
        pool.shutdown(wait=False)

    def take(self, folder: Location, keep: bool = False, stat: bool = True) -> pa.Table:
        """The folder's files (name, size, mtime) as a table: the listing `begin` began, taken once (`keep`: left
        for the next look), else listed now (`stat`: False, names only: sizes and times 0 locally). A listing of
        names does not answer for one with stamps."""
        if stat and folder.local:
            self._begun.pop(folder.path, None)
        future = self._begun.get(folder.path) if keep else self._begun.pop(folder.path, None)
        return future.result() if future is not None else list_folder(folder, stat)

    def drop(self, folder: Location) -> None:
        """The folder changed: its listing begun is not taken."""
        self._begun.pop(folder.path, None)

    def clear(self) -> None:
        self._begun.clear()


def records_listed(units: Location) -> list[tuple[str, int, int]]:
    """The commit records of the records' folder as listed now, (name, size, mtime_ns), in their names' order: the
    shelves are read and written in that order, a page of SQLite's for many records rather than a page for each."""
    return sorted(i for i in units.listing() if UnitName.is_record(i[0]))

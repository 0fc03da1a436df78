"""The folder's index: its commit records folded into a few files, and the files an exactly-once check read.

A resume needs every commit record (which input files have committed units, each file's size, what pass 2 has
left) and ends with the exactly-once check. On object storage, reading one record is a HEAD and a GET, and the
check reads every part file: at 10,000 units, tens of thousands of requests before the first prompt and after the
last. So a run keeps the records it has read or written in the run state folder, as Arrow IPC streams (columns, in
batches of BATCH rows, zstd-compressed), one row per record or checked file:

    name     the record's file name ("p1-<unit>.json"), or a part or record file's that a check read
    size, mtime    its stamp: what a listing says of it (size and modification time, ns)
    sha256   a record's: the digest of its file's bytes as the writing run read or wrote them; null for a file
    record   a record's: those bytes; null for a file a check read (a "checked" row)

    index.arrows            written when a check of the whole folder (no --shard) passes, at the end of a run
                            (its schema's metadata: "written", the time the check passed); its checked rows are
                            every record and part file that check counted
    index-part-000012.arrows  the same, written while a run goes (every `Commits.fold_every` new records), so
                            that a run killed midway leaves its records folded for the next one; its checked rows are
                            the records and files of the units the run checked as it finished them (verify.py's
                            `UnitChecks`), with the stamps they had when the check read them

The next run reads the index and its parts before it decides to run, and deletes nothing then (a refused run
touches nothing); a passing check of the whole folder writes index.arrows afresh and deletes the parts and the
files of an earlier version's layout (gzip-compressed JSON: index.json.gz, index-part-N.json.gz), which are not
read: their records are. It uses an entry instead of reading its record only when the record is listed with the
indexed stamp and the entry's bytes have the indexed digest: an index cannot stand in for a record it does not
match byte for byte, so a copy edited by hand is ignored and its record read; a stale entry (its unit redone since)
no longer matches its record's stamp and is ignored too. At its end check a run trusts the units whose files are
all listed with the stamps a check saw (the last passing check of the folder, or a run's check of the unit as it
finished it: then its record too), and says how many it took from the index (verify.py). Anything else (a record or
a file rewritten since, a damaged file of the index) is read as without the index.

Read a batch at a time, without a Python object per field: the records go onto a `Shelf` (shelf.py) as their bytes
(at 100 million rows the records are about 145 MB of JSON); the checked rows stay Arrow columns until the end check
asks for one (`checked`), as no planning needs them. A JSON index parsed an entry at a time took 4.8 s of a 10M-row
resume's 9.4 s to its first prompt under cProfile (BENCHMARKS.md, "A resume that costs what is left").

What the index cannot prove is that it was written by a run: one rewritten whole, digests included, is believed
for the units it names. Hence the end check's count of units taken from it; `batchjson verify` never uses it.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from batchjson.storage.location import Location
from batchjson.storage.shelf import Shelf

Stamp = tuple[int, int]
INDEX = "index.arrows"
PART, SUFFIX = "index-part-", ".arrows"
EARLIER = ("index.json", "index.json.gz")  # an earlier version's whole index (JSON): replaced, not read
EARLIER_PART = ".json.gz"  # and its parts' suffix
SCHEMA = pa.schema([("name", pa.string()), ("size", pa.int64()), ("mtime", pa.int64()), ("sha256", pa.string()),
                    ("record", pa.binary())])
BATCH = 4096
COMPRESSION = pa.ipc.IpcWriteOptions(compression="zstd")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _number(name: str) -> int | None:
    """A part file's number (either layout), or None for any other name."""
    if not name.startswith(PART):
        return None
    stem = name[len(PART):].removesuffix(SUFFIX).removesuffix(EARLIER_PART)
    return int(stem) if stem.isdigit() and stem != name[len(PART):] else None


def part_names(names: Iterable[str]) -> list[str]:
    """The index's part files among the run state folder's `names` (an earlier version's too), in the order they
    were written."""
    return sorted((n for n in names if _number(n) is not None), key=lambda n: (_number(n), n))


def part_name(number: int) -> str:
    """The name of the index's part file `number` (`part_names` sorts them in that order)."""
    return f"{PART}{number:06d}{SUFFIX}"


class _Sink:
    """A file for pyarrow's IPC writer whose bytes are taken a piece at a time (`take`)."""

    closed = False

    def __init__(self):
        self.pieces: list[bytes] = []

    def write(self, data) -> int:
        self.pieces.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        data, self.pieces = b"".join(self.pieces), []
        return data


class Index:
    """The index as a run read it: `record(name, stamp)` and `checked(name, stamp)` answer from it."""

    def __init__(self):
        # record name -> (size, mtime_ns, sha256, the record's bytes): kept as bytes, as Commits keeps the records
        self._records = Shelf(4)
        self._files: list[pa.RecordBatch] = []  # the checked rows read (name, size, mtime), in the files' order
        self._checked: Shelf | None = None  # them by name, once `checked` first asks: file name -> (size, mtime_ns)
        self._vouched = Shelf(2)  # files this run's checks read (`vouch_files`): newer than any the index holds
        self.written = ""
        """When the check that wrote it passed (UTC), as the end check's summary names it."""
        self.replaced: list[str] = []
        """The files read that a passing check's index replaces: its parts, and an earlier version's files."""
        self.next_part = 1
        """The number of the next part to write, after every part there is."""

    @classmethod
    def read(cls, state: Location) -> Index:
        """The index and its parts in the run state folder; empty if there are none. A file that does not read as
        the index is left out (its records are read instead); an earlier version's (JSON) are not read. Deletes
        nothing: `Commits.write_index` replaces them."""
        index, names = cls(), state.names()
        parts = part_names(names)
        index.next_part = max((_number(name) for name in parts), default=0) + 1
        index.replaced = [name for name in EARLIER if name in names]
        for name in ([INDEX] if INDEX in names else []) + parts:
            if name.endswith(SUFFIX):
                try:
                    data = (state / name).read_bytes()  # the store failing fails the run, as any read does
                except FileNotFoundError:
                    continue
                try:
                    index._take(data, whole=name == INDEX)
                except (pa.ArrowException, ValueError, OSError):  # not the index's (cut short, overwritten)
                    pass  # its batches read before the damage are kept: each entry was checked by its own digest
            if name != INDEX:
                index.replaced.append(name)
        return index

    def _take(self, data: bytes, whole: bool) -> None:
        """One file of the index, a batch at a time: its records onto the shelf, each only if its bytes have its
        digest (one edited by hand is left out: its record is read instead); its checked rows kept as columns.
        `whole`: the whole index, whose time is this index's (a part's is not)."""
        reader = pa.ipc.open_stream(pa.BufferReader(data))
        if not reader.schema.equals(SCHEMA):
            raise ValueError("not the index's layout")
        if whole:
            self.written = (reader.schema.metadata or {}).get(b"written", b"").decode()
        for batch in reader:
            listed = batch.column("record").is_valid()
            records = batch.filter(listed).to_pydict()
            self._records.update(
                (name, (size, mtime, sha, data))
                for name, size, mtime, sha, data in zip(*records.values())
                if None not in (name, size, mtime, sha) and digest(data) == sha)
            files = batch.filter(pc.invert(listed)).select(["name", "size", "mtime"]).drop_null()
            if files.num_rows:
                self._files.append(files)

    def vouch_files(self, checked: Iterable[tuple[str, Stamp]]) -> None:
        """Files (name, stamp) that a check of this run read: `checked` answers for them while they keep these
        stamps, over what the index holds."""
        self._vouched.update(checked)

    def record(self, name: str, listed: Stamp) -> tuple[str, bytes] | None:
        """The indexed record `name`, listed now with stamp `listed`, if its stamp is still the indexed one (its copy
        is, byte for byte, the record file the digest was taken of: `_take` kept no other): (digest, the record's
        bytes)."""
        found = self._records.get(name)
        if found is None or tuple(found[:2]) != tuple(listed):
            return None
        return found[2], found[3]

    def drop_stale(self, name: str, listed: Stamp) -> None:
        """Drop the entry of record `name` if it is listed now with another stamp than the indexed one: its record
        was rewritten since (its unit redone), and `copy` answers for the records as listed."""
        found = self._records.get(name)
        if found is not None and tuple(found[:2]) != tuple(listed):
            self._records.pop(name)

    def copy(self, name: str) -> bytes | None:
        """The index's copy of record `name` (the bytes its digest is of), after `drop_stale`; None without one."""
        found = self._records.get(name)
        return None if found is None else found[3]

    def forget(self, name: str) -> None:
        """The record `name` is gone (its unit is redone): its entry answers for nothing."""
        self._records.pop(name)

    def checked(self, name: str, now: Stamp | None) -> bool:
        """Whether the part or record file `name`, listed now with stamp `now`, is as a check read it: this run's
        (`vouch_files`), else the one the index holds."""
        if now is None:
            return False
        found = self._vouched.get(name)
        if found is None:
            if self._checked is None:  # the index's checked rows by name, the later file's over the earlier's
                self._checked = Shelf(2)
                for files in self._files:
                    self._checked.update((n, (s, m)) for n, s, m in zip(*files.to_pydict().values()))
                self._files.clear()
            found = self._checked.get(name)
        return found is not None and tuple(found) == tuple(now)

    @staticmethod
    def write(file: Location, records: Iterable[tuple[str, Stamp, str, bytes]],
              checked: Iterable[tuple[str, Stamp]] = ()) -> None:
        """`records`: (record name, stamp, digest of its file's bytes, those bytes), one at a time; `checked`: (part
        or record file name, stamp). Written BATCH rows at a time, the file's pieces as they come, so the index of a
        large folder is never held whole."""
        schema = SCHEMA.with_metadata({"written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})

        def batches() -> Iterator[pa.RecordBatch]:
            for chunk in _chunks(records):
                names, stamps, digests, data = zip(*chunk)
                yield pa.record_batch([list(names), [s[0] for s in stamps], [s[1] for s in stamps], list(digests),
                                       list(data)], schema=schema)
            for chunk in _chunks(checked):
                names, stamps = zip(*chunk)
                yield pa.record_batch([list(names), [s[0] for s in stamps], [s[1] for s in stamps],
                                       pa.nulls(len(names), pa.string()), pa.nulls(len(names), pa.binary())],
                                      schema=schema)

        def pieces() -> Iterator[bytes]:
            sink = _Sink()
            with pa.ipc.new_stream(sink, schema, options=COMPRESSION) as writer:
                for batch in batches():
                    writer.write_batch(batch)
                    yield sink.take()
            yield sink.take()

        file.write_json(pieces())


def _chunks(items: Iterable) -> Iterator[list]:
    items = iter(items)
    while chunk := list(itertools.islice(items, BATCH)):
        yield chunk

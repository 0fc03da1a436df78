"""The index's files: the commit records folded into a few files, and the files an exactly-once check read; their
layout, written and read (`Index`). How a run keeps them is index.py.

A resume needs every commit record (which input files have committed units, each file's size, what pass 2 has
left) and ends with the exactly-once check. On object storage, reading one record is a HEAD and a GET, and the
check reads every part file: at 10,000 units, tens of thousands of requests before the first prompt and after the
last. So a run keeps the records it has read or written in the run state folder, as Arrow IPC files (columns, in
batches of BATCH rows, zstd-compressed, each column of a batch read on its own), one row per record or checked file:

    name     the record's file name ("p1-<unit>.json"), or a part or record file's that a check read
    size, mtime    its stamp: what a listing says of it (size and modification time, ns)
    sha256   a record's: the digest of its file's bytes as the writing run read or wrote them; null for a file
    record   a record's: those bytes; null for a file a check read (a "checked" row)
    file, kinds, rows_<kind>, size_<kind>, reasons    a record's, what a resume plans from (`planned`): its input
             file's tag, the kinds of files it lists (a bit each), their rows and sizes, its reasons as JSON; null
             for a checked row, and for a record they cannot say (`planned`: its bytes answer for it then)

    index.arrows            written when a check of the whole folder (no --shard) passes, at the end of a run
                            (its schema's metadata: "written", the time the check passed); its checked rows are
                            every record and part file that check counted
    index-part-000012.arrows  the same, written while a run goes (every `RunIndex.fold_every` new records, index.py), so
                            that a run killed midway leaves its records folded for the next one; its checked rows are
                            the records and files of the units the run checked as it finished them (verify.py's
                            `UnitChecks`), with the stamps they had when the check read them

Each batch says in its custom metadata which rows it holds ("rows": records or checked), and a batch of records the
digest of its planning columns ("fingerprint"). The next run reads the index and its parts before it decides to
run, and deletes nothing then (a refused run touches nothing); a passing check of the whole folder writes
index.arrows afresh and deletes the parts and the files of an earlier version's layout (gzip-compressed JSON, and
the Arrow IPC streams of the version before this one), which are not read: their records are.

A resume plans from the planning columns alone (`Index.read` reads no other; survey.py compares them with the folders'
listings as Arrow tables): the records' bytes and the checked rows are read only when first asked for,
after the planning (the progress file's counts, the end check, the next index). An entry answers for its record
only when the record is listed with the indexed stamp (a stale entry, its unit redone since, is ignored); its
columns only where its batch has its fingerprint, and its bytes only where they have the indexed digest: a column
or a copy edited by hand is ignored and its record read. `Index.write` gives a record planning columns only where
its bytes have the digest it is handed. At its end check a run trusts the units whose files are all listed with the
stamps a check saw (the last passing check of the folder, or a run's check of the unit as it finished it: then its
record too), and says how many it trusted, not reading them (verify.py). Anything else (a record or a file rewritten
since, a damaged file of the index) is read as without the index.

Planned from columns, a resume parses no record the index answers for, and looks none up on a shelf: at 100
million rows (195,320 records) that was 6.4-6.9 s of planning, and the shelves' SQLite file read back (BENCHMARKS.md,
"The index as columns"). The bytes, once read, go onto a `Shelf` (shelf.py), at 100 million rows about 145 MB.

What the index cannot prove is that it was written by a run: one rewritten whole, digests and fingerprints included,
is believed by the planning. So the end check reads every record file (small: a GET each on object storage) and
trusts a unit only where the index's copy is its record file's bytes, and each file the record lists has the size
it keeps and the stamp a check saw (`RunIndex.trusted`); a forged copy makes its unit read, as without the index.
What a trusted file holds is not read again: the summary says how many units it trusted, and `batchjson verify`,
which never uses the index, reads them all.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from batchjson.storage.location import Location
from batchjson.storage.names import KINDS, PartName
from batchjson.storage.shelf import Shelf

Stamp = tuple[int, int]
INDEX = "index.arrows"
PART, SUFFIX = "index-part-", ".arrows"
EARLIER = ("index.json", "index.json.gz")  # an earlier version's whole index (JSON): replaced, not read
EARLIER_PART = ".json.gz"  # and its parts' suffix
BITS = {"output": 1, "rejects": 2, "requeue": 4}  # `kinds`: the kinds of files a record lists, a bit each
PLANNED = ["name", "size", "mtime", "file", "kinds", *(f"rows_{k}" for k in KINDS), *(f"size_{k}" for k in KINDS),
           "reasons"]
"""The columns a resume plans from (`Index.read` reads no other): a record's name and stamp, and what its record
says, as `planned` derives it; null in a checked row, and in a record's row that `planned` does not answer for."""
SCHEMA = pa.schema([("name", pa.string()), ("size", pa.int64()), ("mtime", pa.int64()), ("sha256", pa.string()),
                    ("record", pa.binary()), ("file", pa.string()), ("kinds", pa.int8()),
                    *((f"rows_{k}", pa.int64()) for k in KINDS), *((f"size_{k}", pa.int64()) for k in KINDS),
                    ("reasons", pa.string())])
BATCH = 4096
COMPRESSION = pa.ipc.IpcWriteOptions(compression="zstd")
RECORDS, CHECKED = b"records", b"checked"  # a batch's custom metadata "rows": which rows it holds


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(batch: pa.RecordBatch) -> str:
    """The digest of a batch's planning columns (PLANNED), as written and as read back (the IPC message of those
    columns alone, uncompressed): a batch whose columns were edited since it was written no longer has it."""
    return hashlib.sha256(batch.select(PLANNED).serialize()).hexdigest()


def _count(value) -> bool:
    return type(value) is int and value >= 0


def planned(name: str, data: bytes, sha: str, record: dict | None = None) -> tuple | None:
    """What a resume plans from in the record `name` whose file held `data` (`planning_columns`: PLANNED's columns
    after the stamp), or None where the columns cannot say it all: bytes that are not those of the digest `sha`, a
    record that is not one, or one that names its files otherwise than this version does (its bytes answer for it
    then, parsed). `record`: `data` parsed already."""
    if digest(data) != sha:
        return None
    try:
        record = orjson.loads(data) if record is None else record
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    stage, key, files, rows = record.get("stage"), record.get("key"), record.get("files"), record.get("rows")
    sizes, reasons, file = record.get("sizes", {}), record.get("reasons", {}), record.get("file")
    if not (stage in ("p1", "p2") and isinstance(key, str) and name == f"{stage}-{key}.json" and isinstance(file, str)
            and isinstance(files, dict) and isinstance(rows, dict) and isinstance(sizes, dict)
            and isinstance(reasons, dict) and set(files) <= BITS.keys() and set(rows) <= BITS.keys()
            and set(sizes) <= BITS.keys() and all(map(_count, rows.values())) and all(map(_count, sizes.values()))
            and all(isinstance(r, str) and _count(n) for r, n in reasons.items())):
        return None
    if any(files[kind] != PartName(stage, key, kind).file_name() for kind in files):
        return None
    return planning_columns(record)


def planning_columns(record: dict) -> tuple:
    """PLANNED's columns after the stamp (file, kinds, rows and sizes by kind, reasons as JSON) as the parsed record
    `record` (its files and rows dicts) says them, taken as it is: a kind this version does not know sets no bit, a
    count it does not give is 0, a size it does not give null. `planned` checks a record before; survey.py
    takes so a record the index does not answer for (its parsed record answers for the rest)."""
    rows, sizes = record["rows"], record.get("sizes", {})
    return (record.get("file"), sum(BITS.get(kind, 0) for kind in record["files"]), *(rows.get(k, 0) for k in KINDS),
            *(sizes.get(k) for k in KINDS),
            orjson.dumps(record.get("reasons", {}), option=orjson.OPT_SORT_KEYS).decode())


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
    """The index as a run read it: the columns a resume plans from (`planned`), and, read only once asked for (after
    the planning), the records' bytes (`record`, `copy`) and the checked stamps (`checked`)."""

    def __init__(self):
        self._state: Location | None = None
        self._unread: list[str] = []  # the files `read` found, until their read begins (`start`)
        self._reading: Future | None = None  # their planning columns, read on a thread of their own
        self._starting = threading.Lock()
        self._files_read: list[str] = []  # the files of the index read, in the order they were written
        self._planned: pa.Table = SCHEMA.empty_table().select(PLANNED)
        self._written = ""
        self._listed: pa.Table | None = None  # the records as listed when `listed` was told (name, size, mtime)
        self._forgotten: set[str] = set()  # records gone since (`forget`): their entries answer for nothing
        # record name -> (size, mtime_ns, sha256, the record's bytes), once first asked for (`_load`)
        self._records: Shelf | None = None
        self._checked: Shelf | None = None  # the checked rows by name, once `checked` first asks: name -> stamp
        self._vouched = Shelf(2)  # files this run's checks read (`vouch_files`): newer than any the index holds
        self._answering = True  # whether its records' bytes answer (`copy`): not while a run plans from it (`read`)
        self._loading = threading.Lock()
        self.replaced: list[str] = []
        """The files read that a passing check's index replaces: its parts, and an earlier version's files."""
        self.next_part = 1
        """The number of the next part to write, after every part there is."""

    @classmethod
    def read(cls, state: Location) -> Index:
        """The index and its parts in the run state folder, their planning columns only (`planned`); empty if there
        are none. A file that does not read as the index is left out (its records are read instead: an earlier
        version's Arrow streams are among them); an earlier version's JSON files are not read. Deletes nothing:
        `RunIndex.write` (index.py) replaces them.

        The files are read once they are first needed, on a thread of their own (`start`): a resume hands out its
        first units from the listings alone (survey.py), and the survey beside the run starts their read
        beside its own listings. At 100 million rows, 99 files read in 0.3-0.7 s and 0.27 s of CPU, which the
        first prompt, on a machine whose cores the replicas' start takes, waited for behind them (BENCHMARKS.md,
        "The resume's survey beside the run")."""
        index, names = cls(), state.names()
        index._state, index._answering = state, False
        parts = part_names(names)
        index.next_part = max((_number(name) for name in parts), default=0) + 1
        index.replaced = [name for name in EARLIER if name in names] + [name for name in parts if name != INDEX]
        index._unread = [name for name in ([INDEX] if INDEX in names else []) + parts if name.endswith(SUFFIX)]
        return index

    def start(self) -> None:
        """Begin reading the files `read` found, on a thread of their own, unless begun: what needs them first
        begins it (`_wait`), or who wants it read beside other work. The files are the ones listed by `read` (the
        parts a run writes meanwhile are its own, `RunIndex.fold`)."""
        with self._starting:
            if self._unread:
                pool = ThreadPoolExecutor(1, thread_name_prefix="batchjson-index")
                self._reading = pool.submit(self._read, self._unread)
                self._unread = []
                pool.shutdown(wait=False)

    def _read(self, files: list[str]) -> None:
        tables: list[pa.Table] = []
        for name in files:
            try:
                self._each(name, lambda reader, name=name: self._plan(reader, tables, name == INDEX))
            except FileNotFoundError:
                continue
            self._files_read.append(name)
        if tables:
            self._planned = _latest(pa.concat_tables(tables))

    def _wait(self) -> None:
        """Until the files are read (`read`, begun here if not yet); their read's failure raises here."""
        self.start()
        if self._reading is not None:
            self._reading.result()

    @property
    def planned(self) -> pa.Table:
        """One row per record whose columns answer for it (PLANNED), the later file's over the earlier's, whatever
        its stamp: a row is of the record listed now only where the stamps agree (survey.py)."""
        self._wait()
        return self._planned

    @property
    def written(self) -> str:
        """When the check that wrote it passed (UTC), as the end check's summary names it."""
        self._wait()
        return self._written

    @property
    def _files(self) -> list[str]:
        """The files of the index read, in the order they were written."""
        self._wait()
        return self._files_read

    def _each(self, name: str, read) -> None:
        """`read(the open IPC file reader of the index's file `name`, its batches read only as asked for)`, each
        batch of the columns it asks for only (a local file: a read per column of a batch), or from the file's
        bytes read whole (object storage: one GET). A file that does not read as the index (cut short, overwritten,
        an earlier version's) ends `read` where it fails: its batches read before are kept, each vouched for by its
        own digest; the store failing to read it fails the run, as any read does."""
        file = self._state / name

        def opened(source) -> None:
            try:
                read(lambda fields: pa.ipc.open_file(source, options=pa.ipc.IpcReadOptions(included_fields=[
                    SCHEMA.get_field_index(f) for f in fields])))
            except (pa.ArrowException, ValueError, OSError):  # not the index's (cut short, overwritten, earlier)
                pass

        if file.local:
            file.read_with(opened)
        else:
            opened(pa.BufferReader(file.read_bytes()))

    def _plan(self, reader, tables: list[pa.Table], whole: bool) -> None:
        """The planning columns of one file's records (`planned`): a batch's only where they have the digest written
        with them (`fingerprint`), and of the rows that `planned` answered for when it was written."""
        probe, columns = reader(["kinds"]), reader(PLANNED)
        if not columns.schema.equals(pa.schema([SCHEMA.field(f) for f in PLANNED])):
            raise ValueError("not the index's layout")
        if whole:
            self._written = (probe.schema.metadata or {}).get(b"written", b"").decode()
        for i in range(probe.num_record_batches):
            _, meta = probe.get_batch_with_custom_metadata(i)
            if meta is None or meta.get(b"rows") != RECORDS:
                continue
            batch = columns.get_batch(i)
            if meta.get(b"fingerprint", b"").decode() == fingerprint(batch):
                tables.append(pa.Table.from_batches([batch]).filter(pc.is_valid(batch.column("kinds"))))

    def drop_planned(self) -> None:
        """The run has planned (survey.py): the planning columns go rather than being held to its end (27 MB
        at 100 million rows); from here on its records answer through their bytes (`record`, `copy`)."""
        self._wait()
        self._planned = SCHEMA.empty_table().select(PLANNED)

    def listed(self, records: pa.Table) -> None:
        """The records as listed now (name, size, mtime): the index's copies answer only for these stamps."""
        self._listed = records

    def answers(self, among: pa.Array | None = None) -> pa.Table:
        """The rows of `planned` whose stamp is the listed record's (`listed`): what the index answers for (of the
        records named `among`: one copy of the rows taken, not two)."""
        if self._listed is None:
            return self.planned.slice(0, 0)
        mask = as_listed(self.planned, self._listed)
        if among is not None:
            mask = pc.and_(mask, pc.is_in(self.planned["name"], value_set=among))
        return self.planned.filter(mask)

    def _load(self) -> Shelf:
        """The records' bytes, read once first asked for (after the planning, which reads none): each kept only
        where its bytes have its digest (one edited by hand is left out: its record is read instead) and its stamp
        is the listed record's (`listed`; a record not listed has none), not forgotten since."""
        with self._loading:
            if self._records is not None:
                return self._records
            records, listed = Shelf(4), self._listed
            for name in self._files:
                def take(reader) -> None:
                    file = reader(["name", "size", "mtime", "sha256", "record"])
                    for i in range(file.num_record_batches):
                        batch = file.get_batch(i)
                        batch = batch.filter(pc.is_valid(batch.column("record")))
                        if listed is not None:  # the rows whose stamp is the listed record's, against this batch
                            now = listed.filter(pc.is_in(listed["name"], value_set=batch.column("name")))
                            batch = batch.filter(as_listed(batch, now))
                        rows = batch.select(["name", "size", "mtime", "sha256", "record"]).to_pydict()
                        records.update(
                            (name, (size, mtime, sha, data))
                            for name, size, mtime, sha, data in zip(*rows.values())
                            if None not in (name, size, mtime, sha) and name not in self._forgotten
                            and digest(data) == sha)
                try:
                    self._each(name, take)
                except FileNotFoundError:
                    continue  # gone since it was read: its records are read instead
            self._records = records
            return records

    def vouch_files(self, checked: Iterable[tuple[str, Stamp]]) -> None:
        """Files (name, stamp) that a check of this run read: `checked` answers for them while they keep these
        stamps, over what the index holds."""
        self._vouched.update(checked)

    def record(self, name: str, listed: Stamp) -> tuple[str, bytes] | None:
        """The indexed record `name`, listed now with stamp `listed`, if its stamp is still the indexed one (its copy
        is, byte for byte, the record file the digest was taken of: `_load` kept no other): (digest, the record's
        bytes)."""
        found = self._load().get(name)
        if found is None or tuple(found[:2]) != tuple(listed):
            return None
        return found[2], found[3]

    def answer(self) -> None:
        """The run has planned (survey.py): from here on the records' bytes answer for them (`copy`), read once first
        asked for. Until then, for an index read for a run (`read`), only its planning columns do: the planning reads
        none of its bytes."""
        self._answering = True

    def copy(self, name: str) -> bytes | None:
        """The index's copy of record `name` (the bytes its digest is of) as listed (`listed`); None without one, or
        while the run plans from the index (`answer`) unless its bytes were read already."""
        if not (self._answering or self.loaded):
            return None
        found = self._load().get(name)
        return None if found is None else found[3]

    @property
    def loaded(self) -> bool:
        """Whether the records' bytes have been read (`_load`)."""
        return self._records is not None

    def forget(self, name: str) -> None:
        """The record `name` is gone (its unit is redone): its entry answers for nothing."""
        with self._loading:
            self._forgotten.add(name)
            if self._records is not None:
                self._records.pop(name)

    def checked(self, name: str, now: Stamp | None) -> bool:
        """Whether the part or record file `name`, listed now with stamp `now`, is as a check read it: this run's
        (`vouch_files`), else the one the index holds."""
        if now is None:
            return False
        found = self._vouched.get(name)
        if found is None:
            if self._checked is None:  # the index's checked rows by name, the later file's over the earlier's
                checked = Shelf(2)
                for file in self._files:
                    def take(reader) -> None:
                        rows, names = reader(["kinds"]), reader(["name", "size", "mtime"])
                        for i in range(rows.num_record_batches):
                            _, meta = rows.get_batch_with_custom_metadata(i)
                            if meta is not None and meta.get(b"rows") == CHECKED:
                                files = names.get_batch(i).drop_null()
                                checked.update((n, (s, m)) for n, s, m in zip(*files.to_pydict().values()))
                    try:
                        self._each(file, take)
                    except FileNotFoundError:
                        continue  # gone since it was read: its units are read by the end check
                self._checked = checked
            found = self._checked.get(name)
        return found is not None and tuple(found) == tuple(now)

    @staticmethod
    def write(file: Location, records: Iterable[tuple], checked: Iterable[tuple[str, Stamp]] = ()) -> None:
        """`records`: (record name, stamp, digest of its file's bytes, those bytes[, those bytes parsed]), one at a
        time; `checked`: (part
        or record file name, stamp). An Arrow IPC file written BATCH rows at a time, the file's pieces as they come,
        so the index of a large folder is never held whole: a record's row with its planning columns (`planned`;
        null where they cannot answer for it), each batch of records with their digest (`fingerprint`)."""
        schema = SCHEMA.with_metadata({"written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})

        def batches() -> Iterator[tuple[pa.RecordBatch, dict]]:
            for chunk in _chunks(records):
                rows = [(name, *stamp, sha, data, *(planned(name, data, sha, *parsed) or (None,) * (len(PLANNED) - 3)))
                        for name, stamp, sha, data, *parsed in chunk]
                batch = pa.record_batch([pa.array(column, field.type) for column, field in zip(zip(*rows), SCHEMA)],
                                        schema=schema)
                yield batch, {"rows": RECORDS, "fingerprint": fingerprint(batch)}
            for chunk in _chunks(checked):
                names, stamps = zip(*chunk)
                n = len(names)
                columns = [pa.array(names, pa.string()), pa.array([s[0] for s in stamps], pa.int64()),
                           pa.array([s[1] for s in stamps], pa.int64()),
                           *(pa.nulls(n, field.type) for field in list(SCHEMA)[3:])]
                yield pa.record_batch(columns, schema=schema), {"rows": CHECKED}

        def pieces() -> Iterator[bytes]:
            sink = _Sink()
            with pa.ipc.new_file(sink, schema, options=COMPRESSION) as writer:
                for batch, meta in batches():
                    writer.write_batch(batch, custom_metadata=meta)
                    yield sink.take()
            yield sink.take()

        file.write_json(pieces())


def as_listed(rows: pa.Table | pa.RecordBatch, listed: pa.Table) -> pa.ChunkedArray | pa.Array:
    """Which of `rows` (name, size, mtime) are listed with their stamp in `listed` (a folder's listing: one row a
    name), as a mask to filter them with (null where not listed). Looked up by name (`pc.index_in`), not joined:
    with a 100M-row resume's 195,320 records an Acero join grew the driver by 82-95 MiB (most of it kept by
    Arrow's allocator after) for a result of 25 MiB, the look-up by 24."""
    at = pc.index_in(rows["name"], value_set=listed["name"])
    return pc.and_(pc.equal(rows["size"], listed["size"].take(at)), pc.equal(rows["mtime"], listed["mtime"].take(at)))


def _latest(table: pa.Table) -> pa.Table:
    """`table`'s rows, one per name: the last of each (the later file's entry over the earlier's), in their order.
    Row i is its name's last when the name's first place among the names from the end is n - 1 - i: a look-up
    (`pc.index_in`), not an Acero aggregation, which at 30 million rows grew the driver by 38 MiB for a result of
    7 MiB (this, 18)."""
    n = table.num_rows
    from_end = pc.index_in(table["name"], value_set=table["name"][::-1])
    return table.filter(pc.equal(pc.subtract(n - 1, from_end), pa.array(range(n), pa.int64())))


def _chunks(items: Iterable) -> Iterator[list]:
    items = iter(items)
    while chunk := list(itertools.islice(items, BATCH)):
        yield chunk

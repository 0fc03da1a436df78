"""The unit commits of an output folder: the protocol that commits one unit of one pass, and what is committed.

A unit's commit moves through named steps, one method each, after dlt's `PackageStorage` (one move per step):
`begin` deletes every file of any earlier attempt, of every kind; `stage` writes one file under a hidden name
(".<name>.tmp") in its final folder; `write_record` writes the commit record atomically (the commit point);
`publish` renames the hidden files into place. `commit` runs them in this order. A kill before the record leaves
only hidden files, which the next attempt deletes; a kill after it is rolled forward by the next run's survey as it
finds the unit (`publish_left`; `recover` for verify, by one listing of each folder).
So a unit's rows are either all in the output and rejects, once, or not there at all, whatever its outcome. No
reader reads a hidden file: pyarrow.dataset skips names starting with . or _, and DuckDB's
read_parquet('OUT/*.parquet'), which does not, reads only names ending in .parquet. `drop` uncommits a unit that
the survey (survey.py) found broken, so that it is redone.

On object storage (see location.py) there is no rename: `publish` is a copy and a delete, so a kill between them
leaves the file under both names, with the same content; the survey deletes the hidden one (`recover` copies
again and deletes it, as it renames locally). The commit point is still the record, which is one PUT (all or
nothing). Nothing is listed or read back under its final name before its record exists, so a half-published unit is
never taken for a stray or a finished one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import fs

from batchjson.errors import OutputError, StorageFull, is_full
from batchjson.storage.index import RunIndex
from batchjson.storage.listings import Listings, records_listed
from batchjson.storage.location import Location, json_bytes, writing
from batchjson.storage.names import (STAGE_KINDS, Kind, PartName, Stage, UnitName, is_legacy_staged, is_staged,
                                     legacy_staged, legacy_unstaged, records_of, staged, unit_ids_of)
from batchjson.storage.shelf import Shelf


def write_part(table: pa.Table, path: Location, undo: Callable[[], None] = lambda: None) -> None:
    """Write one part file; a full disk is StorageFull after `undo`, any other failure an OutputError."""
    try:
        path.write_parquet(table)
    except OSError as e:
        path.unlink(missing_ok=True)
        if is_full(e):
            undo()
            raise StorageFull.at(path, e) from None
        raise OutputError(f"cannot write {path}: {e.strerror or e}. Free space or fix permissions, then run "
                          "again: finished units are kept and the run resumes.") from None


class DamagedRecord(OutputError):
    """A commit record that does not read as one (truncated, emptied, edited by hand): what its unit committed is
    not known. A run redoes the unit (survey.py); verify names it."""


def _parsed(name: str, data: bytes) -> dict:
    try:
        record = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise DamagedRecord(f"its commit record {name} does not parse as JSON ({e})") from None
    if not (isinstance(record, dict) and isinstance(record.get("files"), dict) and isinstance(record.get("rows"), dict)):
        raise DamagedRecord(f"its commit record {name} is not one (no files and rows)")
    return record


class Commits:
    """The committed units of one output folder (of every shard), and the steps that commit one more."""

    def __init__(self, folders: dict[Kind, Location], units: Location, state: Location,
                 guard: Callable[[], None] = lambda: None):
        self.folders = folders
        """Where each kind of part file goes: the output, rejects and requeue folders."""
        self.units = units
        """The commit records' folder."""
        self.index = RunIndex(state, units, folders, self._bytes)
        """The index in the run state folder, as this run keeps it (index.py): the records folded into a few files,
        with what the last passing check read."""
        self.listings = Listings()
        """The folders' listings, some begun beside the run's start (`read_index`)."""
        self.guard = guard
        """Raises if this run no longer holds the folder (a lost lease), before a record is written."""
        self._committed: set[str] | None = None
        self._records: pa.Table | None = None  # the records as `committed` listed them: name, size, mtime
        # Commit records read or written so far, as their files' bytes (a record never changes, only goes: drop),
        # on a Shelf (shelf.py): in a dict they took about 1.1 KB of driver a record. Parsed again at each look (a
        # few µs), and digested when the index is written.
        self._read = Shelf()
        self.after: Callable[[str, str], None] = lambda step, stage: None
        """Called after each step of the commit protocol, with the pass; tests use it to kill the process there."""

    def part(self, stage: Stage, key: str, kind: Kind) -> Location:
        return self.folders[kind] / PartName(stage, key, kind).file_name()

    def record_path(self, stage: Stage, key: str) -> Location:
        return self.units / UnitName(stage, key).file_name()

    @staticmethod
    def _hidden(path: Location) -> Location:
        return path.with_name(staged(path.name))

    # ----- what is committed, and the records' cache -------------------------------------------------------------
    def committed(self) -> set[str]:
        """Names ("p1-<unit>") of the committed units of every shard, listed once and kept up to date."""
        if self._committed is None:
            # Locally the names alone, a stat less per record (195,320 at 100 million rows: 0.5 s): the stamps, by
            # which the index's entries answer for their records, are listed where they are needed (survey.py).
            listed = records_of(self.listings.take(self.units, stat=False))
            self._records = listed
            self.index.files.listed(listed)  # an entry its record no longer matches answers for nothing
            self._committed = set(unit_ids_of(listed["name"]).to_pylist())
        return self._committed

    @property
    def listed_records(self) -> pa.Table:
        """The commit records as `committed` listed them (name, size, mtime; locally names only, sizes and times 0)."""
        self.committed()
        return self._records

    def _bytes(self, name: str) -> bytes | None:
        """A committed record's bytes as this run read or wrote them, or as the index holds them (for the records
        listed with the indexed stamp, `committed`; not while the run plans, `Index.answer`); None if neither has
        them."""
        data = self._read.get(name)
        return self.index.files.copy(name) if data is None else data

    def forget(self) -> None:
        """Drop what was listed and read: the folder was cleared."""
        self._committed, self._records = None, None
        self.index.forget()
        self.listings.clear()
        self._read.clear()

    def read_index(self, prefetch: bool = True) -> None:
        """Read the index (index.py) for this run: its records stand in for reading theirs. Its files are found
        before anything is listed or read, and before the run decides whether to run (a refusal leaves the index
        where it is); they are read once the survey needs them (`Index.start`), beside the run where it is deferred
        (survey.py). Nothing of it is deleted before a passing check writes it afresh (`RunIndex.write`): an entry
        its unit's redoing made stale no longer matches the record's stamp, and is not used.

        `prefetch`: list the records' folder, then the requeue folder, beside the rest of the run's start (not for
        a run that clears them, --fresh, whose listings `forget` would throw away): `committed` and the survey (pass
        2's units) take these listings, the folder being held by this run (its other shards touch none of this
        shard's units). The output and rejects folders are listed by the survey of the units no pass hands out
        (`Survey.later`), beside the run: at 100 million rows their 390,000 files listed by name took 0.4 s of the
        resume's way to its first prompt."""
        if prefetch:
            self.listings.begin([self.units, self.folders["requeue"]])
        self.index.read()
        self._committed = None

    def trusted(self) -> frozenset[str]:
        """The committed units whose records and files are all as a check read them (`RunIndex.trusted`), each
        record read from its file first where this run has not read or written it (a record file is small; on object
        storage 16 at a time): the end check counts them from their records, not reading their files."""
        listed = records_listed(self.units)  # listed now: a replica's commits are in no set of this process
        self._read_now([name for name, _, _ in listed if self._read.get(name) is None])
        return self.index.trusted(listed, self._read.get)

    def _read_now(self, names: list[str]) -> None:
        """Read these record files into the cache, a thousand at a time (on object storage 16 at once); one gone or
        damaged is left out (verify names its unit). A record the index holds other bytes of, or none, is news for
        the index."""
        def read(name: str) -> bytes | None:
            try:
                data = (self.units / name).read_bytes()
                _parsed(name, data)
                return data
            except (FileNotFoundError, DamagedRecord):
                return None

        pool = None if self.units.local else ThreadPoolExecutor(16, thread_name_prefix="batchjson-records")
        try:
            for start in range(0, len(names), 1000):
                chunk = names[start:start + 1000]
                for name, data in zip(chunk, pool.map(read, chunk) if pool else map(read, chunk)):
                    if data is not None and self.index.files.copy(name) != data:
                        self._keep(name, data)
                    elif data is not None:
                        self._read[name] = data
        finally:
            if pool:
                pool.shutdown()

    def _keep(self, name: str, data: bytes) -> None:
        """A record's bytes, read from its file or written by this run: kept, and news for the index."""
        self._read[name] = data
        self.index.note(name)

    def stamps(self, key: str) -> list[tuple[str, tuple[int, int]]] | None:
        """The stamps of a committed unit's records and files, (file name, stamp), before a check reads them
        (`RunIndex.vouch`); None if one of them is not there (a publish under way: the end check reads the unit).
        Asks for the records, not the listing: a replica's commits are not in this process's."""
        first = self.record(Stage.FIRST, key)
        if first is None:
            return None
        found = []
        for stage, record in ((Stage.FIRST, first),
                              (Stage.SECOND, self.record(Stage.SECOND, key) if "requeue" in first["files"] else None)):
            paths = [self.record_path(stage, key), *(self.part(stage, key, kind) for kind in record["files"])] \
                if record else []
            for path in paths:
                info = path.info()
                if info.type != fs.FileType.File:
                    return None
                found.append((path.name, (info.size, info.mtime_ns)))
        return found

    def listed(self, stage: Stage, key: str) -> bool:
        """Whether the unit is among the committed ones as last listed (and committed since): no look at the folder."""
        return UnitName(stage, key).unit_id() in self.committed()

    def left(self, stage: Stage, keys: Iterable[str]) -> list[str]:
        """Those of `keys` whose unit is not among the committed ones of this pass as last listed (`listed`)."""
        keys, committed = list(keys), self.committed()
        return [key for key, unit in zip(keys, UnitName.unit_ids(stage, keys)) if unit not in committed]

    def done(self, stage: Stage, key: str) -> bool:
        return self.listed(stage, key) or self.record_path(stage, key).exists()

    def _fetch(self, name: str) -> tuple[bytes, dict | None]:
        """A record's bytes by its file name, kept or read, and the record when it was read (and so parsed) now.
        FileNotFoundError if there is none, DamagedRecord if it does not read as one."""
        self.committed()  # lists the records once, taking those the index stands in for
        data = self._bytes(name)
        if data is not None:
            return data, None
        data = (self.units / name).read_bytes()
        record = _parsed(name, data)  # a record that does not read as one fails here, before it is kept
        self._keep(name, data)
        return data, record

    def load(self, name: str) -> dict:
        """The record of this file name, kept or read; FileNotFoundError or DamagedRecord as `_fetch`."""
        data, record = self._fetch(name)
        return _parsed(name, data) if record is None else record

    def record(self, stage: Stage, key: str) -> dict | None:
        try:
            return self.load(UnitName(stage, key).file_name())
        except FileNotFoundError:
            return None

    def records(self, stage: Stage | None = None) -> Iterator[dict]:
        """The commit records of one pass, or of both, one at a time (a folder's records parsed at once would be
        the driver's largest object). A damaged one is left out: the survey and verify name it, unit by unit."""
        names = sorted(name for name, _, _ in self.units.listing(stat=False)
                       if UnitName.is_record(name) and (stage is None or UnitName.parse(name).stage == stage))
        for name in names:
            try:
                yield self.load(name)
            except (FileNotFoundError, DamagedRecord):
                continue

    def read_requeue(self, key: str) -> pa.Table:
        return self.part(Stage.FIRST, key, "requeue").read_parquet()

    def read_ids(self, stage: Stage, key: str, kind: Kind, columns: list[str]) -> pa.Table:
        """Some columns of one committed file, under its final name or, while its commit is being published (by
        another shard, or not yet after a kill), its hidden one."""
        path = self.part(stage, key, kind)
        for candidate in (path, self._hidden(path), path):  # a rename may land between two looks
            try:
                return candidate.read_parquet(columns)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(path)

    # ----- the steps of a commit -------------------------------------------------------------------------------
    def commit(self, stage: Stage, key: str, tables: dict[Kind, pa.Table], meta: dict) -> dict:
        """Commit one unit of one pass: begin, stage its files, write its record, publish the files. Returns the
        record, which the worker hands the driver (`received` there)."""
        self.begin(stage, key)
        files, rows, sizes = {}, {}, {}
        for kind, table in tables.items():
            if table is None or not table.num_rows:
                continue
            files[kind], rows[kind], sizes[kind] = self.stage(stage, key, kind, table)
        record = {"stage": stage, "key": key, "files": files, "rows": rows, "sizes": sizes} | meta
        self.write_record(record)
        self.publish(record)
        return record

    def begin(self, stage: Stage, key: str) -> None:
        """Start (or restart) a unit: every file an earlier attempt may have left, of every kind, goes."""
        for kind in STAGE_KINDS[stage]:
            path = self.part(stage, key, kind)
            self._hidden(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        self.after("begin", stage)

    def stage(self, stage: Stage, key: str, kind: Kind, table: pa.Table) -> tuple[str, int, int]:
        """Write one file of the unit under its hidden name; returns its final name, rows and size."""
        path = self.part(stage, key, kind)
        write_part(table, self._hidden(path), undo=lambda: self._unstage(stage, key))
        found = path.name, table.num_rows, self._hidden(path).info().size
        self.after(f"staged {kind}", stage)
        return found

    def write_record(self, record: dict) -> None:
        """The commit point: the unit's record (its files, rows and reasons), written atomically."""
        stage, key = record["stage"], record["key"]
        self.guard()
        path = self.record_path(stage, key)
        with writing(path, undo=lambda: self._unstage(stage, key)):
            path.write_json(record)
        self._keep(path.name, json_bytes(record))
        if self._committed is not None:  # a replica's commits list nothing (the driver's listing decides)
            self._committed.add(UnitName(stage, key).unit_id())
        self.after("committed", stage)

    def received(self, record: dict) -> None:
        """A record another process (a replica) wrote, as it handed it over: kept as if read here (a GET less per
        unit on object storage), for the fold, the tally and the unit checks. Its bytes are those written."""
        name, data = self.record_path(record["stage"], record["key"]).name, json_bytes(record)
        if self._read.get(name) == data:  # written by this process (a worker inline)
            return
        self._keep(name, data)

    def publish(self, record: dict) -> None:
        """Rename the unit's staged files into place (again, after a kill: what is in place already is skipped)."""
        for kind, name in record["files"].items():
            path = self.part(record["stage"], record["key"], kind)
            self._place(self._hidden(path), path)  # not there: published already (an earlier try, another shard)
            self.after(f"published {kind}", record["stage"])

    @staticmethod
    def _place(staged_path: Location, path: Location) -> bool:
        """Move a staged file to its final name; whether it was there to move."""
        try:
            with writing(path):
                staged_path.move(path)
            return True
        except FileNotFoundError:
            return False

    def _unstage(self, stage: Stage, key: str) -> None:
        """Delete the files a unit staged before its record could be written: they are no unit's, and take space."""
        for kind in STAGE_KINDS[stage]:
            self._hidden(self.part(stage, key, kind)).unlink(missing_ok=True)

    # ----- after a kill, or damage -----------------------------------------------------------------------------
    def recover(self) -> None:
        """Roll forward units committed by a run that was killed before it published their files: its hidden files
        from one listing of each folder, by name (`verify`; a run's survey publishes them unit by unit,
        `publish_left`)."""
        moved = False
        for kind, folder in self.folders.items():
            listing = self.listings.take(folder, keep=True, stat=False)["name"]
            hidden = pc.filter(listing, pc.starts_with(listing, ".")).to_pylist()
            for legacy in (folder / name for name in hidden if is_legacy_staged(name)):
                # staged by a version before STAGED (DuckDB reads these); beside its published part it is a copy
                final = legacy_unstaged(legacy.name)
                if not legacy.with_name(final).exists():
                    legacy.move(legacy.with_name(staged(final)))
                    hidden.append(staged(final))
                    moved = True
            for hidden_part in (folder / name for name in hidden if is_staged(name)):
                try:
                    part = PartName.parse(hidden_part.name, "requeue" if kind == "requeue" else None)
                except ValueError:
                    continue  # not a part file of any unit
                record = self.record(part.stage, part.key)
                if record is not None:
                    self.publish(record)
                    moved = True
        if moved:  # the folders changed: the survey lists them again
            for folder in self.folders.values():
                self.listings.drop(folder)

    def publish_left(self, path: Location) -> bool:
        """Publish a committed unit's file that a killed run left staged (`recover`'s move, for one file the survey
        did not find under its final name): under its hidden name, or under a version's before STAGED. Whether one
        was there."""
        return any(self._place(hidden, path)
                   for hidden in (self._hidden(path), path.with_name(legacy_staged(path.name))))

    def drop(self, key: str) -> None:
        """Uncommit a unit in both passes (records first, then files), so that it is redone from scratch."""
        for stage in reversed(Stage):
            self.record_path(stage, key).unlink(missing_ok=True)
            self._read.pop(self.record_path(stage, key).name, None)
            self.index.dropped(self.record_path(stage, key).name)
            self.committed().discard(UnitName(stage, key).unit_id())
        for stage in reversed(Stage):
            self.begin(stage, key)

    def _lists(self, part: PartName, name: str) -> bool:
        """Whether the record of the part's unit lists it as `name`: found in the record's bytes as json_bytes writes
        it (a few µs), else parsed (a record written otherwise)."""
        try:
            data, _ = self._fetch(part.unit.file_name())
        except FileNotFoundError:
            return False
        except DamagedRecord:
            return True  # its unit is named for that already
        return f'"{part.kind}": "{name}"'.encode() in data or orjson.loads(data)["files"].get(part.kind) == name

    def stray(self) -> list[Location]:
        """Files that readers of the output or rejects folder read (Location.dataset_files: in sub-folders too,
        whatever their name) but no commit record lists, one listed file at a time. A file is published only after
        its record is written, so a file listed has its record there already: none is taken for stray."""
        found = set()
        for folder in {f.path: f for f in (self.folders["output"], self.folders["rejects"])}.values():
            for below in folder.dataset_files():
                path = folder / below
                parent, _, name = path.path.rpartition("/")
                try:
                    part = PartName.parse(name)
                except ValueError:
                    part = None
                if not (part and self.folders[part.kind].path.rstrip("/") == parent and self._lists(part, name)):
                    found.add(path)
        return sorted(found)



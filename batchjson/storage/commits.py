"""The unit commits of an output folder: the protocol that commits one unit of one pass, and what is committed.

A unit's commit moves through named steps, one method each, after dlt's `PackageStorage` (one move per step):
`begin` deletes every file of any earlier attempt, of every kind; `stage` writes one file under a hidden name
(".<name>.tmp") in its final folder; `write_record` writes the commit record atomically (the commit point);
`publish` renames the hidden files into place. `commit` runs them in this order. A kill before the record leaves
only hidden files, which the next attempt deletes; a kill after it is rolled forward by the next run's survey as it
finds the unit (`_publish_left`; `recover` for verify, by one listing of each folder).
So a unit's rows are either all in the output and rejects, once, or not there at all, whatever its outcome. No
reader reads a hidden file: pyarrow.dataset skips names starting with . or _, and DuckDB's
read_parquet('OUT/*.parquet'), which does not, reads only names ending in .parquet. `drop` uncommits a unit that
`survey` found broken, so that it is redone.

On object storage (see location.py) there is no rename: `publish` is a copy and a delete, so a kill between them
leaves the file under both names, with the same content; the survey deletes the hidden one (`recover` copies
again and deletes it, as it renames locally). The commit point is still the record, which is one PUT (all or
nothing). Nothing is listed or read back under its final name before its record exists, so a half-published unit is
never taken for a stray or a finished one.
"""

from __future__ import annotations

import orjson
import os
import posixpath
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import fs

from batchjson.errors import OutputError, StorageFull, is_full
from batchjson.storage.index import (BITS, EARLIER, INDEX, KINDS as KIND_ORDER, PLANNED, SCHEMA as INDEX_SCHEMA,
                                     Index, digest, part_name, part_names, planning_columns)
from batchjson.storage.location import Location, Unreadable, json_bytes, writing
from batchjson.storage.progress import add_reasons, empty_tally
from batchjson.storage.names import STAGED, Kind, PartName, Stage, UnitName, staged
from batchjson.storage.shelf import Shelf

PLANNED_SCHEMA = INDEX_SCHEMA.empty_table().select(PLANNED).schema  # the index's planning columns
CHECKED = 32768  # the records whose files `_check_sizes` looks at together
LISTED_PAGE = 1000  # the keys one request of an object store's listing answers (S3's page)
KINDS: dict[Stage, tuple[Kind, ...]] = {Stage.FIRST: ("output", "rejects", "requeue"),
                                        Stage.SECOND: ("output", "rejects")}  # only pass 1 requeues


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
    not known. A run redoes the unit (`survey`); verify names it."""


def _parsed(name: str, data: bytes) -> dict:
    try:
        record = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise DamagedRecord(f"its commit record {name} does not parse as JSON ({e})") from None
    if not (isinstance(record, dict) and isinstance(record.get("files"), dict) and isinstance(record.get("rows"), dict)):
        raise DamagedRecord(f"its commit record {name} is not one (no files and rows)")
    return record


@dataclass
class Survey:
    """What a run's start finds of its units (`Commits.survey`)."""

    damaged: dict[str, str] = field(default_factory=dict)
    """Unit -> what is wrong with it: the run redoes it."""
    second: dict[str, int] = field(default_factory=dict)
    """Unit -> the rows it has waiting for pass 2, whose pass 2 is not committed."""
    passes: dict = field(default_factory=dict)
    """The records of the units that are not damaged, tallied by pass (progress.py `add_record`): the progress
    file's counts at the start (those `later` surveys join when it answers)."""
    later: Callable[[], tuple[dict[str, str], dict]] | None = None
    """The survey of the committed units that no pass hands out (`Commits.survey`'s `defer`), to be run beside the
    run: their `damaged` and `passes`. None when every unit was surveyed already."""


class Commits:
    """The committed units of one output folder (of every shard), and the steps that commit one more."""

    def __init__(self, folders: dict[Kind, Location], units: Location, state: Location,
                 guard: Callable[[], None] = lambda: None):
        self.folders = folders
        """Where each kind of part file goes: the output, rejects and requeue folders."""
        self.units = units
        """The commit records' folder."""
        self.state = state
        """The run state folder, where the index lives: the records folded into a few files, with what the last
        passing check read (index.py)."""
        self._index = Index()  # as a run read it (`read_index`); verify never reads it, and reads everything
        self._seen = Shelf(2)  # part file name -> its stamp, as the folders were last listed (`_list_parts`)
        self.guard = guard
        """Raises if this run no longer holds the folder (a lost lease), before a record is written."""
        self._committed: set[str] | None = None
        self._records: pa.Table | None = None  # the records as `committed` listed them: name, size, mtime
        self._planning = False  # from `read_index` to the end of `survey`: the index's bytes are not read then
        self._listings: dict[str, Future] = {}  # folder path -> its listing as a table, under way since `read_index`
        # Commit records read or written so far, as their files' bytes (a record never changes, only goes: drop),
        # on a Shelf (shelf.py): in a dict they took about 1.1 KB of driver a record. Parsed again at each look (a
        # few µs), and digested when the index is written.
        self._read = Shelf()
        self.fold_every = 0
        """Fold the records read or written since the last part of the index into a new one every this many
        (`fold`); 0: never (verify, replicas). A run sets it."""
        self._fresh: list[str] = []  # records read or written since the last part of the index
        self._checks: list[tuple[str, tuple[int, int]]] = []  # stamps vouched for since the last part (`vouch`)
        self._news = False  # whether the folder holds what the index this run read does not (`write_index`)
        self._folding = threading.Lock()
        self.after: Callable[[str, str], None] = lambda step, stage: None
        """Called after each step of the commit protocol, with the pass; tests use it to kill the process there."""

    def part(self, stage: Stage, key: str, kind: Kind) -> Location:
        return self.folders[kind] / PartName(stage, key, kind).file_name()

    def _path(self, kind: Kind, name: str) -> str:
        """A part file's path on its store, as `_seen` keeps it, without a Location made for it."""
        return posixpath.join(self.folders[kind].path, name)

    def record_path(self, stage: Stage, key: str) -> Location:
        return self.units / UnitName(stage, key).file_name()

    @staticmethod
    def _hidden(path: Location) -> Location:
        return path.with_name(staged(path.name))

    # ----- what is committed -----------------------------------------------------------------------------------
    def committed(self) -> set[str]:
        """Names ("p1-<unit>") of the committed units of every shard, listed once and kept up to date."""
        if self._committed is None:
            # Locally the names alone, a stat less per record (195,320 at 100 million rows: 0.5 s): the stamps, by
            # which the index's entries answer for their records, are listed where they are needed (`survey`).
            listed = _records(self._listing(self.units, stat=False))
            self._records = listed
            self._index.listed(listed)  # an entry its record no longer matches answers for nothing
            self._committed = set(pc.utf8_slice_codeunits(listed["name"], 0, -5).to_pylist())
        return self._committed

    def _bytes(self, name: str) -> bytes | None:
        """A committed record's bytes as this run read or wrote them, or as the index holds them (for the records
        listed with the indexed stamp, `committed`); None if neither has them. While the run plans (`read_index`
        to the end of `survey`) the index's bytes are not read: its columns answer for its records then, and a
        record they do not answer for is read."""
        data = self._read.get(name)
        if data is None and not (self._planning and not self._index.loaded):
            return self._index.copy(name)
        return data

    def _listed(self) -> list[tuple[str, int, int]]:
        """The commit records as listed now, (name, size, mtime_ns), in their names' order: the shelves are read and
        written in that order, a page of SQLite's for many records rather than a page for each."""
        return sorted(i for i in self.units.listing() if fnmatchcase(i[0], "p[12]-*.json"))

    def forget(self) -> None:
        """Drop what was listed and read: the folder was cleared."""
        self._committed, self._index, self._records, self._planning = None, Index(), None, False
        self._listings.clear()
        self._read.clear()
        self._fresh.clear()
        self._checks.clear()
        self._news = True

    def read_index(self, prefetch: bool = True) -> None:
        """Read the index (index.py) for this run: its records stand in for reading theirs. Its files are found
        before anything is listed or read, and before the run decides whether to run (a refusal leaves the index
        where it is); they are read once the survey needs them (`Index.start`), beside the run where it is deferred
        (`survey`). Nothing of it is deleted before a passing check writes it afresh (`write_index`): an entry its
        unit's redoing made stale no longer matches the record's stamp, and is not used. `prefetch`: list the
        folders beside it (`_prefetch`); not for a run that clears them (--fresh), whose listings `forget` would
        throw away."""
        if prefetch:
            self._prefetch()
        self._index, self._committed, self._planning = Index.read(self.state), None, True

    def _prefetch(self) -> None:
        """List the records' folder, then the requeue folder (locally by name, a stat of each file being what most
        of a listing costs), on a thread of its own, beside the rest of the run's start: `committed` and `survey`
        (pass 2's units) take these listings, the folder being held by this run (its other shards touch none of this
        shard's units). The output and rejects folders are listed by the survey of the units no pass hands out
        (`Survey.later`), beside the run, which publishes what a killed run left staged (`_publish_left`): at 100
        million rows their 390,000 files listed by name took 0.4 s of the resume's way to its first prompt."""
        folders = {f.path: f for f in (self.units, self.folders["requeue"])}
        pool = ThreadPoolExecutor(1, thread_name_prefix="batchjson-listing")
        self._listings = {path: pool.submit(_list, folder, False) for path, folder in folders.items()}
        pool.shutdown(wait=False)

    def _listing(self, folder: Location, keep: bool = False, stat: bool = True) -> pa.Table:
        """The folder's files (name, size, mtime) as a table: the listing `_prefetch` began, taken once (`keep`: left
        for the next look), else listed now (`stat`: False, names only: sizes and times 0 locally). A listing of
        names does not answer for one with stamps."""
        if stat and folder.local:
            self._listings.pop(folder.path, None)
        future = self._listings.get(folder.path) if keep else self._listings.pop(folder.path, None)
        return future.result() if future is not None else _list(folder, stat)

    def fold(self, now: bool = False) -> None:
        """Write the records read or written since the last part of the index as a new part (index.py), once there
        are `fold_every` of them (or any, `now`): a run killed midway leaves its records folded into a few files,
        which its resume reads in place of every record (two requests each on object storage)."""
        with self._folding:
            if not self.fold_every or not (self._fresh or self._checks) or (len(self._fresh) < self.fold_every
                                                                            and not now):
                return
            fresh, checks, part = set(self._fresh), self._checks, self.state / part_name(self._index.next_part)
            self._fresh, self._checks = [], []
            self._index.next_part += 1
            if self.units.local:  # a look per record is a stat here; on object storage, one listing is cheaper
                listed = ((name, (info.size, info.mtime_ns)) for name in sorted(fresh)
                          if (info := (self.units / name).info()).type == fs.FileType.File)
            else:
                listed = ((name, (size, mtime)) for name, size, mtime in self.units.listing() if name in fresh)
            records = ((name, s, digest(data), data) for name, s in listed if (data := self._bytes(name)) is not None)
            with writing(part):
                Index.write(part, records, checks)

    def stamps(self, key: str) -> list[tuple[str, tuple[int, int]]] | None:
        """The stamps of a committed unit's records and files, (file name, stamp), before a check reads them
        (`vouch`); None if one of them is not there (a publish under way: the end check reads the unit). Asks for
        the records, not the listing: a replica's commits are not in this process's."""
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

    def vouch(self, stamps: list[tuple[str, tuple[int, int]]]) -> None:
        """A unit's records and files, with these stamps (`stamps`, taken before they were read), hold its rows, as a
        check of the unit read them (verify.py's `UnitChecks`): this run's end check trusts them while they keep
        these stamps (`trusted`), and the next part of the index keeps them for the next run's (`fold`)."""
        with self._folding:
            self._index.vouch_files(stamps)
            if self.fold_every:
                self._checks.extend(stamps)

    @property
    def index_written(self) -> str:
        """When the check that wrote the index this run read passed ("" without one)."""
        return self._index.written

    def trusted(self) -> frozenset[str]:
        """The committed units whose records and files are all listed as a check read them: the last passing check
        of the folder (its records as indexed) or, as each unit committed, a run's check of it (`vouch`; index.py).
        The end check counts them from their records. Lists the folders now; `write_index` keeps these stamps."""
        self._list_parts()
        units, changed = set(), set()
        for name, size, mtime in self._listed():  # listed now: a replica's commits are in no set of this process
            units.add(UnitName.parse(name).key)
            found = self._index.record(name, (size, mtime))
            data = found[1] if found else self._bytes(name) if self._index.checked(name, (size, mtime)) else None
            if data is None or not all(self._index.checked(part, self._seen.get(self._path(kind, part)))
                                       for kind, part in orjson.loads(data)["files"].items()):
                changed.add(UnitName.parse(name).key)
        self._news = self._news or bool(changed)
        return frozenset(units - changed)

    def _list_parts(self) -> None:
        """List the part files of every folder into `_seen` (path -> stamp), one at a time."""
        self._seen.clear()
        self._seen.update((posixpath.join(folder.path, name), (size, mtime))
                          for folder in {f.path: f for f in self.folders.values()}.values()
                          for name, size, mtime in folder.listing())

    def write_index(self) -> None:
        """After an exactly-once check of the whole folder passed: its records, and its files as `trusted` listed
        them before the check read them, folded into the index for the next run; then the index's earlier files go
        (written first, so a kill between leaves both, which read as one). Not when the index this run read holds
        it all already (every record from it, every unit trusted: a rerun of a finished job writes nothing)."""
        if not (self._news or not self._index.written or self._index.replaced):
            return
        checked, stamps = Shelf(2), []

        def records() -> Iterator[tuple]:
            for name, size, mtime in self._listed():
                data = self._bytes(name)
                if data is not None:
                    record = orjson.loads(data)
                    stamps.extend((part, seen) for kind, part in record["files"].items()
                                  if (seen := self._seen.get(self._path(kind, part))) is not None)
                    if len(stamps) >= 4096:  # onto the shelf a few thousand at a time: one transaction each
                        checked.update(stamps)
                        stamps.clear()
                    yield name, (size, mtime), digest(data), data, record
            checked.update(stamps)

        stale = [*EARLIER, *part_names(self.state.names())]
        with writing(self.state / INDEX):
            Index.write(self.state / INDEX, records(), checked.items())
        for name in stale:
            (self.state / name).unlink(missing_ok=True)
        self._fresh.clear()

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
        self._read[name] = data
        self._news = True
        if self.fold_every:
            with self._folding:
                self._fresh.append(name)
        return data, record

    def _load(self, name: str) -> dict:
        data, record = self._fetch(name)
        return _parsed(name, data) if record is None else record

    def record(self, stage: Stage, key: str) -> dict | None:
        try:
            return self._load(f"{stage}-{key}.json")
        except FileNotFoundError:
            return None

    def records(self, stage: Stage | None = None) -> Iterator[dict]:
        """The commit records of one pass, or of both, one at a time (a folder's records parsed at once would be
        the driver's largest object). A damaged one is left out: `survey` and verify name it, unit by unit."""
        pattern = f"{stage}-*.json" if stage else "p[12]-*.json"
        names = sorted(name for name, _, _ in self.units.listing(stat=False) if fnmatchcase(name, pattern))
        for name in names:
            try:
                yield self._load(name)
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
        for kind in KINDS[stage]:
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
        self._read[path.name] = json_bytes(record)
        self._news = True
        if self.fold_every:
            with self._folding:
                self._fresh.append(path.name)
        if self._committed is not None:  # a replica's commits list nothing (the driver's listing decides)
            self._committed.add(UnitName(stage, key).unit_id())
        self.after("committed", stage)

    def received(self, record: dict) -> None:
        """A record another process (a replica) wrote, as it handed it over: kept as if read here (a GET less per
        unit on object storage), for the fold, the tally and the unit checks. Its bytes are those written."""
        name, data = self.record_path(record["stage"], record["key"]).name, json_bytes(record)
        if self._read.get(name) == data:  # written by this process (a worker inline)
            return
        self._read[name] = data
        self._news = True
        if self.fold_every:
            with self._folding:
                self._fresh.append(name)

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
        for kind in KINDS[stage]:
            self._hidden(self.part(stage, key, kind)).unlink(missing_ok=True)

    # ----- after a kill, or damage -----------------------------------------------------------------------------
    def recover(self) -> None:
        """Roll forward units committed by a run that was killed before it published their files: its hidden files
        from one listing of each folder, by name (`verify`; a run's survey publishes them unit by unit,
        `_publish_left`)."""
        moved = False
        for kind, folder in self.folders.items():
            listing = self._listing(folder, keep=True, stat=False)["name"]
            hidden = pc.filter(listing, pc.starts_with(listing, ".")).to_pylist()
            for legacy in (folder / name for name in hidden if fnmatchcase(name, ".*.parquet")):
                # staged by a version before STAGED (DuckDB reads these); beside its published part it is a copy
                if not legacy.with_name(legacy.name[1:]).exists():
                    legacy.move(legacy.with_name(f"{legacy.name}{STAGED}"))
                    hidden.append(f"{legacy.name}{STAGED}")
                    moved = True
            for hidden_part in (folder / name for name in hidden if fnmatchcase(name, f".*.parquet{STAGED}")):
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
                self._listings.pop(folder.path, None)

    def survey(self, keys: list[str], id_column: str, defer: bool = False) -> Survey:
        """Of these units, the committed ones that are damaged (`Survey.damaged`), the rows each of the others
        has waiting for pass 2 while its pass 2 is not committed (`Survey.second`), and the others' records tallied
        (`Survey.passes`).

        A damaged unit has a file its record lists that is gone (deleted by hand), does not read as Parquet
        (truncated, emptied, overwritten) or holds another number of rows. Cheap, as every start runs it: one
        listing of each folder, whose sizes are compared with those the records keep (`sizes`, written at commit);
        a file whose size differs is damaged. A file not under its final name (its publish is under way, or it is
        gone) and any file of a record older than `sizes` are read as verify reads them (the id column), so what
        verify finds unreadable a rerun redoes. `verify` reads every file.

        `defer`: only the units pass 2 hands out are surveyed now, from their records, read (not the index): those
        with a requeue file whose pass 1 is committed and whose pass 2 is not, each of their files looked at (a stat;
        on object storage, where a look is a request, each part folder listed instead once they are more than a
        listing's pages). The other committed units are surveyed by `Survey.later`, which the run calls beside its
        passes (job.py redoes what it finds damaged, and adds their tally to the progress file's): it lists the
        records with their stamps, by which the index answers for them, and the part folders. At 100 million rows
        these listings (585,000 files, a stat each), the index's answers and their tally took 1.5-2 s of the resume's
        way to its first prompt; on object storage the index's parts and the records after its last part are
        requests too (BENCHMARKS.md, "A resume after a kill at 99%").

        Planned from columns (storage/index.py): the index's rows for the records listed with the indexed stamp
        answer for them, compared with the folders' listings as Arrow tables; only a record they do not answer for
        (written after the index's last part, or rewritten since) is read and parsed. The folders' sizes and the
        index's columns are held for the survey only: the stamps the end check compares (`trusted`) are listed again
        then. Compared by look-ups of names (`pc.index_in`), not Acero joins: at 100 million rows (killed at 99%)
        the planning's peak was 458-464 MiB with joins, 324-356 with look-ups, and the resume's 497-505 and 362-394."""
        found = None
        try:
            found = self._survey(keys, id_column, defer)
            return found
        finally:
            # the index's bytes answer from here on (read once first asked for), or once `later` has run
            self._planning = found is not None and found.later is not None

    def _survey(self, keys: list[str], id_column: str, defer: bool) -> Survey:
        self.committed()
        names = self._records["name"]  # the records of these units (names only: all the survey takes of them)
        of_keys = pc.is_in(pc.utf8_slice_codeunits(names, 3, -5), value_set=pa.array(keys, pa.string()))
        mine = names if pc.all(of_keys).as_py() else names.filter(of_keys)  # else another shard's records too
        found, flaws, parsed = Survey(), {}, {}  # flaws: key -> (where, what); parsed: name -> record read now
        if defer:  # pass 2's units now, from their records; the rest beside the run
            requeue = self._listing(self.folders["requeue"], stat=False)["name"]
            hidden = pc.starts_with(requeue, ".")
            if pc.any(hidden).as_py():  # requeue files a killed run left staged: published as they are surveyed
                unstaged = pc.replace_substring_regex(requeue.filter(hidden), rf"^\.(.*?)({re.escape(STAGED)})?$",
                                                      r"\1")
                requeue = pc.unique(pa.chunked_array([*requeue.filter(pc.invert(hidden)).chunks, *unstaged.chunks]))
            held = pc.utf8_slice_codeunits(requeue.filter(pc.ends_with(requeue, ".parquet")), 0, -8)
            first, second = (pc.utf8_slice_codeunits(mine.filter(pc.starts_with(mine, f"{stage}-")), 3, -5)
                             for stage in Stage)
            held = held.filter(pc.and_(pc.is_in(held, value_set=first), pc.invert(pc.is_in(held, value_set=second))))
            records = self._read_records(UnitName.unit_ids(Stage.FIRST, held.to_pylist()), parsed, flaws)
            # a look per file, unless on object storage the looks would be more requests than a listing's pages
            look = self.units.local or records.num_rows <= max(1, len(names) // LISTED_PAGE)
            for kind, folder in self.folders.items():
                self._check_sizes(kind, records, parsed, flaws, id_column, folder if look else self._listing(folder))
            done = pa.array([*records["key"].to_pylist(), *flaws], pa.string())
            rest = mine.filter(pc.invert(pc.is_in(pc.utf8_slice_codeunits(mine, 3, -5), value_set=done)))
            if len(rest):
                found.later = lambda: self._survey_later(rest, parsed, id_column)
        else:
            self._index.start()  # its files read beside the listings
            if self.units.local:  # the stamps the index's entries answer by (`committed` lists names)
                self._index.listed(_records(self._listing(self.units)))
            records = self._answered(mine, parsed, flaws)
            for kind, folder in self.folders.items():  # each listing taken once, not held past its look
                self._check_sizes(kind, records, parsed, flaws, id_column, self._listing(folder))
        self._listings.clear()
        found.damaged = _worst(flaws)
        records = _without(records, found.damaged)
        waiting = records.filter(pc.and_(pc.equal(records["stage"], "p1"), pc.not_equal(pc.bit_wise_and(
            records["kinds"], BITS["requeue"]), 0)))
        second = names.filter(pc.starts_with(names, "p2-"))  # the units whose pass 2 is committed
        waiting = waiting.filter(pc.invert(pc.is_in(waiting["key"], value_set=pc.utf8_slice_codeunits(second, 3, -5))))
        found.passes = _tally(records)
        found.second = dict(zip(waiting["key"].to_pylist(), waiting["rows_requeue"].to_pylist()))
        del records, waiting
        # The survey's tables go back to the system, not kept by Arrow's allocator under the run's own memory (and
        # `later`'s listings) after: at 100 million rows the driver's peak is at the start since `later`.
        pa.default_memory_pool().release_unused()
        return found

    def _survey_later(self, names: pa.Array, parsed: dict, id_column: str) -> tuple[dict[str, str], dict]:
        """`Survey.later`: of these records (the start's, of the units no pass hands out), the damaged units and the
        others' records tallied, from the records listed now with their stamps (the index's answers), one listing
        of each part folder with a stat of each file, and the records the index does not answer for, read. On a
        thread of its own beside the run: it changes nothing in the folder, and what it reads no pass touches."""
        flaws, release = {}, pa.default_memory_pool().release_unused
        self._index.start()  # its files read beside the records' listing, not before the first prompt
        self._index.listed(_records(_list(self.units)))  # the stamps the index's entries answer by
        records = self._answered(names, parsed, flaws)
        for kind, folder in self.folders.items():
            self._check_sizes(kind, records, parsed, flaws, id_column, _list(folder))
            release()  # each folder's look handed back before the next is listed, not piled on it
        damaged = _worst(flaws)
        passes = _tally(_without(records, damaged))
        self._planning = False
        del records
        # What the listings took goes back to the system rather than staying with Arrow's allocator through the run
        # (its end check is the driver's peak: 406-408 MiB at 100 million rows with it kept, BENCHMARKS.md).
        pa.default_memory_pool().release_unused()
        return damaged, passes

    def _answered(self, names: pa.Array, parsed: dict, flaws: dict) -> pa.Table:
        """The planning columns of these records, with their pass and unit (`stage`, `key`): the index's rows where
        it answers for them (listed with the indexed stamp), else read now (`_read_records`). The index's columns
        go after (`drop_planned`)."""
        answers = self._index.answers(names)
        self._index.drop_planned()  # its columns are not held longer
        pa.default_memory_pool().release_unused()  # nor kept by Arrow's allocator under what follows
        unanswered = pc.filter(names, pc.invert(pc.is_in(names, value_set=answers["name"]))).to_pylist()
        read = self._read_records((name[:-5] for name in unanswered), parsed, flaws)
        return pa.concat_tables([_keyed(answers), read])

    def _read_records(self, units: Iterable[str], parsed: dict, flaws: dict) -> pa.Table:
        """The planning columns of these units' records ("p1-<unit>"), with `stage` and `key`, each read now (or
        taken from `parsed`) and kept in `parsed`; one that does not read as a record is a flaw of its unit, one
        gone since it was listed is left out."""
        rows = []
        for unit in units:
            name, name_of = f"{unit}.json", UnitName.parse(unit)
            try:
                record = parsed[name] if name in parsed else self._load(name)
            except FileNotFoundError:
                continue  # gone since it was listed
            except DamagedRecord as e:
                flaws.setdefault(name_of.key, []).append(((list(Stage).index(name_of.stage), -1), str(e)))
                continue
            parsed[name] = record
            rows.append(dict(zip(PLANNED, (name, 0, 0, *planning_columns(record)))))
        return _keyed(pa.Table.from_pylist(rows, schema=PLANNED_SCHEMA))

    def used(self, files: set[str]) -> Counter:
        """The committed units of pass 1 of each of these input files (their tags), from the index's columns where
        they answer (`survey`), else from the records."""
        self.committed()
        names = self._records.filter(pc.starts_with(self._records["name"], "p1-"))["name"]
        answers = self._index.answers()
        answers = answers.filter(pc.is_in(answers["name"], value_set=names))
        used = Counter({tag: n for tag, n in zip(*(c.to_pylist() for c in pc.value_counts(answers["file"]).flatten()))
                        if tag in files})
        for name in pc.filter(names, pc.invert(pc.is_in(names, value_set=answers["name"]))).to_pylist():
            try:
                record = self._load(name)
            except (FileNotFoundError, DamagedRecord):
                continue
            if record.get("file") in files:
                used[record["file"]] += 1
        return used

    def _check_sizes(self, kind: Kind, records: pa.Table, parsed: dict, flaws: dict, id_column: str,
                     listing: pa.Table | Location) -> None:
        """The survey's look at the files of one kind that the records list: each listed with the size its record
        keeps, or read (`_flaw`) where it is not listed under its final name or its record keeps no size.
        `listing`: the folder's listing, or the folder, whose files of these records are each looked at (a stat).
        Looked at 32,768 records at a time: at 100 million rows (193,547 records) the output files' look at them all
        took 55 MiB of Arrow's memory beside the run, 32,768 at a time 26 (most of it the listing's look-up)."""
        if isinstance(listing, Location):
            listing = _stat(listing, self._files_of(kind, _having(kind, records)).to_pylist())
        staged_left = listing["name"].filter(pc.ends_with(listing["name"], STAGED))  # none unless a run was killed
        for start in range(0, records.num_rows, CHECKED):
            self._check_slice(kind, records.slice(start, CHECKED), parsed, flaws, id_column, listing, staged_left)

    @staticmethod
    def _files_of(kind: Kind, mine: pa.Table) -> pa.ChunkedArray:
        """The file of this kind of each of these records (`stage`, `key`), as its record names it when written."""
        unit = pc.binary_join_element_wise(mine["stage"], mine["key"], "-")
        return (pc.binary_join_element_wise(unit, ".parquet", "") if kind == "output" else
                pc.binary_join_element_wise("rejects-", unit, ".parquet", "") if kind == "rejects" else
                pc.binary_join_element_wise(mine["key"], ".parquet", ""))

    def _check_slice(self, kind: Kind, records: pa.Table, parsed: dict, flaws: dict, id_column: str,
                     listing: pa.Table, staged_left: pa.ChunkedArray) -> None:
        """`_check_sizes` of some of the records, against the folder's whole listing (`staged_left`: its staged
        names)."""
        mine = _having(kind, records.select(["name", "stage", "key", "kinds", f"rows_{kind}", f"size_{kind}"]))
        file = self._files_of(kind, mine)
        # each file's size as listed, null where it is not: looked up by name, not joined (index.py's `as_listed`)
        seen = listing["size"].take(pc.index_in(file, value_set=listing["name"]))
        files = mine.append_column("file", file).append_column("seen", seen)
        kept = files[f"size_{kind}"]
        differ = files.filter(pc.and_(pc.and_(pc.is_valid(kept), pc.is_valid(seen)), pc.not_equal(kept, seen)))
        unknown = files.filter(pc.or_(pc.is_null(kept), pc.is_null(seen)))
        if len(staged_left):  # a staged copy beside its published file: a kill between a publish's copy and delete
            published = files.filter(pc.is_valid(seen))["file"]
            copies = published.filter(pc.is_in(pc.binary_join_element_wise(".", published, STAGED, ""),
                                               value_set=staged_left))
            for name in copies.to_pylist():
                (self.folders[kind] / staged(name)).unlink(missing_ok=True)
        order = KIND_ORDER.index(kind)
        for row in differ.to_pylist():
            name = self._file_name(row, kind, parsed)
            flaws.setdefault(row["key"], []).append((
                (list(Stage).index(row["stage"]), order),
                f"{name} held {row['seen']} bytes, not the {row[f'size_{kind}']} its commit record lists"))
        for row in unknown.to_pylist():
            record = parsed.get(row["name"]) or {"stage": row["stage"], "key": row["key"],
                                                 "files": {kind: row["file"]}, "rows": {kind: row[f"rows_{kind}"]}}
            flaw = self._flaw(record, kind, id_column)
            if flaw:
                flaws.setdefault(row["key"], []).append(((list(Stage).index(row["stage"]), order), flaw))

    @staticmethod
    def _file_name(row: dict, kind: Kind, parsed: dict) -> str:
        """The file of this kind as the row's record names it."""
        record = parsed.get(row["name"])
        return record["files"][kind] if record else row["file"]

    def _publish_left(self, path: Location) -> bool:
        """Publish a committed unit's file that a killed run left staged (`recover`'s move, for one file the survey
        did not find under its final name): under its hidden name, or under a version's before STAGED (".<name>").
        Whether one was there."""
        return any(self._place(hidden, path) for hidden in (self._hidden(path), path.with_name(f".{path.name}")))

    def _flaw(self, record: dict, kind: Kind, id_column: str) -> str:
        """What is wrong with a committed file the survey did not find listed with its size: "" if nothing. One not
        under its final name is published first where a killed run left it staged (`_publish_left`)."""
        name, rows, path = record["files"][kind], record["rows"][kind], self.part(record["stage"], record["key"], kind)
        try:
            try:
                found = path.read_parquet([id_column]).num_rows
            except FileNotFoundError:
                if self._publish_left(path):
                    self.after(f"published {kind}", record["stage"])
                found = path.read_parquet([id_column]).num_rows
        except FileNotFoundError:
            return f"{name} was missing"
        except Unreadable as e:
            return str(e)
        return "" if found == rows else f"{name} held {found} rows, not the {rows} its commit record lists"

    def drop(self, key: str) -> None:
        """Uncommit a unit in both passes (records first, then files), so that it is redone from scratch."""
        for stage in reversed(Stage):
            self.record_path(stage, key).unlink(missing_ok=True)
            self._read.pop(self.record_path(stage, key).name, None)
            self._index.forget(self.record_path(stage, key).name)
            self._news = True
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


LISTED = pa.schema([("name", pa.string()), ("size", pa.int64()), ("mtime", pa.int64())])


def _batch(names: list, sizes: list, mtimes: list) -> pa.RecordBatch:
    return pa.record_batch([pa.array(names, pa.string()), pa.array(sizes, pa.int64()), pa.array(mtimes, pa.int64())],
                           schema=LISTED)


def _list(folder: Location, stat: bool = True) -> pa.Table:
    """The files directly in `folder` as a table (name, size, mtime), as `Location.listing` lists them; locally
    without a tuple or a generator's step per file (a stat each: at 100 million rows, 585,000 files). `stat`:
    False, locally the names alone (sizes and times 0), no file looked at beyond its directory entry (x5 faster)."""
    if not folder.local:
        return _table(folder.listing())
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
        return _table(iter(()))
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
            if len(names) == 65536:
                batches.append(_batch(names, sizes, mtimes))
                names, sizes, mtimes = [], [], []
    batches.append(_batch(names, sizes, mtimes))
    return pa.Table.from_batches(batches, schema=LISTED)


def _stat(folder: Location, names: list[str]) -> pa.Table:
    """These files of a local `folder` as `_list` lists them, each looked at (a stat); one that is not there is left
    out."""
    found = []
    for name in names:
        try:
            info = os.stat(os.path.join(folder.path, name))
        except (FileNotFoundError, NotADirectoryError):
            continue
        found.append((name, info.st_size, info.st_mtime_ns))
    return _table(iter(found))


def _keyed(records: pa.Table) -> pa.Table:
    """The index's planning columns of these records, with each one's pass (`stage`, "p1") and unit (`key`)."""
    return records.append_column("stage", pc.utf8_slice_codeunits(records["name"], 0, 2)).append_column(
        "key", pc.utf8_slice_codeunits(records["name"], 3, -5))


def _having(kind: Kind, records: pa.Table) -> pa.Table:
    """These records (`_keyed`), those that list a file of this kind."""
    return records.filter(pc.not_equal(pc.bit_wise_and(records["kinds"], BITS[kind]), 0))


def _without(records: pa.Table, damaged: dict[str, str]) -> pa.Table:
    """These records (`_keyed`), but those of the damaged units."""
    if not damaged:
        return records
    return records.filter(pc.invert(pc.is_in(records["key"], value_set=pa.array(list(damaged), pa.string()))))


def _records(listed: pa.Table) -> pa.Table:
    """The commit records of a listing of the records' folder."""
    return listed.filter(pc.match_substring_regex(listed["name"], r"^p[12]-.*\.json$"))


def _worst(flaws: dict) -> dict[str, str]:
    """Unit -> what is wrong with it, of its flaws (place, what) the first by place (its pass, then kind)."""
    return {key: min(found)[1] for key, found in sorted(flaws.items())}


def _table(entries: Iterator[tuple[str, int, int]]) -> pa.Table:
    """A listing's (name, size, mtime) as an Arrow table, built 65,536 entries at a time (no Python object per
    entry outlives its chunk)."""
    batches, chunk = [], []
    for entry in entries:
        chunk.append(entry)
        if len(chunk) == 65536:
            batches.append(_batch(*map(list, zip(*chunk))))
            chunk = []
    if chunk:
        batches.append(_batch(*map(list, zip(*chunk))))
    return pa.Table.from_batches(batches, schema=LISTED)


def _tally(records: pa.Table) -> dict:
    """`add_record`'s tally (progress.py) of these rows of the records' columns, by pass, as arrays: the reasons
    are JSON, each distinct one parsed once."""
    passes = {}
    for stage in sorted(set(records["stage"].to_pylist())):
        mine = records.filter(pc.equal(records["stage"], stage))
        tally = passes[stage] = empty_tally()
        tally["units"] = mine.num_rows
        for kind in KIND_ORDER:
            tally[kind] = pc.sum(mine[f"rows_{kind}"]).as_py() or 0
        tally["requeued_units"] = pc.sum(pc.greater(mine["rows_requeue"], 0).cast(pa.int64())).as_py() or 0
        counts = pc.value_counts(mine["reasons"])
        for text, n in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()):
            add_reasons(tally, orjson.loads(text or "{}"), n)
    return passes

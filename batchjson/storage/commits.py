"""The unit commits of an output folder: the protocol that commits one unit of one pass, and what is committed.

A unit's commit moves through named steps, one method each, after dlt's `PackageStorage` (one move per step):
`begin` deletes every file of any earlier attempt, of every kind; `stage` writes one file under a hidden name
(".<name>.tmp") in its final folder; `write_record` writes the commit record atomically (the commit point);
`publish` renames the hidden files into place. `commit` runs them in this order. A kill before the record leaves
only hidden files, which the next attempt deletes; a kill after it is rolled forward by `recover` at the next open.
So a unit's rows are either all in the output and rejects, once, or not there at all, whatever its outcome. No
reader reads a hidden file: pyarrow.dataset skips names starting with . or _, and DuckDB's
read_parquet('OUT/*.parquet'), which does not, reads only names ending in .parquet. `drop` uncommits a unit that
`survey` found broken, so that it is redone.

On object storage (see location.py) there is no rename: `publish` is a copy and a delete, so a kill between them
leaves the file under both names, with the same content; `recover` copies again and deletes the hidden one, as it
renames locally. The commit point is still the record, which is one PUT (all or nothing). Nothing is listed or read
back under its final name before its record exists, so a half-published unit is never taken for a stray or a
finished one.
"""

from __future__ import annotations

import orjson
import posixpath
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import pyarrow as pa
from pyarrow import fs

from batchjson.errors import OutputError, StorageFull, is_full
from batchjson.storage.index import EARLIER, INDEX, Index, digest, part_name, part_names
from batchjson.storage.location import Location, Unreadable, json_bytes, writing
from batchjson.storage.progress import add_record
from batchjson.storage.names import STAGED, Kind, PartName, Stage, UnitName, staged
from batchjson.storage.shelf import Shelf

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
    file's counts at the start."""


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
            committed = set()
            for name, size, mtime in self._listed():
                committed.add(UnitName.parse(name).unit_id())
                self._index.drop_stale(name, (size, mtime))  # an entry its record no longer matches goes
            self._committed = committed
        return self._committed

    def _bytes(self, name: str) -> bytes | None:
        """A committed record's bytes as this run read or wrote them, or as the index holds them (whose entries for
        records listed with another stamp `committed` dropped); None if neither has them."""
        data = self._read.get(name)
        return self._index.copy(name) if data is None else data

    def _listed(self) -> list[tuple[str, int, int]]:
        """The commit records as listed now, (name, size, mtime_ns), in their names' order: the shelves are read and
        written in that order, a page of SQLite's for many records rather than a page for each."""
        return sorted(i for i in self.units.listing() if fnmatchcase(i[0], "p[12]-*.json"))

    def forget(self) -> None:
        """Drop what was listed and read: the folder was cleared."""
        self._committed, self._index = None, Index()
        self._read.clear()
        self._fresh.clear()
        self._checks.clear()
        self._news = True

    def read_index(self) -> None:
        """Read the index (index.py) for this run: its records stand in for reading theirs. Before anything is
        listed or read, and before the run decides whether to run: a refusal leaves the index where it is. Nothing
        of it is deleted before a passing check writes it afresh (`write_index`): an entry its unit's redoing made
        stale no longer matches the record's stamp, and is not used."""
        self._index, self._committed = Index.read(self.state), None

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
                    stamps.extend((part, seen) for kind, part in orjson.loads(data)["files"].items()
                                  if (seen := self._seen.get(self._path(kind, part))) is not None)
                    if len(stamps) >= 4096:  # onto the shelf a few thousand at a time: one transaction each
                        checked.update(stamps)
                        stamps.clear()
                    yield name, (size, mtime), digest(data), data
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
    def commit(self, stage: Stage, key: str, tables: dict[Kind, pa.Table], meta: dict) -> None:
        """Commit one unit of one pass: begin, stage its files, write its record, publish the files."""
        self.begin(stage, key)
        files, rows, sizes = {}, {}, {}
        for kind, table in tables.items():
            if table is None or not table.num_rows:
                continue
            files[kind], rows[kind], sizes[kind] = self.stage(stage, key, kind, table)
        record = {"stage": stage, "key": key, "files": files, "rows": rows, "sizes": sizes} | meta
        self.write_record(record)
        self.publish(record)

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
        self.committed().add(UnitName(stage, key).unit_id())
        self.after("committed", stage)

    def publish(self, record: dict) -> None:
        """Rename the unit's staged files into place (again, after a kill: what is in place already is skipped)."""
        for kind, name in record["files"].items():
            path = self.part(record["stage"], record["key"], kind)
            try:
                with writing(path):
                    self._hidden(path).move(path)
            except FileNotFoundError:
                pass  # published already (by an earlier try, or by another shard's recovery)
            self.after(f"published {kind}", record["stage"])

    def _unstage(self, stage: Stage, key: str) -> None:
        """Delete the files a unit staged before its record could be written: they are no unit's, and take space."""
        for kind in KINDS[stage]:
            self._hidden(self.part(stage, key, kind)).unlink(missing_ok=True)

    # ----- after a kill, or damage -----------------------------------------------------------------------------
    def recover(self) -> None:
        """Roll forward units committed by a run that was killed before it published their files."""
        for kind, folder in self.folders.items():
            for legacy in folder.glob(".*.parquet"):  # staged by a version before STAGED (DuckDB reads these)
                if not legacy.with_name(legacy.name[1:]).exists():  # beside its published part it is a copy
                    legacy.move(legacy.with_name(f"{legacy.name}{STAGED}"))
            for hidden in folder.glob(f".*.parquet{STAGED}"):
                try:
                    part = PartName.parse(hidden.name, "requeue" if kind == "requeue" else None)
                except ValueError:
                    continue  # not a part file of any unit
                record = self.record(part.stage, part.key)
                if record is not None:
                    self.publish(record)

    def survey(self, keys: list[str], id_column: str) -> Survey:
        """Of these units, the committed ones that are damaged (`Survey.damaged`), the rows each of the others
        has waiting for pass 2 while its pass 2 is not committed (`Survey.second`), and the others' records tallied
        (`Survey.passes`): each record looked up once.

        A damaged unit has a file its record lists that is gone (deleted by hand), does not read as Parquet
        (truncated, emptied, overwritten) or holds another number of rows. Cheap, as every start runs it: one
        listing of each folder, whose sizes are compared with those the records keep (`sizes`, written at commit);
        a file whose size differs is damaged. A file not under its final name (its publish is under way, or it is
        gone) and any file of a record older than `sizes` are read as verify reads them (the id column), so what
        verify finds unreadable a rerun redoes. `verify` reads every file. The units are visited in their records'
        order (that of the shelves, shelf.py), and the folders' sizes are held for the survey only: the stamps the
        end check compares (`trusted`) are listed again then."""
        sizes = {kind: {name: size for name, size, _ in folder.listing()} for kind, folder in self.folders.items()}
        found = Survey()
        for key in sorted(keys):
            records, flaw = {}, ""
            for stage in Stage:
                try:
                    record = records[stage] = self.record(stage, key) if self.listed(stage, key) else None
                except DamagedRecord as e:
                    flaw = flaw or str(e)
                    continue
                for kind in record["files"] if record else ():
                    name = PartName(stage, key, kind).file_name()
                    size, seen = record.get("sizes", {}).get(kind), sizes[kind].get(name)
                    if size is not None and seen is not None:
                        flaw = flaw or ("" if seen == size else f"{record['files'][kind]} held {seen} bytes, not the "
                                                                f"{size} its commit record lists")
                    else:
                        flaw = flaw or self._flaw(record, kind, id_column)
            first = records.get(Stage.FIRST)
            if flaw:
                found.damaged[key] = flaw
                continue
            for record in filter(None, records.values()):
                add_record(found.passes, record)
            if first and "requeue" in first["files"] and not self.listed(Stage.SECOND, key):
                found.second[key] = first["rows"]["requeue"]
        return found

    def _flaw(self, record: dict, kind: Kind, id_column: str) -> str:
        name, rows = record["files"][kind], record["rows"][kind]
        try:
            found = self.read_ids(record["stage"], record["key"], kind, [id_column]).num_rows
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

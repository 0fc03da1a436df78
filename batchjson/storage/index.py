"""The index as a run keeps it: read before the run decides to run, folded into parts as records come, told what the
run's checks read, asked what the end check may trust, and written afresh after a passing check.

The index's files and their layout are index_file.py. A run reads them at its start (`RunIndex.read`) and plans from
their columns (survey.py); each record it reads or writes is news (`note`), folded into a new part every
`fold_every` of them (`fold`), so that a run killed midway leaves its records for the next one; each unit a check of
the run read is vouched for by its files' stamps (`vouch`). The end check trusts a unit only where the index's copy
of its record is the record file's bytes and its files are listed as a check saw them (`trusted`); a passing check of
the whole folder writes the index afresh (`write`), and nothing before.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Iterator

import orjson
from pyarrow import fs

from batchjson.storage.index_file import EARLIER, INDEX, Index, digest, part_name, part_names
from batchjson.storage.listings import records_listed
from batchjson.storage.location import Location, writing
from batchjson.storage.names import Kind, UnitName
from batchjson.storage.shelf import Shelf

Stamp = tuple[int, int]


class RunIndex:
    """The index of one output folder, as one run (or verify, which never reads it) keeps it."""

    def __init__(self, state: Location, units: Location, folders: dict[Kind, Location],
                 record_bytes: Callable[[str], bytes | None]):
        self.state, self.units, self.folders = state, units, folders
        self._bytes = record_bytes  # a record's bytes as the run read or wrote them, or as the index holds them
        self.files = Index()
        """The index's files as this run read them (`read`); verify never reads them, and reads everything."""
        self._seen = Shelf(2)  # part file path -> its stamp, as the folders were last listed (`_list_parts`)
        self.fold_every = 0
        """Fold the records read or written since the last part of the index into a new one every this many
        (`fold`); 0: never (verify, replicas). A run sets it."""
        self._fresh: list[str] = []  # records read or written since the last part of the index
        self._checks: list[tuple[str, Stamp]] = []  # stamps vouched for since the last part (`vouch`)
        self.news = False
        """Whether the folder holds what the index this run read does not (`write`)."""
        self._folding = threading.Lock()

    def read(self) -> None:
        """Read the index's files for this run: found now, read once the survey needs them (`Index.read`)."""
        self.files = Index.read(self.state)

    def forget(self) -> None:
        """The folder was cleared: nothing of the index answers, and whatever is written next is news."""
        self.files = Index()
        self._fresh.clear()
        self._checks.clear()
        self.news = True

    def note(self, name: str) -> None:
        """A record read from its file or written by this run: news, for the next part (`fold`) or index."""
        self.news = True
        if self.fold_every:
            with self._folding:
                self._fresh.append(name)

    def dropped(self, name: str) -> None:
        """The record `name` is gone (its unit is redone): its entry answers for nothing."""
        self.files.forget(name)
        self.news = True

    @property
    def written(self) -> str:
        """When the check that wrote the index this run read passed ("" without one)."""
        return self.files.written

    def fold(self, now: bool = False) -> None:
        """Write the records read or written since the last part of the index as a new part, once there are
        `fold_every` of them (or any, `now`): a run killed midway leaves its records folded into a few files, which
        its resume reads in place of every record (two requests each on object storage)."""
        with self._folding:
            if not self.fold_every or not (self._fresh or self._checks) or (len(self._fresh) < self.fold_every
                                                                            and not now):
                return
            fresh, checks, part = set(self._fresh), self._checks, self.state / part_name(self.files.next_part)
            self._fresh, self._checks = [], []
            self.files.next_part += 1
            if self.units.local:  # a look per record is a stat here; on object storage, one listing is cheaper
                listed = ((name, (info.size, info.mtime_ns)) for name in sorted(fresh)
                          if (info := (self.units / name).info()).type == fs.FileType.File)
            else:
                listed = ((name, (size, mtime)) for name, size, mtime in self.units.listing() if name in fresh)
            records = ((name, s, digest(data), data) for name, s in listed if (data := self._bytes(name)) is not None)
            with writing(part):
                Index.write(part, records, checks)

    def vouch(self, stamps: list[tuple[str, Stamp]]) -> None:
        """A unit's records and files, with these stamps (`Commits.stamps`, taken before they were read), hold its
        rows, as a check of the unit read them (verify.py's `UnitChecks`): this run's end check trusts them while
        they keep these stamps (`trusted`), and the next part of the index keeps them for the next run's (`fold`)."""
        with self._folding:
            self.files.vouch_files(stamps)
            if self.fold_every:
                self._checks.extend(stamps)

    def trusted(self, listed: list[tuple[str, int, int]], record_file: Callable[[str], bytes | None]) -> frozenset[str]:
        """Of the committed units (`listed`: their records as listed now), those whose records and files are all as
        a check read them: the last passing check of the folder (the index) or this run's check of the unit as it
        committed (`vouch`). `record_file`: a record's bytes as read from its file (None if it did not read as
        one): the index's copy vouches for a record only where it is those bytes (its digest), so an index rewritten
        whole, digests recomputed, vouches for no record it does not hold. Each file a record lists must be listed
        now with the stamp the check saw and the size the record keeps. What a file holds is not read: one rewritten
        at its size and time is trusted, and the end check's summary says so (`batchjson verify` reads it). Lists
        the folders now; `write` keeps these stamps."""
        self._list_parts()
        units, changed = set(), set()
        for name, size, mtime in listed:
            units.add(UnitName.parse(name).key)
            if not self._as_checked(name, (size, mtime), record_file(name)):
                changed.add(UnitName.parse(name).key)
        self.news = self.news or bool(changed)
        return frozenset(units - changed)

    def _as_checked(self, name: str, stamp: Stamp, data: bytes | None) -> bool:
        """Whether the record `name`, listed with `stamp` and holding `data`, and the files it lists are as a check
        read them (`trusted`)."""
        if data is None:
            return False
        found = self.files.record(name, stamp)
        if not (found is not None and found[0] == digest(data) or self.files.checked(name, stamp)):
            return False
        record = orjson.loads(data)
        sizes = record.get("sizes", {})
        for kind, part in record["files"].items():
            seen = self._seen.get(self._path(kind, part))
            if not self.files.checked(part, seen) or sizes.get(kind, seen[0]) != seen[0]:
                return False
        return True

    def _path(self, kind: Kind, name: str) -> str:
        """A part file's path on its store, as `_seen` keeps it, without a Location made for it."""
        return posixpath.join(self.folders[kind].path, name)

    def _list_parts(self) -> None:
        """List the part files of every folder into `_seen` (path -> stamp), one at a time."""
        self._seen.clear()
        self._seen.update((posixpath.join(folder.path, name), (size, mtime))
                          for folder in {f.path: f for f in self.folders.values()}.values()
                          for name, size, mtime in folder.listing())

    def write(self) -> None:
        """After an exactly-once check of the whole folder passed: its records, and its files as `trusted` listed
        them before the check read them, folded into the index for the next run; then the index's earlier files go
        (written first, so a kill between leaves both, which read as one). Not when the index this run read holds
        it all already (every record from it, every unit trusted: a rerun of a finished job writes nothing)."""
        if not (self.news or not self.files.written or self.files.replaced):
            return
        checked, stamps = Shelf(2), []

        def records() -> Iterator[tuple]:
            for name, size, mtime in records_listed(self.units):
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

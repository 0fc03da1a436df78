"""The output folder: its layout, resume, input fingerprints and the unit commit protocol.

Every path of a run, and its run state, live here; the part and record names are names.py's (`PartName`,
`UnitName`), the folder's locks are locks.py's. Nothing else in batchjson builds or parses these names. Over 250
lines: one class, `Storage`, whose methods share the folder's paths and its cache of commit records; the protocol's
steps read best next to each other. The layout of an output folder OUT (rejects in OUT/_rejects unless
output.rejects says otherwise):

    OUT/p1-<unit>.parquet, OUT/p2-<unit>.parquet          valid rows of pass 1 and pass 2
    REJECTS/rejects-p1-<unit>.parquet, rejects-p2-...     rejected rows with their reason
    OUT/_report.json (_report-IofN.json for a shard)      the run report
    OUT/_batchjson/spec.json                              the spec the folder belongs to
    OUT/_batchjson/inputs/<file>.json                     each input file's fingerprint
    OUT/_batchjson/units/p1-<unit>.json, p2-<unit>.json   commit records: a unit's files, rows and reasons
    OUT/_batchjson/requeue/<unit>.parquet                 pass-1 failures waiting for pass 2
    OUT/_batchjson/lock-of<N>, lock-<I>of<N>              locks (a local folder)
    OUT/_batchjson/lease-<I>of<N>-<owner>.json            leases (object storage)

The commit protocol of one unit of one pass: `begin` deletes every file of any earlier attempt, of every kind;
`stage` writes each file under a hidden name (".<name>.tmp") in its final folder; `commit` writes the commit
record atomically (the commit point); `publish` renames the hidden files into place. A kill before the record
leaves only hidden files, which the next attempt deletes; a kill after it is rolled forward at the next open. So a
unit's rows are either all in the output and rejects, once, or not there at all, whatever its outcome. No reader
reads a hidden file: pyarrow.dataset skips names starting with . or _, and DuckDB's read_parquet('OUT/*.parquet'),
which does not, reads only names ending in .parquet.

OUT may be a local folder or an object-storage prefix (s3://bucket/out, gs://...; see location.py). Object storage
has no rename: `publish` is a copy and a delete, so a kill between them leaves the file under both names, with the
same content; `recover` copies again and deletes the hidden one, as it renames locally. The commit point is still
the record, which is one PUT (all or nothing). Nothing is listed or read back under its final name before its
record exists, so a half-published unit is never taken for a stray or a finished one.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
import pyarrow as pa

from batchjson.errors import InputError, OutputError, ResumeConflict, StorageFull, is_full
from batchjson.storage.location import Location, Unreadable, glob_match
from batchjson.storage.locks import Lease, lock_folder, release
from batchjson.storage.names import STAGED, Kind, PartName, Stage, UnitName, staged

STATE = "_batchjson"  # leading underscore: Parquet dataset readers (pyarrow, DuckDB, Polars) skip it


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


@contextmanager
def writing(path: Location, undo: Callable[[], None] = lambda: None):
    """A full disk while writing `path` becomes StorageFull, naming it, after `undo` (the writer has removed what
    it began)."""
    try:
        yield
    except OSError as e:
        if not is_full(e):
            raise
        undo()
        raise StorageFull.at(path, e) from None


def hidden_below(inner: Location, outer: Location) -> bool | None:
    """None if `inner` is not inside `outer`; else whether a name on the way starts with _ or . (which dataset
    readers skip)."""
    parts = inner.parts_below(outer)
    return None if parts is None else any(p.startswith(("_", ".")) for p in parts)


class Storage:
    """The output folder of one job (one shard of it): layout, locks, run state and unit commits."""

    def __init__(self, output: str | Path | Location, rejects: str | Path | Location | None = None,
                 shard: tuple[int, int] = (0, 1)):
        self.output = Location.of(output)
        self.rejects = Location.of(rejects) if rejects else self.output / "_rejects"
        self.shard = shard
        self.state = self.output / STATE
        self.units = self.state / "units"
        self.inputs = self.state / "inputs"
        self.requeue_dir = self.state / "requeue"
        self._locks: list = []
        self._lease: Lease | None = None
        self._committed: set[str] | None = None
        self._read: dict[str, dict] = {}  # commit records read so far: a record never changes, only goes (drop)
        self.after: Callable[[str, str], None] = lambda step, stage: None
        """Called after each step of the commit protocol, with the pass; tests use it to kill the process there."""

    # ----- where things go -------------------------------------------------------------------------------------
    def check_paths(self, input_path: str | None = None) -> None:
        """Refuse layouts that would mix or lose rows, before anything is written."""
        out, rej = self.output, self.rejects
        out.check_bucket()
        rej.check_bucket()
        if out.is_file():
            raise OutputError(f"the output path {out} is a file. Point output.path (or --output) at a folder.")
        if rej.parts_below(out) == ():
            raise OutputError(f"output.rejects is the output folder {out}: rejected rows would be read as output. "
                              "Leave output.rejects out (rejects go to <output>/_rejects) or choose another folder.")
        if hidden_below(rej, out) is False:
            raise OutputError(f"output.rejects {rej} is inside the output folder under a name that dataset readers "
                              f"take for output rows. Name it with a leading underscore (e.g. {out / '_rejects'}).")
        if out.parts_below(rej) is not None:
            raise OutputError(f"the output folder {out} is inside output.rejects {rej}. Choose separate folders.")
        if input_path:
            # Compared as locations (normalized, a URI's ?options aside), never as the strings the user wrote.
            source = Location.of(input_path, InputError)
            pattern = any(c in source.path for c in "*?[")
            for name, folder in (("output folder", out), ("output.rejects folder", rej)):
                if pattern:  # a file this run would write there, matched against the glob as glob.glob would
                    probe = folder.normal().split("/") + ["p1-x.parquet"]
                    hit = folder.scheme == source.scheme and glob_match(probe, source.normal().split("/"))
                else:
                    hit = source.is_dir() and hidden_below(folder, source) is False
                if hit:
                    raise OutputError(f"the {name} {folder} is inside the input {input_path}: its part files would be "
                                      "read back as input on the next run. Choose a folder outside the input.")

    def part(self, stage: Stage, key: str, kind: Kind) -> Location:
        folder = {"output": self.output, "rejects": self.rejects, "requeue": self.requeue_dir}[kind]
        return folder / PartName(stage, key, kind).file_name()

    def report_path(self) -> Location:
        i, n = self.shard
        return self.output / ("_report.json" if n == 1 else f"_report-{i}of{n}.json")

    def _record(self, stage: Stage, key: str) -> Location:
        return self.units / UnitName(stage, key).file_name()

    @staticmethod
    def _hidden(path: Location) -> Location:
        return path.with_name(staged(path.name))

    # ----- claiming the folder ---------------------------------------------------------------------------------
    def open(self, spec_hash: str, fingerprint: dict, if_exists: str = "resume", fresh: bool = False) -> bool:
        """Claim the folder for this spec; returns True when it resumes an earlier run."""
        i, n = self.shard
        if n > 1 and (fresh or if_exists != "resume"):
            raise OutputError(f'--fresh and output.if_exists = "{if_exists}" cannot be used with --shard: shards '
                              f"share {self.output}. Clear the folder once before starting the shards, and run them "
                              'with output.if_exists = "resume".')
        spec_file = self.state / "spec.json"
        if not spec_file.exists() and any(not name.startswith(("_", ".")) for name in self.output.names()):
            raise OutputError(f"{self.output} is not empty and holds no batchjson run. Choose an empty or new folder.")
        for d in (self.output, self.state, self.units, self.inputs, self.requeue_dir, self.rejects):
            try:
                d.mkdir()
            except OSError as e:
                if is_full(e):
                    raise StorageFull.at(d, e) from None
                raise OutputError(f"cannot create {d}: {e.strerror}. Check the path and permissions.") from None
        self.claim()
        existing = spec_file.exists()
        if existing and (fresh or if_exists == "overwrite"):
            self._clear()
            existing = False
        elif existing and if_exists == "fail":
            raise OutputError(f"{self.output} already holds a run (output.if_exists = \"fail\"). Choose another "
                              "--output, or pass --fresh to start over.")
        elif existing:
            old = spec_file.read_json()
            if old["hash"] != spec_hash and self.committed():
                changes = _diff(old["spec"], json.loads(json.dumps(fingerprint, default=str)))
                raise ResumeConflict(f"{self.output} holds a run of a different spec (changed: {'; '.join(changes[:5])}). "
                                     "Rerun with --fresh to discard it and start over, or choose another --output.")
        if not existing or spec_file.read_json()["hash"] != spec_hash:
            # Until a unit commits, the folder belongs to no spec: a corrected rerun after a failed start is welcome.
            with writing(spec_file):
                spec_file.write_json({"hash": spec_hash, "spec": fingerprint})
        self.recover()
        return existing and bool(self.committed())

    def claim(self) -> None:
        """Lock the folder: shards of one job (same N) run together, anything else waits its turn. A local folder
        takes flock locks, object storage a lease (locks.py says how each is safe)."""
        if self._locks or self._lease:
            return
        busy = (f"another batchjson run is writing to {self.output} right now. Wait for it to finish, or choose "
                "another --output.")
        if not self.state.local:
            self.state.mkdir()
            lease = Lease(self.state, self.shard)
            lease.acquire(busy)
            self._lease = lease
            return
        self._locks = lock_folder(Path(self.state.path), self.shard, busy)

    def close(self) -> None:
        release(self._locks)
        if self._lease:
            self._lease.release()
            self._lease = None

    def _clear(self) -> None:
        for folder in (self.output, self.rejects):
            for p in folder.glob("*.parquet") + folder.glob(f".*.parquet{STAGED}"):
                p.unlink(missing_ok=True)
        for name in self.state.names():
            if not name.startswith(("lock", "lease")):
                p = self.state / name
                p.rmtree() if p.is_dir() else p.unlink(missing_ok=True)
        for d in (self.units, self.inputs, self.requeue_dir):
            d.mkdir()
        self._committed = None
        self._read.clear()

    def swap_in(self, new: Location) -> None:
        """Make the finished run folder `new` (rejects in its _rejects) this output folder, in place of whatever
        this folder holds; `new` is gone afterwards. The folder is claimed meanwhile, so no run writes to it.

        Locally, two renames: this folder to a hidden sibling, then `new` into place. Between them the folder is
        absent; readers never see old and new rows together. Object storage has no renames: this folder's objects
        are deleted, then `new`'s are copied in, and deleted. A reader meanwhile sees part of the old folder or
        part of the new one, never rows of both, never a row twice; the report goes first and comes back last, so
        it is absent for the whole swap. Part files go before the run state and come after it, so a kill
        midway leaves commit records whose files are missing, never a file no record lists: a run on the folder
        redoes those units."""
        self.claim()
        try:
            if self.output.local:
                old = new.with_name(f"{new.name}.old")
                if old.exists():  # a killed swap's
                    old.rmtree()
                self.output.move(old)  # claim() made sure it exists
                new.move(self.output)
                old.rmtree()
                return
            report, state = self.report_path().name, f"{STATE}/"
            for below in sorted(self.output.tree(), key=lambda b: (b != report, b.startswith(state))):
                if self.output / below != self._lease.file:
                    (self.output / below).unlink(missing_ok=True)
            copied = [b for b in new.tree() if not b.startswith(f"{state}lease-")]
            for below in sorted(copied, key=lambda b: (b == report, not b.startswith(state))):
                (new / below).copy(self.output / below)
            new.rmtree()
        finally:
            self.close()

    # ----- input fingerprints ----------------------------------------------------------------------------------
    def check_inputs(self, fingerprints: dict[str, dict], write: bool = True) -> list[str]:
        """Compare the input with the one committed units came from; returns the tags of new files.

        New files are added work. A file that changed or disappeared is refused when units from it are committed
        (their rows could no longer be matched to the input); otherwise its fingerprint is simply replaced."""
        used = Counter(r["file"] for r in self._records(Stage.FIRST))
        known = {p.name[:-5]: p.read_json() for p in self.inputs.glob("*.json")}
        for tag, old in known.items():
            new = fingerprints.get(tag)
            if new == old or not used[tag]:
                continue
            if new is None:
                raise OutputError(f"input file {old['path']} was removed, but {used[tag]} unit(s) of it are committed in "
                                  f"{self.output}. Put it back, or start over with --fresh (or another --output).")
            what = [k for k in ("size", "rows", "footer", "ids") if old.get(k) != new.get(k)]
            raise OutputError(f"input file {new['path']} changed since {self.output} began ({', '.join(what)} differ), and "
                              f"{used[tag]} unit(s) of it are committed: their rows would be lost or written twice. "
                              "Restore the file, or start over with --fresh (or another --output); to add rows, add "
                              "a new file instead of rewriting one.")
        if not write:
            return [t for t in fingerprints if t not in known]
        for tag, new in fingerprints.items():
            if known.get(tag) != new:
                with writing(self.inputs / f"{tag}.json"):
                    (self.inputs / f"{tag}.json").write_json(new)
        for tag in set(known) - set(fingerprints):
            (self.inputs / f"{tag}.json").unlink(missing_ok=True)
        return [t for t in fingerprints if t not in known]

    # ----- units ------------------------------------------------------------------------------------------------
    def committed(self) -> set[str]:
        """Names ("p1-<unit>") of the committed units of every shard, listed once and kept up to date."""
        if self._committed is None:
            self._committed = {UnitName.parse(p.name).unit_id() for p in self.units.glob("p[12]-*.json")}
        return self._committed

    def listed(self, stage: Stage, key: str) -> bool:
        """Whether the unit is among the committed ones as last listed (and committed since): no look at the folder."""
        return UnitName(stage, key).unit_id() in self.committed()

    def done(self, stage: Stage, key: str) -> bool:
        return self.listed(stage, key) or self._record(stage, key).exists()

    def _load(self, path: Location) -> dict:
        if path.name not in self._read:
            self._read[path.name] = path.read_json()
        return self._read[path.name]

    def record(self, stage: Stage, key: str) -> dict | None:
        try:
            return self._load(self._record(stage, key))
        except FileNotFoundError:
            return None

    def _records(self, stage: Stage | None = None) -> list[dict]:
        pattern = f"{stage}-*.json" if stage else "p[12]-*.json"
        return [self._load(p) for p in sorted(self.units.glob(pattern))]

    def records(self) -> list[dict]:
        return self._records()

    def begin(self, stage: Stage, key: str) -> None:
        """Start (or restart) a unit: every file an earlier attempt may have left, of every kind, goes."""
        for kind in ("output", "rejects", "requeue"):
            if kind == "requeue" and stage == Stage.SECOND:
                continue
            path = self.part(stage, key, kind)
            self._hidden(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
        self.after("begin", stage)

    def commit(self, stage: Stage, key: str, tables: dict[Kind, pa.Table], meta: dict) -> None:
        """Commit one unit of one pass: stage its files, write its record, publish the files."""
        self.begin(stage, key)
        files, rows, sizes = {}, {}, {}
        for kind, table in tables.items():
            if table is None or not table.num_rows:
                continue
            path = self.part(stage, key, kind)
            self._write(table, self._hidden(path), undo=lambda: self._unstage(stage, key))
            files[kind], rows[kind], sizes[kind] = path.name, table.num_rows, self._hidden(path).info().size
            self.after(f"staged {kind}", stage)
        record = {"stage": stage, "key": key, "files": files, "rows": rows, "sizes": sizes} | meta
        if self._lease:
            self._lease.check()
        with writing(self._record(stage, key), undo=lambda: self._unstage(stage, key)):
            self._record(stage, key).write_json(record)
        self._read[self._record(stage, key).name] = record
        self.committed().add(UnitName(stage, key).unit_id())
        self.after("committed", stage)
        self._publish(record)

    def _publish(self, record: dict) -> None:
        for kind, name in record["files"].items():
            path = self.part(record["stage"], record["key"], kind)
            try:
                with writing(path):
                    self._hidden(path).move(path)
            except FileNotFoundError:
                pass  # published already (by an earlier try, or by another shard's recovery)
            self.after(f"published {kind}", record["stage"])

    def recover(self) -> None:
        """Roll forward units committed by a run that was killed before it published their files."""
        for folder in {self.output, self.rejects, self.requeue_dir}:
            for legacy in folder.glob(".*.parquet"):  # staged by a version before STAGED (DuckDB reads these)
                if not legacy.with_name(legacy.name[1:]).exists():  # beside its published part it is a copy
                    legacy.move(legacy.with_name(f"{legacy.name}{STAGED}"))
            for hidden in folder.glob(f".*.parquet{STAGED}"):
                try:
                    part = PartName.parse(hidden.name, "requeue" if folder == self.requeue_dir else None)
                except ValueError:
                    continue  # not a part file of any unit
                record = self.record(part.stage, part.key)
                if record is not None:
                    self._publish(record)

    def damaged(self, keys: list[str], id_column: str) -> dict[str, str]:
        """Of these units, the committed ones with a file their record lists that is gone (deleted by hand), does not
        read as Parquet (truncated, emptied, overwritten) or holds another number of rows; unit -> what is wrong.

        Cheap, as every start runs it: one listing of each folder, whose sizes are compared with those the records
        keep (`sizes`, written at commit); a file whose size differs is damaged. A file not under its final name
        (its publish is under way, or it is gone) and any file of a record older than `sizes` are read as verify
        reads them (the id column), so what verify finds unreadable a rerun redoes. `verify` reads every file."""
        listed: dict[str, int] = {}
        for folder in {self.output, self.rejects, self.requeue_dir}:
            listed |= {i.path: i.size for i in folder.files()}
        out = {}
        for key in keys:
            for stage in Stage:
                record = self.record(stage, key) if self.listed(stage, key) else None
                for kind in record["files"] if record else ():
                    size, found = record.get("sizes", {}).get(kind), listed.get(self.part(stage, key, kind).path)
                    if size is not None and found is not None:
                        flaw = "" if found == size else (f"{record['files'][kind]} held {found} bytes, not the {size} "
                                                         "its commit record lists")
                    else:
                        flaw = self._flaw(record, kind, id_column)
                    if flaw:
                        out.setdefault(key, flaw)
        return out

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
            self._record(stage, key).unlink(missing_ok=True)
            self._read.pop(self._record(stage, key).name, None)
            self.committed().discard(UnitName(stage, key).unit_id())
        for stage in reversed(Stage):
            self.begin(stage, key)

    def requeued(self, key: str) -> bool:
        record = self.record(Stage.FIRST, key)
        return bool(record and "requeue" in record["files"])

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

    def stray(self) -> list[Location]:
        """Files that readers of the output or rejects folder read (Location.dataset_files: in sub-folders too,
        whatever their name) but no commit record lists. The folders are listed before the records are read: a
        file is published only after its record is written, so none is taken for stray."""
        found = set(self.output.dataset_files()) | set(self.rejects.dataset_files())
        listed = {(self.part(r["stage"], r["key"], k)) for r in self._records() for k in r["files"]}
        return sorted(found - listed)

    def _unstage(self, stage: Stage, key: str) -> None:
        """Delete the files a unit staged before its record could be written: they are no unit's, and take space."""
        for kind in ("output", "rejects") if stage == Stage.SECOND else ("output", "rejects", "requeue"):
            self._hidden(self.part(stage, key, kind)).unlink(missing_ok=True)

    def _write(self, table: pa.Table, path: Location, undo: Callable[[], None] = lambda: None) -> None:
        try:
            path.write_parquet(table)
        except OSError as e:
            path.unlink(missing_ok=True)
            if is_full(e):
                undo()
                raise StorageFull.at(path, e) from None
            raise OutputError(f"cannot write {path}: {e.strerror or e}. Free space or fix permissions, then run "
                              "again: finished units are kept and the run resumes.") from None

    def write_report(self, data: dict) -> None:
        with writing(self.report_path()):
            self.report_path().write_json(data)

"""Parquet input -> units of work (record batches of one row group of one file), streamed with pyarrow.

The input may be local or on object storage (see storage/location.py). Units are planned from the files' footers alone (no row is read to know what work there is), and keyed by the
file's path below the input root, its row group and the batch's position: a key does not depend on which other
files exist, and does not grow with the file's name.

Over 250 lines because the checks a user's input needs before any row is decoded (footers, column types across
files, null and repeated ids, fingerprints) read the same footers as the plan.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import posixpath
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchjson.errors import InputError
from batchjson.ids import IdsDigest, RepeatedIds, generated, id_strings
from batchjson.spec import InputSpec
from batchjson.storage.location import Location, Unreadable, glob_match, reading, transient


@dataclass(slots=True, frozen=True)
class UnitRef:
    """One unit of work, known from the footer: rows [start, start + rows) of one row group of one file."""

    key: str
    file: str  # the file's path
    tag: str  # the file's identity below the input root (a hash of the relative path)
    row_group: int
    start: int  # first row of the unit within the row group
    rows: int
    offset: int  # first row of the unit within the file


@dataclass(slots=True)
class Unit:
    """A unit with its rows read."""

    ref: UnitRef
    batch: pa.Table

    @property
    def key(self) -> str:
        return self.ref.key


class _Refs(dict):
    """`ParquetSource.refs`: a dict whose missing keys are looked up in the footers."""

    def __init__(self, source: ParquetSource, shard: tuple[int, int]):
        super().__init__()
        self.source, self.shard = source, shard

    def __missing__(self, key: str) -> UnitRef:
        ref = self[key] = self.source.ref(key, self.shard)
        return ref


def _is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def input_root(path: str) -> Location:
    """The folder file identities are taken from: the folder itself, a glob's fixed prefix, a file's folder."""
    where = Location.of(path, InputError)
    if _is_glob(where.path):
        fixed = []
        for part in where.path.split("/"):
            if _is_glob(part):
                break
            fixed.append(part)
        root = "/".join(fixed) or "/"
        return where._at(root, root if where.local else f"{where.scheme}://{root}")
    return where if where.is_dir() else where.parent


def list_files(path: str) -> list[Location]:
    """The Parquet files a file, folder or glob names, in a stable order (names starting with _ or . skipped)."""
    where = Location.of(path, InputError)
    if where.local:  # the local file system, as it always was: pathlib and glob
        p = Path(path)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*.parquet")
                           if not any(s.startswith(("_", ".")) for s in f.parts[len(p.parts):]))
        elif _is_glob(path):
            found = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
        else:
            found = [p] if p.is_file() else []
        files = [Location.of(f, InputError) for f in found]
    elif _is_glob(where.path):
        root, pattern = input_root(path), where.path.split("/")
        files = [root / i.path[len(root.path) + 1:] for i in root.files(recursive=True)
                 if glob_match(i.path.split("/"), pattern)]
    elif where.is_dir():
        files = [where / i.path[len(where.path) + 1:] for i in where.files(recursive=True) if i.path.endswith(".parquet")
                 and not any(s.startswith(("_", ".")) for s in i.path[len(where.path) + 1:].split("/"))]
    else:
        files = [where] if where.is_file() else []
    if not files:
        raise InputError(f"input.path: no Parquet file at {path}. Check the path (relative paths start at the spec's folder).")
    return sorted(files)


def file_tag(root: Location, path: Location) -> str:
    """A file's identity: the path below the input root, hashed (nodes that mount the input elsewhere agree)."""
    return hashlib.sha1(_below(root, path).encode()).hexdigest()[:12]


def _stem(path: Location) -> str:
    """A file's name as the keys of its units begin (no "-": a key splits at its last three)."""
    return re.sub(r"[^A-Za-z0-9_.]+", "_", posixpath.splitext(path.name)[0])[:32] or "file"


def _below(root: Location, path: Location) -> str:
    return posixpath.relpath(path.path, root.path)


class ParquetSource:
    """Reads the input files lazily, one unit at a time; never holds the dataset in memory."""

    def __init__(self, spec: InputSpec, prompt_columns: tuple[str, ...]):
        self.spec = spec
        self.files = list_files(spec.path)
        self.root = input_root(spec.path)
        self.generated = spec.generate_ids
        read = () if self.generated else (spec.id_column,)  # generated ids are made, not read
        self.columns = list(dict.fromkeys((*read, *prompt_columns, *spec.passthrough)))
        self._footers: dict[Location, pq.ParquetFile] = {}
        self._group: tuple = (None, None)  # the last row group read: (file, index), table
        self._ids: tuple = (None, None)  # the last row group's ids verify read: (file, index), ids
        self._named = {str(f): f for f in self.files}  # UnitRef.file -> the file
        self._plans: dict[tuple[int, int], list[UnitRef]] = {}  # shard -> its units (`plan`)
        self._groups: dict[str, tuple] | None = None  # file tag -> (file, stem, its first row group's place, offsets)
        # UnitRef.file -> its Location.version() when this run first looked (the driver's scan; a replica is handed them)
        self.stamps: dict[str, tuple] = {}

    def _open(self, path: Location) -> pq.ParquetFile:
        if path in self._footers:
            return self._footers[path]
        try:
            pf = reading(path, lambda: pq.ParquetFile(path.open_input()))
        except (OSError, pa.ArrowException) as e:
            raise transient(path, e) or InputError(f"{path}: not a readable Parquet file ({e}). Remove or repair it and run again; "
                             "finished work is kept.") from None
        missing = [c for c in self.columns if c not in pf.schema_arrow.names]
        if missing:
            hint = (" If the input has no id column, set input.generate_ids = true (ids made from each row's place)."
                    if missing[0] == self.spec.id_column else "")
            raise InputError(f"{path}: column {missing[0]!r} is missing (the spec needs {self.columns}; the file has "
                             f"{pf.schema_arrow.names}). Fix input.id_column, input.passthrough or the prompt "
                             f"template.{hint}")
        if self.generated and self.spec.id_column in pf.schema_arrow.names:
            raise InputError(f"{path} has a column {self.spec.id_column!r}, and input.generate_ids = true would write "
                             "generated ids under that name. Use that column as the ids (drop input.generate_ids), or "
                             "name the generated ids' column otherwise with input.id_column.")
        self._footers[path] = pf
        return pf

    def check(self) -> int:
        """Open every file's footer, check the columns and that the pass-through columns have one type in every
        file; returns the number of input rows."""
        first: dict[str, tuple[pa.DataType, Location]] = {}
        rows = 0
        for f in self.files:
            pf = self._open(f)
            rows += pf.metadata.num_rows
            for name in self.spec.passthrough:
                kind = pf.schema_arrow.field(name).type
                if kind == pa.null():  # an empty or all-null column fits any type
                    continue
                seen = first.setdefault(name, (kind, f))
                if seen[0] != kind:
                    raise InputError(f"input.passthrough column {name!r} is {seen[0]} in {seen[1]} but {kind} in {f}. "
                                     "Write it with one type in every file, or leave it out of input.passthrough.")
        return rows

    def passthrough_schema(self) -> pa.Schema:
        """The pass-through columns' types: the first file's that is not all null (check() made sure they agree)."""
        fields = []
        for name in self.spec.passthrough:
            types = (self._open(f).schema_arrow.field(name) for f in self.files)
            first = self._open(self.files[0]).schema_arrow.field(name)
            fields.append(next((t for t in types if t.type != pa.null()), first))
        return pa.schema(fields)

    def plan(self, shard: tuple[int, int] = (0, 1)) -> list[UnitRef]:
        """Every unit of the input (of one shard: whole row groups dealt round-robin), from the footers alone. Made
        once per shard and kept (the driver asks again for the scan's places: at 100 million rows 0.3 s a plan)."""
        if shard not in self._plans:
            self._plans[shard] = self._plan(shard)
        return self._plans[shard]

    def ref(self, key: str, shard: tuple[int, int] = (0, 1)) -> UnitRef:
        """The unit of `plan(shard)` named `key` (KeyError if it has none), from the footers alone: a replica, handed
        units by key, makes only those (planning every unit took 0.2 s of its start at 100 million rows)."""
        size = self.spec.batch_size
        try:
            head, rg, b = key.rsplit("-", 2)
            tag = head.rsplit("-", 1)[1]
            path, stem, first, offsets = self._row_groups()[tag]
            rg, b = int(rg), int(b)
        except (ValueError, IndexError, KeyError):
            raise KeyError(key) from None
        start, rows = b * size, offsets[rg + 1] - offsets[rg] if 0 <= rg < len(offsets) - 1 else 0
        if key != f"{stem}-{tag}-{rg:05d}-{b:05d}" or not 0 <= start < rows or (first + rg) % shard[1] != shard[0]:
            raise KeyError(key)
        return UnitRef(key, str(path), tag, rg, start, min(size, rows - start), offsets[rg] + start)

    def refs(self, shard: tuple[int, int] = (0, 1)) -> dict[str, UnitRef]:
        """The shard's units by key, each made when first looked up (`ref`): what a replica is handed."""
        return _Refs(self, shard)

    def _row_groups(self) -> dict[str, tuple[Location, str, int, list[int]]]:
        """File tag -> (the file, its stem in unit keys, its first row group's place among every file's, the row
        groups' first rows and the file's row count), from the footers, made once."""
        if self._groups is None:
            self._groups, n = {}, 0
            for path in self.files:
                md = self._open(path).metadata
                offsets = [0]
                for rg in range(md.num_row_groups):
                    offsets.append(offsets[-1] + md.row_group(rg).num_rows)
                self._groups[file_tag(self.root, path)] = (path, _stem(path), n, offsets)
                n += md.num_row_groups
        return self._groups

    def _plan(self, shard: tuple[int, int]) -> list[UnitRef]:
        index, count = shard
        size = self.spec.batch_size
        out, n = [], 0
        for path in self.files:
            md = self._open(path).metadata
            tag = file_tag(self.root, path)
            stem = _stem(path)
            offset = 0
            for rg in range(md.num_row_groups):
                rows = md.row_group(rg).num_rows
                n += 1
                if (n - 1) % count == index:
                    for b, start in enumerate(range(0, rows, size)):
                        out.append(UnitRef(f"{stem}-{tag}-{rg:05d}-{b:05d}", str(path), tag, rg, start,
                                           min(size, rows - start), offset + start))
                offset += rows
        return out

    def read(self, refs: Iterable[UnitRef]) -> Iterator[Unit]:
        """The rows of each unit, in order; a row group is read once for all its units that follow each other."""
        return (self.unit(ref) for ref in refs)

    def unit(self, ref: UnitRef) -> Unit:
        """One unit's rows. The last row group read is kept, so the units of one row group asked for one after
        another cost one read."""
        if self._group[0] != (ref.file, ref.row_group):
            path = self._named[ref.file]
            if ref.file not in self.stamps:
                self.stamps[ref.file] = path.version()
            try:
                table = reading(path, lambda: self._open(path).read_row_group(ref.row_group, columns=self.columns))
            except (OSError, pa.ArrowException) as e:
                raise transient(path, e) or InputError(f"{path}: row group {ref.row_group} cannot be read ({e}). Repair or remove the "
                                 "file and run again; finished work is kept.") from None
            if self.generated:
                ids = generated(_below(self.root, path), ref.row_group, 0, table.num_rows)
                table = table.append_column(self.spec.id_column, ids)
            self._group = ((ref.file, ref.row_group), table)
        return Unit(ref, self._group[1].slice(ref.start, ref.rows))

    def check_unchanged(self, ref: UnitRef) -> None:
        """Refuse to commit a unit whose file changed since this run first looked at it (`Location.version`: its
        size, and its modification time or, on object storage, its ETag): its rows may be of the old file and the new
        one mixed. One stat, or one HEAD on object storage, per commit."""
        path = self._named[ref.file]
        try:
            now = path.version()
        except FileNotFoundError:
            now = None
        if now != self.stamps.setdefault(ref.file, now):
            what = "was removed" if now is None else "changed (its size or its modification time or ETag differ)"
            raise InputError(f"input file {path} {what} while this run was reading it, so unit {ref.key} was not "
                             "committed: its rows could be of the old and the new file mixed. The units committed "
                             "before are of the file as it was: put it back and run the same command again to "
                             "resume, or start over with --fresh (or another --output). To add rows, add a new "
                             "file instead of rewriting one.")

    def scan(self, kept: dict | None = None) -> InputScan:
        """Each file's fingerprint, and where each repeated id occurs; a null id or one that is not text is an input
        error (a row without a key cannot be tracked).

        Reads the id column one row group at a time, and finds repeated ids in memory that does not grow with the
        input (ids.RepeatedIds). `kept`: the scan an earlier run kept in the run state (`InputScan.state`); when every
        file is as it was then (size, footer, and modification time or ETag), it is taken as it is and no id is
        read, so a resume reads the footers and then only the units it has left. Generated ids need no scan."""
        fingerprints = {file_tag(self.root, path): self._fingerprint(path) for path in self.files}
        if self.generated:
            return InputScan({tag: fp | {"ids": "generated"} for tag, fp in fingerprints.items()}, {})
        if kept and kept.get("id_column") == self.spec.id_column and set(kept["fingerprints"]) == set(fingerprints) \
                and all({k: v for k, v in kept["fingerprints"][t].items() if k != "ids"} == fp
                        for t, fp in fingerprints.items()):
            return InputScan(kept["fingerprints"], self._places((i, t, r) for i, t, r in kept["repeated"]))
        tags = list(fingerprints)
        with RepeatedIds(sum(self._open(f).metadata.num_rows for f in self.files)) as finder:
            for n, path in enumerate(self.files):
                digest, first = IdsDigest(), 0
                for rg in range(self._open(path).metadata.num_row_groups):
                    ids = self._group_ids(path, rg, first)
                    digest.update(ids)
                    finder.add(ids, n, first)
                    first += len(ids)
                fingerprints[tags[n]]["ids"] = digest.hexdigest()
            repeated = [(row_id, tags[n], row) for row_id, n, row in finder.repeated()]
        scan = InputScan(fingerprints, self._places(repeated), held=finder.largest)
        scan.kept = {"id_column": self.spec.id_column, "fingerprints": fingerprints, "repeated": repeated}
        return scan

    def _places(self, repeated: Iterable[tuple[str, str, int]]) -> dict[str, list[tuple[str, int]]]:
        """(id, file tag, row in the file) of each occurrence -> id: its (unit key, row in the unit), in input order."""
        repeated = list(repeated)
        if not repeated:
            return {}
        units: dict[str, list[UnitRef]] = {}
        for ref in self.plan():
            units.setdefault(ref.tag, []).append(ref)
        starts = {tag: [r.offset for r in refs] for tag, refs in units.items()}  # a file's units follow each other
        where: dict[str, list[tuple[str, int]]] = {}
        for row_id, tag, row in repeated:
            ref = units[tag][bisect.bisect_right(starts[tag], row) - 1]
            where.setdefault(row_id, []).append((ref.key, row - ref.offset))
        return where

    def ids(self, ref: UnitRef) -> pa.Array:
        """A unit's ids, as text (see ids.id_strings), reading only its row group's id column (the last row group's
        are kept for the next unit)."""
        if self._ids[0] != (ref.file, ref.row_group):
            self._ids = ((ref.file, ref.row_group), self._group_ids(self._named[ref.file], ref.row_group,
                                                                     ref.offset - ref.start))
        return self._ids[1].slice(ref.start, ref.rows)

    def _group_ids(self, path: Location, row_group: int, first: int) -> pa.Array:
        """One row group's ids (`first`: the file's row it starts at). A null id is an input error."""
        if self.generated:
            rows = self._open(path).metadata.row_group(row_group).num_rows
            return generated(_below(self.root, path), row_group, 0, rows)
        try:
            column = reading(path, lambda: self._open(path).read_row_group(row_group, [self.spec.id_column])).column(0)
        except (OSError, pa.ArrowException) as e:
            raise transient(path, e) or InputError(f"{path}: the id column cannot be read ({e}). Repair or remove "
                                                   "the file.") from None
        if column.null_count:
            row = first + pc.index(pc.is_null(column), True).as_py()
            raise InputError(f"{path}: row {row} has a null {self.spec.id_column!r}; every row needs an id. "
                             "Fill or drop such rows, or choose another input.id_column.")
        # One chunk as read, not a copy of it: 17 MB of a million ids (a row group's, read once for its units).
        ids = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        return id_strings(ids, f"{path}: {self.spec.id_column}")

    def drop_ids(self) -> None:
        """Let go of the last row group's ids kept for the next unit (`ids`): ~25 MB at a million rows."""
        self._ids = (None, None)

    def _fingerprint(self, path: Location) -> dict:
        """What identifies a file's content: size, rows, its footer's bytes, its ids in order (scan adds them) and,
        to tell a file untouched since (a resume then reads none of its ids), its modification time or ETag. A file
        rewritten with the same rows in another order has another fingerprint."""
        size, stamp = self.stamps.setdefault(str(path), path.version())
        footer = path.read_footer(size)
        return {"path": _below(self.root, path), "size": size, "rows": self._open(path).metadata.num_rows,
                "footer": hashlib.sha256(footer).hexdigest()[:16], "stamp": str(stamp)}


@dataclass(slots=True)
class InputScan:
    """What the id columns say about the input: each file's fingerprint (by file tag), and the (unit, row)
    positions of every id that occurs more than once, in input order."""

    fingerprints: dict[str, dict]
    repeated: dict[str, list[tuple[str, int]]]
    held: int = 0
    """The most ids the scan held at once (ids.RepeatedIds.largest); 0 when it read none."""
    kept: dict | None = None
    """What a later run may take instead of scanning again (`ParquetSource.scan`'s `kept`); None when this scan was
    itself taken from the run state, or needs none (generated ids)."""

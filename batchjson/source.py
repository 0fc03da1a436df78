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
from batchjson.spec import InputSpec
from batchjson.storage.location import Location, Unreadable, glob_match, reading, transient


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


def _below(root: Location, path: Location) -> str:
    return posixpath.relpath(path.path, root.path)


class ParquetSource:
    """Reads the input files lazily, one unit at a time; never holds the dataset in memory."""

    def __init__(self, spec: InputSpec, prompt_columns: tuple[str, ...]):
        self.spec = spec
        self.files = list_files(spec.path)
        self.root = input_root(spec.path)
        self.columns = list(dict.fromkeys((spec.id_column, *prompt_columns, *spec.passthrough)))
        self._footers: dict[Location, pq.ParquetFile] = {}
        self._group: tuple = (None, None)  # the last row group read: (file, index), table
        self._named = {str(f): f for f in self.files}  # UnitRef.file -> the file
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
            raise InputError(f"{path}: column {missing[0]!r} is missing (the spec needs {self.columns}; the file has "
                             f"{pf.schema_arrow.names}). Fix input.id_column, input.passthrough or the prompt template.")
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
        """Every unit of the input (of one shard: whole row groups dealt round-robin), from the footers alone."""
        index, count = shard
        size = self.spec.batch_size
        out, n = [], 0
        for path in self.files:
            md = self._open(path).metadata
            tag = file_tag(self.root, path)
            stem = re.sub(r"[^A-Za-z0-9_.]+", "_", posixpath.splitext(path.name)[0])[:32] or "file"
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

    def scan(self) -> "InputScan":
        """Read only the id column of every file: fingerprints, and where each repeated id occurs.

        A null id is an input error (a row without a key cannot be tracked). Ids stay in Arrow memory; only
        repeated ids become Python objects."""
        fingerprints, columns = {}, []
        for path in self.files:
            column = self.id_column(path)
            digest = hashlib.sha256()
            for chunk in column.chunks:
                digest.update("\x00".join(chunk.to_pylist()).encode() + b"\x01")
            fingerprints[file_tag(self.root, path)] = self._fingerprint(path, digest.hexdigest()[:16])
            columns.append(column)
        counts = pc.value_counts(pa.chunked_array([c for col in columns for c in col.chunks], pa.string()))
        repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
        where: dict[str, list[tuple[str, int]]] = {}
        if len(repeated):
            units = {}
            for ref in self.plan():
                units.setdefault(ref.file, []).append(ref)
            for path, column in zip(self.files, columns):
                hits = pc.indices_nonzero(pc.is_in(column, value_set=repeated))
                refs = units[str(path)]
                starts = [r.offset for r in refs]  # units follow each other in the file: find one by bisection
                for row, row_id in zip(hits.to_pylist(), column.take(hits).to_pylist()):
                    ref = refs[bisect.bisect_right(starts, row) - 1]
                    where.setdefault(row_id, []).append((ref.key, row - ref.offset))
        return InputScan(fingerprints, where)

    def id_column(self, path: str | Location) -> pa.ChunkedArray:
        """A file's row ids (see row_ids), one chunk per row group. A null id is an input error."""
        if not isinstance(path, Location):
            path = self._named.get(str(path)) or Location.of(path, InputError)
        try:
            column = path.read_parquet([self.spec.id_column]).column(0)
        except (OSError, pa.ArrowException, Unreadable) as e:
            raise transient(path, e) or InputError(f"{path}: the id column cannot be read ({e}). Repair or remove the file.") from None
        if column.null_count:
            row = pc.index(pc.is_null(column), True).as_py()
            raise InputError(f"{path}: row {row} has a null {self.spec.id_column!r}; every row needs an id. "
                             "Fill or drop such rows, or choose another input.id_column.")
        return id_strings(column, f"{path}: {self.spec.id_column}")

    def _fingerprint(self, path: Location, ids_digest: str) -> dict:
        """What identifies a file's content: size, rows, its footer's bytes and its ids in order. A file rewritten
        with the same rows in another order has another fingerprint."""
        stamp = self.stamps.setdefault(str(path), path.version())
        size = stamp[0]
        footer = path.read_footer(size)
        return {"path": _below(self.root, path), "size": size,
                "rows": self._open(path).metadata.num_rows, "footer": hashlib.sha256(footer).hexdigest()[:16],
                "ids": ids_digest}


@dataclass(slots=True)
class InputScan:
    """What the id columns say about the input: each file's fingerprint (by file tag), and the (unit, row)
    positions of every id that occurs more than once, in input order."""

    fingerprints: dict[str, dict]
    repeated: dict[str, list[tuple[str, int]]]

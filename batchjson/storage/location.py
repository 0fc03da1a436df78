"""Where files live: a local path or an object-storage URI (s3://, gs://).

Each is turned into a pyarrow filesystem and a path on it, with the few file operations storage/ and source.py
need, and `writing` (a full disk while writing becomes StorageFull). Over 250 lines: one class, `Location`, with a
short method per file operation, each covering both local paths and object storage.

Local paths keep their local meaning (a rename is atomic, a folder exists on its own). On object storage there are
no folders and no renames: a folder is a key prefix, `move` is a copy and a delete, and a single PUT is the only
atomic write. Credentials and endpoint come from the standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3; for GCS, Google's default credentials),
or from the URI's query (`s3://bucket/prefix?endpoint_override=host:9000&scheme=http`).

Retries on S3 are pyarrow's (the AWS SDK's): `RETRIES`, the SDK's default strategy with 10 attempts per request
(exponential backoff from 25 ms, about 13 s in all), for 5xx answers, throttling (503 SlowDown), connection resets and
timeouts, reads cut mid-body included. Not pyarrow's own default, the standard strategy with 3 attempts: that one also
keeps a retry quota per filesystem (about 100 retries more than successes), which a long batch run drains in a
brownout, failing requests that a retry would have served. A fault that outlasts the retries ends the run with
`StorageFault` (transient: run the same command again to resume); anything else the store answers (no such bucket,
access denied, bad credentials, an endpoint that does not answer) is the location's `error`, with `HINT`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs

from batchjson.errors import BatchjsonError, OutputError, StorageFault, StorageFull, is_full

T = TypeVar("T")
RETRY_ATTEMPTS = 10
RETRIES = fs.AwsDefaultS3RetryStrategy(max_attempts=RETRY_ATTEMPTS)
# What the AWS SDK says of a fault worth retrying (pyarrow's OSError text): its error types for throttling, 5xx and
# the network; any 5xx status; curl's timeouts, resets and cut transfers (18 partial file, 28 timeout, 52 empty
# reply, 55 send, 56 receive). Not 6 or 7 (no such host, connection refused: most often a wrong endpoint).
TRANSIENT = re.compile(r"AWS Error (NETWORK_CONNECTION|SLOW_DOWN|THROTTLING|SERVICE_UNAVAILABLE|INTERNAL_FAILURE|"
                       r"REQUEST_TIMEOUT)|HTTP status 5\d\d|curlCode: (18|28|52|55|56)\b|[Tt]imed? ?out|"
                       r"[Cc]onnection reset")

READ_ATTEMPTS = 5
RETRIED: Counter = Counter()
"""The reads `reading` retried in this process, by the store's error. pyarrow's own retries are not counted: its
Python binding takes only the two stock strategies and calls back nothing, so their number is not known."""

HINT = ("Check the URI, that the bucket exists, and the credentials and endpoint in the environment "
        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL).")


TEMPORARY = ".tmp-"  # write_json's temporary file: .tmp-<pid>-<name>, renamed over <name>


def temporary_pid(name: str) -> int | None:
    """The pid that writes `name`, a write_json temporary file's name; None for another name."""
    pid, _, rest = name.removeprefix(TEMPORARY).partition("-")
    return int(pid) if name.startswith(TEMPORARY) and pid.isdigit() and rest else None


def is_uri(where: str | Path) -> bool:
    return "://" in str(where)


def s3_with_retries(filesystem: fs.FileSystem) -> fs.FileSystem:
    """The same S3 filesystem (endpoint, region, credentials as the URI and environment gave them) with `RETRIES`."""
    if not isinstance(filesystem, fs.S3FileSystem):
        return filesystem
    _, (options,) = filesystem.__reduce__()
    return fs.S3FileSystem(**options, retry_strategy=RETRIES)


def reading(where, read: Callable[[], T]) -> T:
    """`read()`, and again from its start (up to READ_ATTEMPTS times in all, with backoff) when object storage
    failed it transiently, counted in RETRIED by the store's error.

    pyarrow retries each request, but a GET whose body broke off midway and whose next attempt is refused (a 503)
    fails at once, "Failed to flush response stream": the cut leaves the SDK's response stream bad (seen through
    the fault proxy, tests/s3_proxy.py). So a read is retried here as a whole, on a new stream."""
    for attempt in range(1, READ_ATTEMPTS):
        try:
            return read()
        except (OSError, pa.ArrowException) as e:
            if where.local or isinstance(e, FileNotFoundError) or not TRANSIENT.search(str(e)):
                raise
            error = re.search(r"AWS Error (\w+)|HTTP status (\d+)", str(e))
            RETRIED[(error and (error[1] or error[2]) or "other").lower()] += 1
            time.sleep(0.05 * 2 ** attempt)
    return read()


def transient(where, e: BaseException) -> StorageFault | None:
    """The error to end the run with when `e`, from object storage at `where`, is a fault that outlasted the
    retries (throttling, a 5xx, a reset or a timeout); None when it is anything else."""
    text = " ".join(str(e).split())
    if not TRANSIENT.search(text):
        return None
    cause = re.sub(r"\s*\(Request ID: [^)]*\)", "", text[text.find("AWS Error"):] if "AWS Error" in text else text)
    return StorageFault(f"{where}: object storage kept failing after {RETRY_ATTEMPTS} attempts ({cause[:200]}). "
                        "This looks transient: run the same command again; finished units are kept and the run "
                        "resumes.")


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


class Unreadable(Exception):
    """A file that is there but does not read as Parquet (truncated, emptied, overwritten, corrupt)."""


def json_bytes(data) -> bytes:
    """The bytes `Location.write_json` writes for `data`: one format, so that a record read back is written back the
    same, byte for byte (index.py)."""
    return json.dumps(data, indent=1, default=str).encode()


def glob_match(parts: list[str], pattern: list[str]) -> bool:
    """glob.glob's rule for one path (both split at /): `**` spans any number of folders, other parts match one
    name each, and a name starting with . matches only a part that does."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return glob_match(parts, pattern[1:]) or (bool(parts) and not parts[0].startswith(".")
                                                    and glob_match(parts[1:], pattern))
    return bool(parts) and (not parts[0].startswith(".") or pattern[0].startswith(".")) \
        and fnmatch.fnmatchcase(parts[0], pattern[0]) and glob_match(parts[1:], pattern[1:])


class Location:
    """A file or folder on a filesystem. Paths print as the user wrote them: a local path, or scheme://bucket/key.

    On object storage, any error from the store (no such bucket, access denied, no endpoint) becomes `error` (a
    BatchjsonError: exit 2) naming the location; locally, OSErrors stay what they are, as with pathlib."""

    __slots__ = ("fs", "path", "scheme", "shown", "error", "query")

    def __init__(self, filesystem: fs.FileSystem, path: str, scheme: str, shown: str,
                 error: type[BatchjsonError] = OutputError, query: str = ""):
        self.fs, self.path, self.scheme, self.shown, self.error = filesystem, path, scheme, shown, error
        self.query = query  # the URI's options (endpoint_override=...), kept for `uri`

    @classmethod
    def of(cls, where: str | Path | Location, error: type[BatchjsonError] = OutputError) -> Location:
        """A user's path or URI. A bad URI (unknown scheme, no bucket) is `error`, naming it."""
        if isinstance(where, Location):
            return where
        text = str(where)
        if not is_uri(text):
            return cls(fs.LocalFileSystem(), os.path.abspath(text), "", os.path.normpath(text), error)
        scheme = text.split("://", 1)[0].lower()
        try:
            filesystem, path = fs.FileSystem.from_uri(text)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
            raise error(f"{text}: not a usable location ({e}). Use a local path, s3://bucket/prefix or "
                        "gs://bucket/prefix.") from None
        path, filesystem = path.strip("/"), s3_with_retries(filesystem)
        if isinstance(filesystem, fs.LocalFileSystem):  # file:///x
            return cls(filesystem, "/" + path, "", "/" + path, error)
        if not path:
            raise error(f"{text}: no bucket in the URI. Write {scheme}://bucket/prefix.")
        return cls(filesystem, path, scheme, f"{scheme}://{path}", error, text.partition("?")[2])

    # ----- names ------------------------------------------------------------------------------------------------
    @property
    def local(self) -> bool:
        return not self.scheme

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    @property
    def uri(self) -> str:
        """What Location.of reads back as this location, on the same store: `shown`, with the URI's options."""
        return f"{self.shown}?{self.query}" if self.query else self.shown

    def _at(self, path: str, shown: str) -> Location:
        return Location(self.fs, path, self.scheme, shown, self.error, self.query)

    def __truediv__(self, name: str) -> Location:
        return self._at(posixpath.join(self.path, name), os.path.join(self.shown, name) if self.local
                        else posixpath.join(self.shown, name))

    @property
    def parent(self) -> Location:
        return self._at(posixpath.dirname(self.path), os.path.dirname(self.shown) or ".")

    def with_name(self, name: str) -> Location:
        return self.parent / name

    def parts_below(self, outer: Location) -> tuple[str, ...] | None:
        """This location's path below `outer`, as parts; None if it is not inside (or at) it. Compares normalized
        paths on the same store (bucket/key on object storage), so `out/../out/x` is inside `out`."""
        if (self.scheme, self.fs.type_name) != (outer.scheme, outer.fs.type_name):
            return None
        inner_path, outer_path = self.normal(), outer.normal()
        if inner_path == outer_path:
            return ()
        if not inner_path.startswith(outer_path.rstrip("/") + "/"):
            return None
        return tuple(inner_path[len(outer_path.rstrip("/")) + 1:].split("/"))

    def normal(self) -> str:
        return os.path.realpath(self.path) if self.local else posixpath.normpath(self.path)

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"Location({self.shown!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Location) and (self.scheme, self.path) == (other.scheme, other.path)

    def __hash__(self) -> int:
        return hash((self.scheme, self.path))

    def __lt__(self, other: Location) -> bool:
        return self.path < other.path

    # ----- looking ----------------------------------------------------------------------------------------------
    @contextmanager
    def _io(self):
        """Object-store errors as the user's error, naming this location; a missing file stays FileNotFoundError."""
        try:
            yield
        except FileNotFoundError:
            raise
        except (OSError, pa.ArrowException) as e:
            if self.local:
                raise
            raise transient(self, e) or self.error(f"{self}: {e}. {HINT}") from None

    def info(self) -> fs.FileInfo:
        with self._io():
            return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self.info().type != fs.FileType.NotFound

    def version(self) -> tuple:
        """What changes whenever the file is rewritten: its size, and locally its modification time (ns); on object
        storage its ETag (a digest of the content), from the same one HEAD, as the store's times are to the second
        and an overwrite of the same size within that second happens. FileNotFoundError if it is not a file."""
        if self.local:
            info = self.info()
            if info.type != fs.FileType.File:
                raise FileNotFoundError(self.path)
            return info.size, info.mtime_ns
        with self.open_input() as f, self._io():
            return f.size(), f.metadata().get("ETag") or f.metadata().get("Last-Modified")

    def is_dir(self) -> bool:
        return self.info().type == fs.FileType.Directory

    def is_file(self) -> bool:
        return self.info().type == fs.FileType.File

    def files(self, recursive: bool = False) -> list[fs.FileInfo]:
        """The files below this folder (none if it does not exist), with their sizes and modification times."""
        with self._io():
            found = self.fs.get_file_info(fs.FileSelector(self.path, allow_not_found=True, recursive=recursive))
        return [i for i in found if i.type == fs.FileType.File]

    def listing(self, recursive: bool = False, stat: bool = True) -> Iterator[tuple[str, int, int]]:
        """The files below this folder as (path relative to it, size, modification time in ns), one at a time:
        locally from the directory as it is read (a folder of 390,000 part files listed whole as FileInfo objects
        took 100 MB of driver); on object storage from the store's listing (pyarrow lists whole). `stat=False`:
        locally, sizes and times are 0, and no file is looked at beyond its directory entry."""
        if not self.local:
            cut = len(self.path.rstrip("/")) + 1
            for i in self.files(recursive):
                yield i.path[cut:], i.size, i.mtime_ns
            return
        below = [""]
        while below:
            relative = below.pop()
            try:
                entries = os.scandir(os.path.join(self.path, relative))
            except (FileNotFoundError, NotADirectoryError):
                continue
            with entries:
                for entry in entries:
                    name = f"{relative}/{entry.name}" if relative else entry.name
                    try:
                        if entry.is_file():
                            info = entry.stat() if stat else None
                            yield (name, info.st_size, info.st_mtime_ns) if info else (name, 0, 0)
                        elif recursive and entry.is_dir(follow_symlinks=False):
                            below.append(name)
                    except FileNotFoundError:
                        continue  # gone since the directory was read

    def names(self) -> list[str]:
        """The names of the files and folders directly in this folder (none if it does not exist)."""
        with self._io():
            return [i.base_name for i in self.fs.get_file_info(fs.FileSelector(self.path, allow_not_found=True))]

    def dataset_files(self) -> Iterator[str]:
        """The files that a reader of this folder as a Parquet dataset reads, whatever they are called, as paths
        relative to it, one at a time: pyarrow.dataset reads every file below it except under a name starting with _
        or . (at any depth), and DuckDB's `read_parquet('<folder>/*.parquet')` every *.parquet file directly in it,
        _ and . names too."""
        for below, _, _ in self.listing(recursive=True, stat=False):
            parts = below.split("/")
            if not any(p.startswith(("_", ".")) for p in parts) or (len(parts) == 1 and below.endswith(".parquet")):
                yield below

    def tree(self) -> list[str]:
        """The files below this folder, at any depth, as paths relative to it (none if it does not exist)."""
        return [i.path[len(self.path.rstrip("/")) + 1:] for i in self.files(recursive=True)]

    def glob(self, pattern: str) -> list[Location]:
        """The files directly in this folder whose name matches `pattern` (fnmatch, as Path.glob on one level)."""
        return [self / name for name, _, _ in self.listing(stat=False) if fnmatch.fnmatchcase(name, pattern)]

    # ----- reading and writing ----------------------------------------------------------------------------------
    def open_input(self):
        with self._io():
            return self.fs.open_input_file(self.path)

    def _read(self, read: Callable[[pa.NativeFile], T]) -> T:
        """`read(the open file)`, retried as a whole (`reading`); the store's errors as in `_io`."""
        def once() -> T:
            with self.fs.open_input_file(self.path) as f:
                return read(f)

        with self._io():
            return reading(self, once)

    def read_bytes(self) -> bytes:
        return self._read(lambda f: f.read())

    def read_with(self, read: Callable[[pa.NativeFile], T]) -> T:
        """`read(the open file)`, for a file read a piece at a time (the index): retried as a whole, as every read."""
        return self._read(read)

    def read_footer(self, size: int) -> bytes:
        """The Parquet footer's bytes of this file of `size` bytes (they end 8 bytes before its end, after which
        their length is written)."""
        def footer(f) -> bytes:
            f.seek(size - 8)
            length = int.from_bytes(f.read(4), "little")
            f.seek(max(0, size - 8 - length))
            return f.read(length)

        return self._read(footer)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes | Iterable[bytes]) -> None:
        """One file of `data`, or of its pieces in order (a file that is never held whole)."""
        with self._io(), self.fs.open_output_stream(self.path, compression=None) as f:  # as given, whatever the name
            for piece in [data] if isinstance(data, bytes) else data:
                f.write(piece)

    def write_json(self, data) -> None:
        """All or nothing: a PUT on object storage is; locally, a temporary file renamed over the target is. `data`
        as an iterator of bytes is written as it comes, in pieces (the index, index.py): on object storage an upload
        that fails midway may leave a file cut short, which every reader here refuses as it refuses a damaged one."""
        text = data if isinstance(data, (bytes, Iterator)) else json_bytes(data)
        if not self.local:
            self.write_bytes(text)
            return
        tmp = self.with_name(f"{TEMPORARY}{os.getpid()}-{self.name}")
        try:
            tmp.write_bytes(text)
            os.replace(tmp.path, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk (or Ctrl-C) leaves no temporary file behind
            raise

    def read_json(self):
        return json.loads(self.read_bytes())

    def write_parquet(self, table: pa.Table) -> None:
        with self._io():
            pq.write_table(table, self.path, filesystem=self.fs)

    def read_parquet(self, columns: list[str] | None = None) -> pa.Table:
        """The table, or these columns of it. Unreadable if the file does not read as Parquet. On object storage an
        error of the store is `error`, as elsewhere; locally, an OSError once the file is open is its content's."""
        def table(f) -> pa.Table:
            try:
                return pq.read_table(f, columns=columns)
            except (pa.ArrowInvalid, *((OSError,) if self.local else ())) as e:
                raise Unreadable(f"{self} does not read as Parquet ({e})") from None

        return self._read(table)

    def move(self, target: Location) -> None:
        """Rename locally (atomic); copy then delete on object storage (a kill between them leaves both, equal:
        moving again finishes it). FileNotFoundError if there is nothing to move."""
        if self.local:
            os.replace(self.path, target.path)
            return
        if not self.is_file():
            raise FileNotFoundError(self.path)
        try:
            with self._io():
                self.fs.move(self.path, target.path)
        except BatchjsonError:
            if self.is_file():
                raise
            raise FileNotFoundError(self.path) from None  # moved meanwhile by another process

    def copy(self, target: Location) -> None:
        """Copy the file (on object storage, inside the store: nothing passes through this host)."""
        with self._io():
            self.fs.copy_file(self.path, target.path)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            with self._io():
                self.fs.delete_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        with self._io():
            self.fs.delete_dir(self.path)

    def mkdir(self) -> None:
        """Create the folder (and its parents) locally. Object storage has no folders: check the bucket instead."""
        if self.local:
            Path(self.path).mkdir(parents=True, exist_ok=True)
        else:
            self.check_bucket()

    def check_bucket(self) -> None:
        """On object storage, refuse a bucket that does not exist (or cannot be seen with these credentials)."""
        bucket = self._at(self.bucket, f"{self.scheme}://{self.bucket}")
        if not self.local and not bucket.exists():
            raise self.error(f"{self}: the bucket {bucket} does not exist. Create it first, or fix the URI.")

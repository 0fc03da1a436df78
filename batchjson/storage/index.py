"""The folder's index: its commit records folded into one object, and the files a passing exactly-once check read.

A resume needs every commit record (which input files have committed units, each file's size, what pass 2 has
left) and ends with the exactly-once check. On object storage, reading one record is a HEAD and a GET, and the
check reads every part file: at 10,000 units, tens of thousands of requests before the first prompt and after the
last. So a run that ends with a passing check, holding the whole folder (no --shard), writes OUT/_batchjson/index.json:

    {"written": "2026-11-30 06:12:09 UTC",
     "records": {"p1-<unit>.json": {"stamp": [size, mtime_ns], "sha256": "...", "record": {...}}, ...},
     "checked": {"p1-<unit>.parquet": [size, mtime_ns], ...}}

A stamp is what a listing says of a file (its size and modification time); `sha256` is the digest of the record
file's bytes as the writing run read or wrote them. The next run reads the index before it decides to run, and
deletes it once it has (so that a refused run touches nothing, and no run that dies midway leaves an index behind
that its own commits made stale). It uses an entry instead of reading its record only when the record is listed
with the indexed stamp and the entry's copy, written out as records are (`json_bytes`), has the indexed digest: an
index cannot stand in for a record it does not match byte for byte, so a copy edited by hand is ignored and its
record read. At its end check it trusts the units whose files are all listed with the stamps the last check saw,
and says how many it took from the index (verify.py). Anything else (a record or a file rewritten since, a folder
written before this index existed, a damaged index) is read as without the index.

What the index cannot prove is that it was written by a run: one rewritten whole, digests included, is believed
for the units it names. Hence the end check's count of units taken from it; `batchjson verify` never uses it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator

from pyarrow import fs

from batchjson.storage.location import Location, json_bytes

Stamp = tuple[int, int]


def stamp(info: fs.FileInfo) -> Stamp:
    return info.size, info.mtime_ns


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Index:
    """The index as a run read it: `records(listed)` and `checked(name, stamp)` answer from it."""

    def __init__(self, data: dict | None = None):
        data = data if isinstance(data, dict) else {}
        self._records = data.get("records") if isinstance(data.get("records"), dict) else {}
        self._checked = data.get("checked") if isinstance(data.get("checked"), dict) else {}
        self.written = data.get("written") if isinstance(data.get("written"), str) else ""
        """When the check that wrote it passed (UTC), as the end check's summary names it."""

    @classmethod
    def read(cls, file: Location) -> Index:
        """Read the index; an empty one if there is none (or it does not read as one). Deletes nothing: a run deletes
        it once it has decided to run (`Commits.drop_index`)."""
        try:
            return cls(file.read_json())
        except FileNotFoundError:
            return cls()
        except ValueError:
            return cls(None)

    def records(self, listed: dict[str, Stamp]) -> dict[str, tuple[str, dict]]:
        """The indexed records among those `listed` (record name -> stamp) whose stamp is still the indexed one and
        whose copy is, byte for byte, the record file the digest was taken of: name -> (digest, record)."""
        found = {}
        for name, entry in self._records.items():
            if (name in listed and isinstance(entry, dict) and isinstance(entry.get("record"), dict)
                    and list(listed[name]) == entry.get("stamp")
                    and digest(json_bytes(entry["record"])) == entry.get("sha256")):
                found[name] = entry["sha256"], entry["record"]
        return found

    def checked(self, name: str, now: Stamp | None) -> bool:
        """Whether the part file `name`, listed now with stamp `now`, is as the last passing check read it."""
        return now is not None and self._checked.get(name) == list(now)

    @staticmethod
    def write(file: Location, records: Iterable[tuple[str, Stamp, str, bytes]], checked: dict[str, Stamp]) -> None:
        """`records`: (record name, stamp, digest of its file's bytes, those bytes), one at a time. Each record goes
        in as its file's bytes (JSON already), not parsed and encoded again, and the file is written in pieces as
        they come: the index of a large folder is never held whole (json.dumps with an indent built twice its size
        in small strings, 4x slower)."""
        dumps = json.dumps

        def pieces() -> Iterator[bytes]:
            yield b'{"written": ' + dumps(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())).encode()
            yield b', "records": {'
            for n, (name, s, d, data) in enumerate(records):
                yield b"".join([b", " if n else b"", dumps(name).encode(), b': {"stamp": ', dumps(list(s)).encode(),
                                b', "sha256": ', dumps(d).encode(), b', "record": ', data, b"}"])
            yield b'}, "checked": ' + dumps({name: list(s) for name, s in checked.items()}).encode() + b"}"

        file.write_json(pieces())

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
        records = data.get("records") if isinstance(data.get("records"), dict) else {}
        # record name -> (stamp, sha256, the record's bytes): kept as bytes, as Commits keeps the records it reads
        self._records: dict[str, tuple[list, str, bytes]] = {}
        for name, entry in records.items():
            self._keep(name, entry)
        self._checked = data.get("checked") if isinstance(data.get("checked"), dict) else {}
        self.written = data.get("written") if isinstance(data.get("written"), str) else ""
        """When the check that wrote it passed (UTC), as the end check's summary names it."""

    def _keep(self, name: str, entry, data: bytes | None = None) -> None:
        """Keep one entry (`data`: its record's bytes as the file holds them; else the parsed record written out as
        records are, `json_bytes`). One that is not an entry is left out: its record is read instead."""
        if (isinstance(entry, dict) and isinstance(entry.get("record"), dict) and isinstance(entry.get("stamp"), list)
                and isinstance(entry.get("sha256"), str)):
            self._records[name] = entry["stamp"], entry["sha256"], json_bytes(entry["record"]) if data is None else data

    @classmethod
    def read(cls, file: Location) -> Index:
        """Read the index; an empty one if there is none (or it does not read as one). Deletes nothing: a run deletes
        it once it has decided to run (`Commits.drop_index`)."""
        try:
            text = file.read_bytes().decode()
        except FileNotFoundError:
            return cls()
        except UnicodeDecodeError:
            return cls(None)
        try:
            return cls.parse(text)
        except ValueError:
            return cls(None)

    @classmethod
    def parse(cls, text: str) -> Index:
        """The index as `write` lays it out, one entry at a time, each record kept as its bytes in the file: parsed
        whole, a folder's records took about 3 KB each, 1.29 GiB of driver RSS for a resume at 100 million rows
        (BENCHMARKS.md, "A job of 100 million rows"). A file laid out otherwise (by hand, by an earlier version) is
        parsed whole; ValueError if it is not JSON."""
        decode = json.JSONDecoder().raw_decode
        index = cls()

        def expect(at: int, what: str) -> int:
            if not text.startswith(what, at):
                raise ValueError(f"expected {what!r} at {at}")
            return at + len(what)

        try:
            written, i = decode(text, expect(0, '{"written": '))
            index.written = written if isinstance(written, str) else ""
            i = expect(i, ', "records": {')
            first = True
            while not text.startswith("}", i):
                i = i if first else expect(i, ", ")
                first = False
                name, i = decode(text, i)
                start = expect(i, ": ")
                entry, i = decode(text, start)
                record = text.find('"record": ', start, i)
                if isinstance(name, str) and record >= 0 and text.startswith("}", i - 1):
                    data = text[record + len('"record": '):i - 1].encode()
                    sha256 = entry.get("sha256") if isinstance(entry, dict) else None
                    # a copy laid out otherwise (rewritten by hand) is written out as records are, as when parsed whole
                    index._keep(name, entry, data if digest(data) == sha256 else None)
            checked, i = decode(text, expect(i + 1, ', "checked": '))
            expect(i, "}")
            if text[i + 1:].strip() or not isinstance(checked, dict):
                raise ValueError("not the index's layout")
            index._checked = checked
            return index
        except ValueError:
            return cls(json.loads(text))

    def records(self, listed: dict[str, Stamp]) -> dict[str, tuple[str, bytes]]:
        """The indexed records among those `listed` (record name -> stamp) whose stamp is still the indexed one and
        whose copy is, byte for byte, the record file the digest was taken of: name -> (digest, the record's bytes)."""
        found = {}
        for name, (indexed, sha256, data) in self._records.items():
            if name in listed and list(listed[name]) == indexed and digest(data) == sha256:
                found[name] = sha256, data
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

"""The folder's index: its commit records folded into a few files, and the files an exactly-once check read.

A resume needs every commit record (which input files have committed units, each file's size, what pass 2 has
left) and ends with the exactly-once check. On object storage, reading one record is a HEAD and a GET, and the
check reads every part file: at 10,000 units, tens of thousands of requests before the first prompt and after the
last. So a run keeps the records it has read or written in the run state folder, gzip-compressed JSON:

    index.json.gz           written when a check of the whole folder (no --shard) passes, at the end of a run:
        {"written": "2026-11-30 06:12:09 UTC",
         "records": {"p1-<unit>.json": {"stamp": [size, mtime_ns], "sha256": "...", "record": {...}}, ...},
         "checked": {"p1-<unit>.parquet": [size, mtime_ns], ...}}
    index-part-000012.json.gz   the same, written while a run goes (every `Commits.fold_every` new records), so
                            that a run killed midway leaves its records folded for the next one; its "checked" are
                            the records and files of the units the run checked as it finished them (verify.py's
                            `UnitChecks`), and the stamps they had when the check read them

A stamp is what a listing says of a file (its size and modification time); `sha256` is the digest of the record
file's bytes as the writing run read or wrote them. The next run reads the index and its parts before it decides
to run, and deletes nothing then (a refused run touches nothing); a passing check of the whole folder writes
index.json.gz afresh and deletes the parts. It uses an entry instead of reading its record only when the record is
listed with the indexed stamp and the entry's copy, written out as records are (`json_bytes`), has the indexed
digest: an index cannot stand in for a record it does not match byte for byte, so a copy edited by hand is ignored
and its record read; a stale entry (its unit redone since) no longer matches its record's stamp and is ignored
too. At its end check a run trusts the units whose files are all listed with the stamps a check saw (the last
passing check of the folder, or a run's check of the unit as it finished it: then its record too), and says how
many it took from the index (verify.py). Anything else (a record or a file rewritten since, a
folder written before this index existed, a damaged file of the index) is read as without the index.

Read and written a piece at a time, its entries kept on a `Shelf` (shelf.py): at 100 million rows the index
is about 145 MB of JSON (20 MB compressed), which parsed whole took 1.29 GiB of driver.

What the index cannot prove is that it was written by a run: one rewritten whole, digests included, is believed
for the units it names. Hence the end check's count of units taken from it; `batchjson verify` never uses it.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import time
import zlib
from collections.abc import Iterable, Iterator

from batchjson.storage.location import Location, json_bytes
from batchjson.storage.shelf import Shelf

Stamp = tuple[int, int]
INDEX = "index.json.gz"
LEGACY = "index.json"  # written uncompressed by earlier versions: read, then replaced
PART = "index-part-"
CHUNK = 1 << 20
_decode = json.JSONDecoder().raw_decode


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def part_names(state: Location) -> list[str]:
    """The index's part files in the run state folder, in the order they were written."""
    return sorted(name for name in state.names() if name.startswith(PART) and name.endswith(".json.gz"))


def part_name(number: int) -> str:
    """The name of the index's part file `number` (`part_names` sorts them in that order)."""
    return f"{PART}{number:06d}.json.gz"


class _Text:
    """A file's text a piece at a time (inflated when it is gzip), for JSONDecoder.raw_decode: `value` decodes the
    next JSON value, `expect` consumes a literal, `peek` looks for one."""

    def __init__(self, f):
        self.f, self.buf, self.at, self.end = f, "", 0, False
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        first = f.read(CHUNK)
        self.inflate = zlib.decompressobj(wbits=31) if first[:2] == b"\x1f\x8b" else None
        self._add(first)

    def _add(self, data: bytes) -> None:
        if not data:
            self.end = True
            text = self.utf8.decode(self.inflate.flush() if self.inflate else b"", final=True)
        else:
            text = self.utf8.decode(self.inflate.decompress(data) if self.inflate else data)
        self.buf, self.at = self.buf[self.at:] + text, 0

    def _more(self) -> bool:
        if self.end:
            return False
        self._add(self.f.read(CHUNK))
        return True

    def peek(self, literal: str) -> bool:
        while len(self.buf) - self.at < len(literal) and self._more():
            pass
        return self.buf.startswith(literal, self.at)

    def expect(self, literal: str) -> None:
        if not self.peek(literal):
            raise ValueError(f"expected {literal!r}")
        self.at += len(literal)

    def value(self, raw: bool = False):
        """The next JSON value (and its text, `raw`). One that ends where the text read so far does may be cut
        short (a number), so more is read and it is decoded again."""
        while True:
            try:
                found, end = _decode(self.buf, self.at)
            except ValueError:
                if self._more():
                    continue
                raise
            if end == len(self.buf) and self._more():
                continue
            text, self.at = (self.buf[self.at:end] if raw else None), end
            return (found, text) if raw else found

    def members(self) -> Iterator:
        """The names of the members of the object that starts here, one at a time, each left at its value (which the
        caller reads); the object's braces and separators consumed."""
        self.expect("{")
        first = True
        while not self.peek("}"):
            if not first:
                self.expect(", ")
            first = False
            name = self.value()
            self.expect(": ")
            yield name
        self.expect("}")

    def rest(self) -> str:
        while self._more():
            pass
        return self.buf[self.at:]


class Index:
    """The index as a run read it: `record(name, stamp)` and `checked(name, stamp)` answer from it."""

    def __init__(self):
        # record name -> (size, mtime_ns, sha256, the record's bytes): kept as bytes, as Commits keeps the records
        self._records = Shelf(4)
        self._checked = Shelf(2)  # part or record file name -> (size, mtime_ns) as a check saw it
        self.written = ""
        """When the check that wrote it passed (UTC), as the end check's summary names it."""
        self.replaced: list[str] = []
        """The files read that a passing check's index replaces: its parts, and an earlier version's index."""
        self.next_part = 1
        """The number of the next part to write, after every part there is."""

    def _keep(self, entries: Iterable[tuple]) -> None:
        """Keep entries (name, entry, data), `data` being the record's bytes as the file holds them, their digest
        the entry's, or None: the parsed record written out as records are (`json_bytes`), kept only if that has the
        entry's digest. One that is not an entry, or whose copy is not the record it has the digest of (edited by
        hand), is left out: its record is read instead. So the digest is taken once, here, not at each look."""
        def copy(entry: dict, data: bytes | None) -> bytes | None:
            if data is None:
                data = json_bytes(entry["record"])
                return data if digest(data) == entry["sha256"] else None
            return data

        self._records.update(
            (name, (*entry["stamp"], entry["sha256"], kept))
            for name, entry, data in entries
            if (isinstance(name, str) and isinstance(entry, dict) and isinstance(entry.get("record"), dict)
                and isinstance(entry.get("sha256"), str) and _is_stamp(entry.get("stamp")))
            and (kept := copy(entry, data)) is not None)

    @classmethod
    def read(cls, state: Location) -> Index:
        """The index and its parts in the run state folder; empty if there are none. A file that does not read as
        the index is left out (its records are read instead). Deletes nothing: `Commits.write_index` replaces them."""
        index, parts = cls(), part_names(state)
        numbers = [int(name[len(PART):-len(".json.gz")]) for name in parts if name[len(PART):-len(".json.gz")].isdigit()]
        index.next_part = max(numbers, default=0) + 1
        for name in (LEGACY, INDEX, *parts):
            try:
                (state / name).read_with(lambda f: index._parse(f, whole=not name.startswith(PART)))
            except (FileNotFoundError, ValueError, UnicodeDecodeError, zlib.error):
                continue
            if name != INDEX:
                index.replaced.append(name)
        return index

    def _parse(self, f, whole: bool) -> None:
        """One file of the index, as `write` lays it out, one entry at a time, each record kept as its bytes in the
        file. A file laid out otherwise (by hand, by an earlier version) is parsed whole; ValueError if it is not
        JSON. `whole`: a whole index, whose time and check are this index's (a part has neither)."""
        text = _Text(f)
        kept: list = []  # (name, entry, data), kept a few thousand at a time: each is checked before it is used
        checked: list = []
        try:
            text.expect('{"written": ')
            written = text.value()
            text.expect(', "records": ')
            for name in text.members():
                text.expect('{"stamp": ')
                entry = {"stamp": text.value()}
                text.expect(', "sha256": ')
                entry["sha256"] = text.value()
                text.expect(', "record": ')
                entry["record"], raw = text.value(raw=True)
                text.expect("}")
                data = raw.encode()
                # a copy laid out otherwise (rewritten by hand) is written out as records are, as when parsed whole
                kept.append((name, entry, data if digest(data) == entry["sha256"] else None))
                if len(kept) >= 4096:
                    self._keep(kept)
                    kept.clear()
            text.expect(', "checked": ')
            for name in text.members():
                checked.append((name, text.value()))
                if len(checked) >= 4096:
                    self._add(written, checked, whole)
                    checked.clear()
            text.expect("}")
            if text.rest().strip():
                raise ValueError("not the index's layout")
        except ValueError:
            f.seek(0)
            self._load(json.loads(_Text(f).rest()), whole)
            return
        self._keep(kept)
        self._add(written, checked, whole)

    def _add(self, written, checked: Iterable, whole: bool) -> None:
        if whole:
            self.written = written if isinstance(written, str) else ""
        self.vouch_files((name, s) for name, s in checked if isinstance(name, str) and _is_stamp(s))

    def vouch_files(self, checked: Iterable[tuple[str, Stamp]]) -> None:
        """Files (name, stamp) that a check read: `checked` answers for them while they keep these stamps."""
        self._checked.update(checked)

    def _load(self, data, whole: bool) -> None:
        """A file of the index parsed whole (laid out otherwise than `write` does)."""
        if not isinstance(data, dict):
            raise ValueError("not the index")
        records = data.get("records") if isinstance(data.get("records"), dict) else {}
        self._keep((name, entry, None) for name, entry in records.items())
        checked = data.get("checked") if isinstance(data.get("checked"), dict) else {}
        self._add(data.get("written"), checked.items(), whole)

    def record(self, name: str, listed: Stamp) -> tuple[str, bytes] | None:
        """The indexed record `name`, listed now with stamp `listed`, if its stamp is still the indexed one (its copy
        is, byte for byte, the record file the digest was taken of: `_keep` kept no other): (digest, the record's
        bytes)."""
        found = self._records.get(name)
        if found is None or tuple(found[:2]) != tuple(listed):
            return None
        return found[2], found[3]

    def drop_stale(self, name: str, listed: Stamp) -> None:
        """Drop the entry of record `name` if it is listed now with another stamp than the indexed one: its record
        was rewritten since (its unit redone), and `copy` answers for the records as listed."""
        found = self._records.get(name)
        if found is not None and tuple(found[:2]) != tuple(listed):
            self._records.pop(name)

    def copy(self, name: str) -> bytes | None:
        """The index's copy of record `name` (the bytes its digest is of), after `drop_stale`; None without one."""
        found = self._records.get(name)
        return None if found is None else found[3]

    def forget(self, name: str) -> None:
        """The record `name` is gone (its unit is redone): its entry answers for nothing."""
        self._records.pop(name)

    def checked(self, name: str, now: Stamp | None) -> bool:
        """Whether the part file `name`, listed now with stamp `now`, is as the last passing check read it."""
        found = self._checked.get(name) if now is not None else None
        return found is not None and tuple(found) == tuple(now)

    @staticmethod
    def write(file: Location, records: Iterable[tuple[str, Stamp, str, bytes]],
              checked: Iterable[tuple[str, Stamp]] = ()) -> None:
        """`records`: (record name, stamp, digest of its file's bytes, those bytes), one at a time; `checked`: (part
        file name, stamp). Each record goes in as its file's bytes (JSON already), not parsed and encoded again, and
        the file is written gzip-compressed in pieces as they come: the index of a large folder is never held
        whole (json.dumps with an indent built twice its size in small strings, 4x slower)."""
        dumps = json.dumps

        def pieces() -> Iterator[bytes]:
            yield b'{"written": ' + dumps(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())).encode()
            yield b', "records": {'
            for n, (name, s, d, data) in enumerate(records):
                yield b"".join([b", " if n else b"", dumps(name).encode(), b': {"stamp": ', dumps(list(s)).encode(),
                                b', "sha256": ', dumps(d).encode(), b', "record": ', data, b"}"])
            yield b'}, "checked": {'
            for n, (name, s) in enumerate(checked):
                yield b"".join([b", " if n else b"", dumps(name).encode(), b": ", dumps(list(s)).encode()])
            yield b"}}"

        def gzipped() -> Iterator[bytes]:
            deflate, buffered = zlib.compressobj(6, wbits=31), []
            for piece in pieces():
                buffered.append(piece)
                if len(buffered) >= 256:
                    yield deflate.compress(b"".join(buffered))
                    buffered.clear()
            yield deflate.compress(b"".join(buffered)) + deflate.flush()

        file.write_json(gzipped())


def _is_stamp(s) -> bool:
    return isinstance(s, (list, tuple)) and len(s) == 2 and all(isinstance(v, int) for v in s)

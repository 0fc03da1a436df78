"""The folder's index: its commit records folded into one object, and the files a passing exactly-once check read.

A resume needs every commit record (which input files have committed units, each file's size, what pass 2 has
left) and ends with the exactly-once check. On object storage, reading one record is a HEAD and a GET, and the
check reads every part file: at 10,000 units, tens of thousands of requests before the first prompt and after the
last. So a run that ends with a passing check, holding the whole folder (no --shard), writes OUT/_batchjson/index.json:

    {"records": {"p1-<unit>.json": {"stamp": [size, mtime_ns], "record": {...}}, ...},
     "checked": {"p1-<unit>.parquet": [size, mtime_ns], ...}}

A stamp is what a listing says of a file (its size and modification time). The next run takes the index (reads it,
then deletes it, so that no run that dies midway leaves an index behind that its own commits made stale), uses a
record whose listed stamp is the one indexed instead of reading it, and trusts, at its end check, the units whose
files are all listed with the stamps the last check saw. Anything else (a record or a file rewritten since, a folder
written before this index existed, a damaged index) is read as without the index. `batchjson verify` never uses it.
"""

from __future__ import annotations

from pyarrow import fs

from batchjson.storage.location import Location

Stamp = tuple[int, int]


def stamp(info: fs.FileInfo) -> Stamp:
    return info.size, info.mtime_ns


class Index:
    """The index as a run took it: `records(listed)` and `checked(name, stamp)` answer from it."""

    def __init__(self, data: dict | None = None):
        data = data if isinstance(data, dict) else {}
        self._records = data.get("records") if isinstance(data.get("records"), dict) else {}
        self._checked = data.get("checked") if isinstance(data.get("checked"), dict) else {}

    @classmethod
    def take(cls, file: Location) -> Index:
        """Read the index and delete it; an empty one if there is none (or it does not read as one)."""
        try:
            data = file.read_json()
        except FileNotFoundError:
            return cls()
        except ValueError:
            data = None
        file.unlink(missing_ok=True)
        return cls(data)

    def records(self, listed: dict[str, Stamp]) -> dict[str, dict]:
        """The indexed records among those `listed` (record name -> stamp) whose stamp is still the indexed one."""
        return {name: entry["record"] for name, entry in self._records.items()
                if name in listed and isinstance(entry, dict) and isinstance(entry.get("record"), dict)
                and list(listed[name]) == entry.get("stamp")}

    def checked(self, name: str, now: Stamp | None) -> bool:
        """Whether the part file `name`, listed now with stamp `now`, is as the last passing check read it."""
        return now is not None and self._checked.get(name) == list(now)

    @staticmethod
    def write(file: Location, records: dict[str, tuple[Stamp, dict]], checked: dict[str, Stamp]) -> None:
        file.write_json({"records": {name: {"stamp": list(s), "record": r} for name, (s, r) in records.items()},
                         "checked": {name: list(s) for name, s in checked.items()}})

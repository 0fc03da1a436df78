"""What a run keeps of its folder's state, by name, off the driver's heap.

A run keeps, for its whole length, one thing per unit or per file of its folder: each commit record's bytes (so that
the end check and the index do not read them again), the stamps of the part files it listed, the index's entries.
In dicts these grew the driver by about 6 KB a unit: 779 MiB at 100 million rows against 256 at one million
(BENCHMARKS.md, "A job of 100 million rows"). A `Shelf` keeps them in SQLite's private temporary database (the
empty file name: sqlite3 is in the standard library), whose pages stay in memory up to its cache and go to a file
in TMPDIR (or SQLITE_TMPDIR) past it, deleted when it is closed: a few MB of RSS whatever the folder, a few µs a
look. Values are rows of `width` columns of what SQLite stores (bytes, str, int); one column is handed as itself.
Safe to use from the threads of one process (one lock); a process that forks makes its own.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator
from typing import Any

CACHE_KIB = 4096  # the pages held in memory before they spill to TMPDIR
PAGE = 2048  # rows fetched at a time by `items`


class Shelf:
    """A dict-like map from names to rows of `width` values, held in a temporary SQLite database."""

    def __init__(self, width: int = 1):
        self.width = width
        self._db: sqlite3.Connection | None = None  # made at the first write: most shelves of a small run stay empty
        self._lock = threading.Lock()
        self._columns = ", ".join(f"v{i}" for i in range(width))

    def _run(self, sql: str, args: Iterable = (), many: bool = False) -> list:
        with self._lock:
            if self._db is None:
                self._db = sqlite3.connect("", check_same_thread=False, isolation_level=None)
                self._db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
                self._db.execute(f"CREATE TABLE kept (name TEXT PRIMARY KEY, {self._columns})")
            if many:
                self._db.execute("BEGIN")
                self._db.executemany(sql, args)
                self._db.execute("COMMIT")
                return []
            return self._db.execute(sql, tuple(args)).fetchall()

    def _row(self, value) -> tuple:
        return tuple(value) if self.width > 1 else (value,)

    def _value(self, row: tuple):
        return row if self.width > 1 else row[0]

    def __setitem__(self, name: str, value) -> None:
        self._run(f"INSERT OR REPLACE INTO kept VALUES (?, {', '.join('?' * self.width)})", (name, *self._row(value)))

    def update(self, items: Iterable[tuple[str, Any]]) -> None:
        """Many at once, in one transaction."""
        rows = ((name, *self._row(value)) for name, value in items)
        self._run(f"INSERT OR REPLACE INTO kept VALUES (?, {', '.join('?' * self.width)})", rows, many=True)

    def get(self, name: str, default=None):
        if self._db is None:
            return default
        found = self._run(f"SELECT {self._columns} FROM kept WHERE name = ?", (name,))
        return self._value(found[0]) if found else default

    def __getitem__(self, name: str):
        found = self.get(name, KeyError)
        if found is KeyError:
            raise KeyError(name)
        return found

    def __contains__(self, name: str) -> bool:
        return self._db is not None and bool(self._run("SELECT 1 FROM kept WHERE name = ?", (name,)))

    def pop(self, name: str, default=None):
        found = self.get(name, default)
        if self._db is not None:
            self._run("DELETE FROM kept WHERE name = ?", (name,))
        return found

    def __len__(self) -> int:
        return 0 if self._db is None else self._run("SELECT COUNT(*) FROM kept")[0][0]

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, value) in the names' order, a page at a time: writes meanwhile are safe (a name written behind the
        page under way is not seen)."""
        after = ""
        while self._db is not None:
            page = self._run(f"SELECT name, {self._columns} FROM kept WHERE name > ? ORDER BY name LIMIT {PAGE}",
                             (after,))
            for name, *row in page:
                yield name, self._value(tuple(row))
            if len(page) < PAGE:
                return
            after = page[-1][0]

    def keys(self) -> Iterator[str]:
        return (name for name, _ in self.items())

    def clear(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

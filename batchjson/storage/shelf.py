"""What a run keeps of its folder's state, by name, in memory up to a bound and off the driver's heap past it.

A run keeps, for its whole length, one thing per unit or per file of its folder: each commit record's bytes (so that
the end check and the index do not read them again), the stamps of the part files it listed, the index's entries.
In dicts these grew the driver by about 6 KB a unit: 779 MiB at 100 million rows against 256 at one million
(BENCHMARKS.md, "A job of 100 million rows"). A `Shelf` is a dict until what it holds passes `limit` bytes (about
14,000 records by default: a job of 7 million rows in 1,024-row units), then moves it all to SQLite's private
temporary database (the empty file name; sqlite3 is in the standard library), whose pages stay in memory up to its
cache and go to a file in TMPDIR (or SQLITE_TMPDIR) past it, deleted when it is closed. So a small job looks its
state up at a dict's speed, and a large one holds `limit` plus the cache whatever its size, at about 5 µs a look
(BENCHMARKS.md, "The run's state off the driver's heap": 4.7 µs under cProfile at 100 million rows). Values are
rows of `width` columns of what SQLite stores (bytes, str, int); one column is handed as itself. Safe to use from
the threads of one process (one lock); a process that forks makes its own.
"""

from __future__ import annotations

import sqlite3
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

LIMIT = 8 << 20  # bytes held in a dict before the shelf moves to SQLite
CACHE_KIB = 4096  # SQLite's pages held in memory before they spill to TMPDIR
PAGE = 2048  # rows fetched at a time by `items`


class Shelf:
    """A dict-like map from names to rows of `width` values: a dict up to `limit` bytes, then a temporary SQLite
    database."""

    def __init__(self, width: int = 1, limit: int | None = None):
        self.width, self.limit = width, LIMIT if limit is None else limit
        self._mem: dict[str, Any] | None = {}  # None once moved to SQLite
        self._held = 0  # about what `_mem` holds, in bytes
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        columns = ", ".join(f"v{i}" for i in range(width))
        self._columns = columns
        self._select = f"SELECT {columns} FROM kept WHERE name = ?"
        self._insert = f"INSERT OR REPLACE INTO kept VALUES (?, {', '.join('?' * width)})"

    @property
    def spilled(self) -> bool:
        """Whether it has moved to SQLite (held more than `limit`)."""
        return self._mem is None

    def _size(self, name: str, value) -> int:
        values = value if self.width > 1 else (value,)
        return 120 + len(name) + sum(sys.getsizeof(v) for v in values)

    def _spill(self) -> None:
        """Move what the dict holds to SQLite (under the lock)."""
        self._db = sqlite3.connect("", check_same_thread=False, isolation_level=None)
        self._db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
        self._db.execute(f"CREATE TABLE kept (name TEXT PRIMARY KEY, {self._columns})")
        held, self._mem, self._held = self._mem, None, 0
        self._many(held.items())

    def _many(self, items: Iterable[tuple[str, Any]]) -> None:
        rows = ((name, *(value if self.width > 1 else (value,))) for name, value in items)
        self._db.execute("BEGIN")
        self._db.executemany(self._insert, rows)
        self._db.execute("COMMIT")

    def __setitem__(self, name: str, value) -> None:
        self.update([(name, value)])

    def update(self, items: Iterable[tuple[str, Any]]) -> None:
        """Many at once (in one transaction, once in SQLite)."""
        with self._lock:
            if self._mem is None:
                self._many(items)
                return
            for name, value in items:
                value = tuple(value) if self.width > 1 else value
                self._held += self._size(name, value) - (self._size(name, self._mem[name]) if name in self._mem else 0)
                self._mem[name] = value
                if self._held > self.limit:
                    self._spill()
                    self._many(items)  # the rest of them, if `items` is an iterator
                    return

    def get(self, name: str, default=None):
        with self._lock:
            if self._mem is not None:
                return self._mem.get(name, default)
            found = self._db.execute(self._select, (name,)).fetchone()
        return default if found is None else found if self.width > 1 else found[0]

    def __getitem__(self, name: str):
        found = self.get(name, KeyError)
        if found is KeyError:
            raise KeyError(name)
        return found

    def __contains__(self, name: str) -> bool:
        return self.get(name, KeyError) is not KeyError

    def pop(self, name: str, default=None):
        with self._lock:
            if self._mem is not None:
                if name in self._mem:
                    self._held -= self._size(name, self._mem[name])
                return self._mem.pop(name, default)
            found = self._db.execute(self._select, (name,)).fetchone()
            self._db.execute("DELETE FROM kept WHERE name = ?", (name,))
        return default if found is None else found if self.width > 1 else found[0]

    def __len__(self) -> int:
        with self._lock:
            return len(self._mem) if self._mem is not None else self._db.execute("SELECT COUNT(*) FROM kept").fetchone()[0]

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, value) in the names' order, a page at a time: writes meanwhile are safe (a name written behind the
        page under way is not seen)."""
        after = None
        while True:
            with self._lock:
                if self._mem is not None:
                    names = sorted(n for n in self._mem if after is None or n > after)[:PAGE]
                    page = [(n, self._mem[n]) for n in names]
                else:
                    found = self._db.execute(f"SELECT name, {self._columns} FROM kept WHERE name > ? ORDER BY name "
                                             f"LIMIT {PAGE}", (after or "",)).fetchall()
                    page = [(name, tuple(row) if self.width > 1 else row[0]) for name, *row in found]
            yield from page
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
            self._mem, self._held = {}, 0

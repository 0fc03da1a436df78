"""The folder locks: flock on a local folder, a renewed lease object on object storage.

A local folder is locked with flock (see `lock_folder`); the kernel drops the locks of a dead process. Object
storage has no locks: each run writes a lease object `lease-<I>of<N>-<owner>.json` (owner id, host, pid, expiry)
and then lists the leases; another layout's lease, or another lease of the same shard, that has not expired makes
it refuse (and delete its own). Because each run lists after its own write, and the store lists what was written
before (S3 and GCS are strongly consistent), two racing runs may both refuse but never both proceed. A thread
renews the lease every `Lease.RENEW_EVERY` seconds; a lease not renewed for `Lease.EXPIRY` seconds (judged by the
store's timestamps, not the hosts' clocks) is taken over and deleted, so a killed run blocks the folder at most
that long. What remains: a run that stalls (suspended, cut off from the store) for longer than the expiry loses
its lease to the next run while it still believes it holds it. Before each commit record it checks that its
lease object is still there and was renewed within the expiry, so it stops at its next commit; only a commit
already between that check and its record's PUT can land after the takeover. Such a unit is redone by whichever
run commits it last (each commit deletes the earlier attempt's files first), and `batchjson verify` says whether
the folder still holds each row once.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from batchjson.errors import BatchjsonError, OutputError, StorageFull, is_full
from batchjson.storage.location import Location

LEASE = "lease-"  # how a lease object's name begins: lease-<I>of<N>-<owner>.json
HELD = ("lock", LEASE)  # how the names of the folder's lock files and lease objects begin (a fresh run keeps them)


def lock_folder(state: Path, shard: tuple[int, int], busy: str) -> list:
    """Lock a local folder's run state `state` for one shard; returns the open lock files (see `release`).

    Every run holds lock-of<N> shared and lock-<I>of<N> exclusively, then checks that no lock-of<M> of another
    layout is held. Both runs of a race may refuse, never both proceed. The kernel drops the locks when the
    process dies, so a killed run never leaves them stuck."""
    i, n = shard
    state.mkdir(parents=True, exist_ok=True)
    held: list = []
    _flock(held, state / f"lock-of{n}", fcntl.LOCK_SH, busy)
    for other in state.glob("lock-of*"):
        if other.name != f"lock-of{n}":
            with open(other, "a") as fd:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    release(held)
                    raise OutputError(busy.replace("right now", f"right now (with --shard ?/{other.name[7:]})")) from None
    _flock(held, state / f"lock-{i}of{n}", fcntl.LOCK_EX, busy.replace("right now", f"right now (shard {i}/{n})"))
    return held


def _flock(held: list, path: Path, mode: int, message: str) -> None:
    try:
        fd = open(path, "a")
    except OSError as e:
        if is_full(e):  # no inode left for the lock file
            release(held)
            raise StorageFull.at(path, e) from None
        raise
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        fd.close()
        release(held)
        raise OutputError(message) from None
    held.append(fd)


def release(held: list) -> None:
    """Close the lock files `lock_folder` returned (which drops their locks), emptying the list."""
    for fd in held:
        fd.close()
    held.clear()


class Lease:
    """A lease object on object storage: the folder lock of one shard of one layout, renewed by a thread.

    Tests shorten RENEW_EVERY and EXPIRY."""

    RENEW_EVERY = 20.0
    EXPIRY = 90.0

    def __init__(self, state: Location, shard: tuple[int, int]):
        i, n = shard
        self.state, self.slot, self.layout = state, f"{i}of{n}", n
        self.owner = uuid.uuid4().hex[:12]
        self.file = state / f"{LEASE}{self.slot}-{self.owner}.json"
        self.renewed = 0.0  # time.monotonic() of the last write that reached the store
        self.lost = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        expires = datetime.fromtimestamp(time.time() + self.EXPIRY, timezone.utc).isoformat(timespec="seconds")
        started = time.monotonic()
        self.file.write_json({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                              "shard": self.slot.replace("of", "/"), "expiry_s": self.EXPIRY, "expires": expires})
        self.renewed = started

    def acquire(self, busy: str) -> None:
        """Write this lease, then refuse (deleting it) if an unexpired lease of another layout or of this shard
        exists; expired ones are deleted (taken over)."""
        self._write()
        found = {i.base_name: i for i in self.state.files() if i.base_name.startswith(LEASE)}

        def stamp(info) -> float:
            return info.mtime.timestamp() if info.mtime else time.time()

        now = stamp(found[self.file.name]) if self.file.name in found else time.time()
        for name, info in sorted(found.items()):
            if name == self.file.name:
                continue
            slot = name[len(LEASE):].rsplit("-", 1)[0]
            try:
                other = (self.state / name).read_json()
            except FileNotFoundError:
                continue  # released meanwhile
            left = stamp(info) + float(other.get("expiry_s", self.EXPIRY)) - now
            if left <= 0:
                (self.state / name).unlink(missing_ok=True)  # expired: its run died or stalled; take over
                continue
            if slot == self.slot or slot.split("of")[-1] != str(self.layout):
                self.file.unlink(missing_ok=True)
                what = f" (shard {slot.replace('of', '/')})" if self.layout > 1 or slot != self.slot else ""
                raise OutputError(busy.replace("right now", f"right now{what}") + f" Its lease ({name}: host "
                                  f"{other.get('host')}, pid {other.get('pid')}) expires in {left:.0f} s unless "
                                  "renewed: a run that was killed, or could not delete its lease, stops blocking the "
                                  "folder then.")
        self._thread = threading.Thread(target=self._renew, name="batchjson-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.RENEW_EVERY):
            try:
                if not self.file.exists():
                    self.lost = f"its lease {self.file} was taken over by another run"
                    return
                self._write()
            except BatchjsonError:
                continue  # the store is unreachable for now: check() fails once the lease may have expired

    def check(self) -> None:
        """Refuse to commit without a lease that is certainly still ours."""
        if not self.lost and time.monotonic() - self.renewed > self.EXPIRY:
            self.lost = f"its lease was not renewed for {self.EXPIRY:.0f} s (the store could not be reached)"
        if not self.lost and not self.file.exists():
            self.lost = f"its lease {self.file} was taken over by another run"
        if self.lost:
            raise OutputError(f"this run stopped writing to {self.state.parent}: {self.lost}. Finished units are "
                              "kept; run the same command again to resume (after the other run, if one is going).")

    def release(self) -> str:
        """Stop renewing and delete the lease. Returns what to tell the user when the store refused the delete too
        (the lease then blocks the folder until it expires), else ""."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.file.unlink(missing_ok=True)
        except BatchjsonError:
            return (f" Its lease {self.file} could not be deleted either: until it expires, {self.EXPIRY:.0f} s "
                    "after its last renewal, a run on this folder is refused (saying when it expires).")
        return ""

"""Which units are committed: the run's state folder, for resume and exactly-once."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from batchjson.errors import OutputError, ResumeConflict
from batchjson.spec import JobSpec, IfExists

STATE = "_batchjson"  # leading underscore: Parquet dataset readers (pyarrow, DuckDB globs on *.parquet) skip it


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


class Ledger:
    """The state folder of one output folder: the spec it belongs to, a lock, done markers and the re-queue.

    A unit is done when its marker exists; markers are written after the unit's part files, so a run killed
    in between redoes the unit and overwrites the same file names: nothing is lost and nothing doubles.
    """

    def __init__(self, output: Path, rejects: Path, shard: tuple[int, int] = (0, 1)):
        self.output, self.rejects, self.shard = output, rejects, shard
        self.state = output / STATE
        self.requeue = self.state / "requeue"
        self._lock = None

    def open(self, spec: JobSpec, if_exists: IfExists, fresh: bool = False) -> bool:
        """Claim the folder for this spec; returns True when it resumes an earlier run."""
        spec_file = self.state / "spec.json"
        existing = spec_file.exists()
        if self.shard[1] > 1 and (fresh or if_exists != "resume"):
            raise OutputError(f'--fresh and output.if_exists = "{if_exists}" cannot be used with --shard: shards '
                              f"share {self.output}. Clear the folder once before starting the shards, and run them "
                              'with output.if_exists = "resume".')
        if existing and (fresh or if_exists == "overwrite"):
            self._claim()
            self._clear()
            existing = False
        elif existing and if_exists == "fail":
            raise OutputError(f"{self.output} already holds a run (output.if_exists = \"fail\"). Choose another "
                              "--output, or pass --fresh to start over.")
        elif existing:
            old = json.loads(spec_file.read_text())
            if old["hash"] != spec.hash():
                changes = _diff(old["spec"], json.loads(json.dumps(spec.fingerprint())))
                raise ResumeConflict(f"{self.output} holds a run of a different spec (changed: {'; '.join(changes[:5])}). "
                                     "Rerun with --fresh to discard it and start over, or choose another --output.")
        elif self.output.exists() and any(not p.name.startswith(("_", ".")) for p in self.output.iterdir()):
            raise OutputError(f"{self.output} is not empty and holds no batchjson run. Choose an empty or new folder.")
        for d in (self.output, self.state, self.requeue, self.state / "done", self.rejects):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise OutputError(f"cannot create {d}: {e.strerror}. Check the path and permissions.") from None
        self._claim()
        if not existing:
            tmp = spec_file.with_name(f".tmp-{os.getpid()}-spec.json")  # shards may write it at the same moment
            tmp.write_text(json.dumps({"hash": spec.hash(), "spec": spec.fingerprint()}, indent=1, default=str))
            os.replace(tmp, spec_file)
        return existing

    def _claim(self) -> None:
        """An exclusive lock on this shard of the folder. The kernel drops it when the process dies, so a killed
        run never leaves it stuck. Shards of one job lock separately and share the folder."""
        if self._lock is not None:
            return
        self.state.mkdir(parents=True, exist_ok=True)
        i, n = self.shard
        fd = open(self.state / ("lock" if n == 1 else f"lock-{i}of{n}"), "w")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fd.close()
            raise OutputError(f"another batchjson run is writing to {self.output} (shard {i}/{n}) right now. "
                              "Wait for it to finish, or choose another --output.") from None
        self._lock = fd

    def _clear(self) -> None:
        for folder in (self.output, self.rejects):
            for p in folder.glob("*.parquet"):
                p.unlink()
        for p in self.state.iterdir():
            if not p.name.startswith("lock"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    def done(self, stage: str, key: str) -> bool:
        return (self.state / "done" / f"{stage}-{key}").exists()

    def mark(self, stage: str, key: str) -> None:
        (self.state / "done" / f"{stage}-{key}").touch()

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

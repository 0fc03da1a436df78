"""The server's durable state under --state DIR: uploaded and produced files, batches, and each batch's jobs.

    DIR/serve.lock                  held (flock) by the one server using DIR
    DIR/files/<file id>             a file's bytes
    DIR/files/<file id>.json        its File object: a file exists once this is written
    DIR/batches/<batch id>.json     the Batch object, rewritten at each change of status
    DIR/batches/<batch id>/         the batch's import (openai_batch's folder): its jobs and their output folders

Every write goes to a temporary name in the same folder, is flushed to disk and renamed over the final name, so a
server killed at any moment leaves each file either whole or absent; a temporary left behind is removed at the next
start, as is a file's bytes whose object was never written (an upload cut short).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from batchjson.errors import OutputError

TMP = ".tmp-"  # the prefix of files being written
ID = re.compile(r"(file|batch)[-_][A-Za-z0-9_-]{1,64}")


class NotFound(LookupError):
    """No file or batch of that id: the server answers 404."""


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """`data` as `path`, whole or not at all."""
    tmp = path.with_name(f"{TMP}{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def new_id(prefix: str) -> str:
    """An id that sorts by creation time (nanoseconds, then a random tail): the queue's order, and the lists'."""
    return f"{prefix}{time.time_ns():016x}{uuid.uuid4().hex[:8]}"


class Store:
    """Files and batches under one folder, for one server at a time (a second one on the folder is refused)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        self.files_dir, self.batches_dir = self.root / "files", self.root / "batches"
        try:
            for folder in (self.files_dir, self.batches_dir):
                folder.mkdir(parents=True, exist_ok=True)
            self._lock = (self.root / "serve.lock").open("a+")
        except OSError as e:
            raise OutputError(f"--state {self.root}: cannot be written ({e.strerror}). Give a folder this user may "
                              "write, or create it with the right owner.") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise OutputError(f"--state {self.root}: another batchjson serve uses this folder. Stop it, or give "
                              "each server a folder of its own.") from None
        self._mutex = threading.Lock()  # one writer of a batch's object at a time (the app and the runner)
        self._clean()

    def close(self) -> None:
        self._lock.close()

    def _clean(self) -> None:
        """Remove what a killed server left half written: temporaries, and bytes of files never published."""
        for folder in (self.files_dir, self.batches_dir):
            for path in folder.iterdir():
                if path.name.startswith(TMP):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in self.files_dir.iterdir():
            if path.suffix != ".json" and not path.with_name(f"{path.name}.json").exists():
                path.unlink()
        for path in self.batches_dir.iterdir():  # a batch whose object was never written: its create failed
            if path.is_dir() and not path.with_name(f"{path.name}.json").exists():
                shutil.rmtree(path)

    # files

    def _file_meta(self, file_id: str) -> Path:
        if not ID.fullmatch(file_id):
            raise NotFound(file_id)
        return self.files_dir / f"{file_id}.json"

    def add_file(self, source: BinaryIO | Path, filename: str, purpose: str, file_id: str | None = None,
                 check=None) -> dict:
        """Publish a file: its bytes copied from `source` (a stream, or a finished file of ours, moved), then its
        object. `check(path)` may refuse the bytes (raise) before anything is published."""
        file_id = file_id or new_id("file-")
        path = self.files_dir / file_id
        tmp = self.files_dir / f"{TMP}{file_id}"
        try:
            if isinstance(source, Path):
                os.replace(source, tmp)
            else:
                with tmp.open("wb") as f:
                    shutil.copyfileobj(source, f, 1 << 20)
            size = tmp.stat().st_size
            if check is not None:
                check(tmp)
            with tmp.open("rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
               "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}
        write_atomic(self._file_meta(file_id), json.dumps(obj).encode())
        return obj

    def file(self, file_id: str) -> dict:
        try:
            return json.loads(self._file_meta(file_id).read_bytes())
        except FileNotFoundError:
            raise NotFound(file_id) from None

    def content(self, file_id: str) -> Path:
        self.file(file_id)
        return self.files_dir / file_id

    def files(self) -> list[dict]:
        """Every file, newest first."""
        objs = [json.loads(p.read_bytes()) for p in self.files_dir.glob("*.json") if not p.name.startswith(TMP)]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def delete_file(self, file_id: str) -> None:
        meta = self._file_meta(file_id)
        try:
            meta.unlink()  # first: without its object, the file is gone (and its bytes are cleaned at a start)
        except FileNotFoundError:
            raise NotFound(file_id) from None
        (self.files_dir / file_id).unlink(missing_ok=True)

    # batches

    def _batch_path(self, batch_id: str) -> Path:
        if not ID.fullmatch(batch_id):
            raise NotFound(batch_id)
        return self.batches_dir / f"{batch_id}.json"

    def work(self, batch_id: str) -> Path:
        """The batch's import folder."""
        return self.batches_dir / batch_id

    def batch(self, batch_id: str) -> dict:
        try:
            return json.loads(self._batch_path(batch_id).read_bytes())
        except FileNotFoundError:
            raise NotFound(batch_id) from None

    def batches(self) -> list[dict]:
        """Every batch, newest first."""
        objs = [json.loads(p.read_bytes()) for p in self.batches_dir.glob("*.json") if not p.name.startswith(TMP)]
        return sorted(objs, key=lambda o: (o["created_at"], o["id"]), reverse=True)

    def save(self, batch: dict) -> None:
        write_atomic(self._batch_path(batch["id"]), json.dumps(batch).encode())

    def update(self, batch_id: str, change) -> dict:
        """Read the batch, let `change(batch)` edit it (returning False to leave it), write it; the batch after."""
        with self._mutex:
            batch = self.batch(batch_id)
            if change(batch) is not False:
                self.save(batch)
            return batch

"""The server's durable state under --state DIR: uploaded and produced files, batches, and each batch's jobs.

    DIR/serve.lock                  held (flock) by the one server using DIR
    DIR/files/<file id>             a file's bytes
    DIR/files/<file id>.json        its File object: a file exists once this is written
    DIR/batches/<batch id>.json     the Batch object, rewritten at each change of status
    DIR/batches/<batch id>/         the batch's import (openai_batch's folder): its jobs and their output folders
    DIR/quarantine/                 records that did not parse, set aside (named in the log)

A batch's life is one method per step, as the Batch API names them: add_batch (validating), begin (in_progress),
cancelling, finalizing, end (completed, expired or cancelled) or fail (failed).

Every write goes to a temporary name in the same folder, is flushed to disk and renamed over the final name, so a
server killed at any moment leaves each file either whole or absent; a temporary left behind is removed at the next
start, as is a file's bytes whose object was never written (an upload cut short). A record that does not parse
(cut short by a full disk, edited by hand, a stray file) is moved to DIR/quarantine/ and named in the log; where its
name is a file's or batch's id, an object in the error state takes its place (a failed batch, a file with status
"error"), its message naming the quarantined copy, so the rest of the folder is served and run as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
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
ENDPOINT = "/v1/chat/completions"  # the one endpoint batches run
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# What each kind of record must hold for the server to use it (a record without them is set aside).
REQUIRED = {"file": {"id": str, "created_at": int, "bytes": int, "filename": str, "purpose": str},
            "batch": {"id": str, "created_at": int, "status": str, "expires_at": int, "request_counts": dict}}
log = logging.getLogger("batchjson.serve")


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
        self.quarantine = self.root / "quarantine"
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
        # One writer of a record at a time (the app and the runner); reentrant: a read may set a record aside.
        self._mutex = threading.RLock()
        self._clean()
        self.files(), self.batches()  # set aside, now and in the log, what does not parse

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

    # records

    def _read(self, path: Path, kind: str) -> dict | None:
        """The record at `path` (FileNotFoundError when there is none); one that does not parse is set aside, and
        the error object that takes its place returned (None for a name that is no id)."""
        try:
            return _parsed(path.read_bytes(), path.stem, kind)
        except ValueError:
            with self._mutex:
                try:  # again, alone: another thread may have set it aside meanwhile
                    return _parsed(path.read_bytes(), path.stem, kind)
                except ValueError as e:
                    return self._set_aside(path, kind, str(e))

    def _set_aside(self, path: Path, kind: str, problem: str) -> dict | None:
        self.quarantine.mkdir(exist_ok=True)
        kept = self.quarantine / f"{path.parent.name}-{path.name}.{time.time_ns():x}"
        os.replace(path, kept)
        why = f"its record {path.relative_to(self.root)} did not parse ({problem}); set aside as {kept}"
        log.error("--state %s: %s", self.root, why)
        if not ID.fullmatch(path.stem) or not path.stem.startswith(kind):
            return None
        now = int(time.time())
        if kind == "file":
            body = self.files_dir / path.stem
            obj = {"id": path.stem, "object": "file", "bytes": body.stat().st_size if body.exists() else 0,
                   "created_at": now, "filename": path.stem, "purpose": "batch", "status": "error",
                   "expires_at": None, "status_details": f"This file's record was damaged: {why}."}
        else:
            obj = _batch_object(path.stem, None, None, now, 0, None, None) | {
                "status": "failed", "failed_at": now, "errors": _errors("damaged_record", f"This batch's record "
                                                                         f"was damaged: {why}.")}
        write_atomic(path, json.dumps(obj).encode())
        return obj

    def _records(self, folder: Path, kind: str) -> list[dict]:
        """Every record in `folder`, newest first."""
        objs = []
        for path in folder.glob("*.json"):
            if not path.name.startswith(TMP):
                with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                    objs.append(self._read(path, kind))
        return sorted((o for o in objs if o), key=lambda o: (o["created_at"], o["id"]), reverse=True)

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
            obj = self._read(self._file_meta(file_id), "file")
        except FileNotFoundError:
            obj = None
        if obj is None:
            raise NotFound(file_id)
        return obj

    def content(self, file_id: str) -> Path:
        """The file's bytes; NotFound when they are gone, though its object is kept."""
        self.file(file_id)
        path = self.files_dir / file_id
        if not path.is_file():
            log.error("--state %s: file %s has its object but no bytes (%s is missing)", self.root, file_id, path)
            raise NotFound(file_id)
        return path

    def files(self) -> list[dict]:
        """Every file, newest first."""
        return self._records(self.files_dir, "file")

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
            obj = self._read(self._batch_path(batch_id), "batch")
        except FileNotFoundError:
            obj = None
        if obj is None:
            raise NotFound(batch_id)
        return obj

    def batches(self) -> list[dict]:
        """Every batch, newest first."""
        return self._records(self.batches_dir, "batch")

    def _save(self, batch: dict) -> dict:
        write_atomic(self._batch_path(batch["id"]), json.dumps(batch).encode())
        return batch

    def add_batch(self, batch_id: str, file_id: str, window: str, seconds: int, requests: int,
                  metadata: dict | None, model: str) -> dict:
        """A new batch, validating: imported, waiting its turn."""
        now = int(time.time())
        return self._save(_batch_object(batch_id, file_id, window, now, requests, metadata, model)
                          | {"status": "validating", "expires_at": now + seconds})

    def begin(self, batch_id: str) -> dict:
        """validating -> in_progress (a batch in another state is left as it is)."""
        with self._mutex:
            batch = self.batch(batch_id)
            if batch["status"] != "validating":
                return batch
            return self._save(batch | {"status": "in_progress", "in_progress_at": int(time.time())})

    def cancelling(self, batch_id: str) -> dict:
        """-> cancelling, unless the batch has ended or is cancelling already."""
        with self._mutex:
            batch = self.batch(batch_id)
            if batch["status"] in TERMINAL or batch["status"] == "cancelling":
                return batch
            return self._save(batch | {"status": "cancelling", "cancelling_at": int(time.time())})

    def finalizing(self, batch_id: str, stopped: bool) -> dict:
        """-> finalizing, its files about to be written (a cancelled or expired batch keeps its status)."""
        with self._mutex:
            batch = self.batch(batch_id)
            status = batch["status"] if stopped else "finalizing"
            return self._save(batch | {"status": status,
                                       "finalizing_at": batch.get("finalizing_at") or int(time.time())})

    def end(self, batch_id: str, status: str, output_file_id: str | None, error_file_id: str | None,
            answers: int, failed: int) -> dict:
        """-> completed, expired or cancelled, with its files and counts."""
        with self._mutex:
            batch = self.batch(batch_id)
            return self._save(batch | {"status": status, f"{status}_at": int(time.time()),
                                       "output_file_id": output_file_id, "error_file_id": error_file_id,
                                       "request_counts": {"total": answers + failed, "completed": answers,
                                                          "failed": failed}})

    def fail(self, batch_id: str, code: str, message: str) -> None:
        """-> failed, with the error; a batch gone meanwhile is left gone."""
        with self._mutex:
            with contextlib.suppress(NotFound):
                batch = self.batch(batch_id)
                self._save(batch | {"status": "failed", "failed_at": int(time.time()),
                                    "errors": _errors(code, message)})


def _parsed(data: bytes, name: str, kind: str) -> dict:
    """A record's object; ValueError saying what is wrong with it."""
    obj = json.loads(data)  # a JSONDecodeError is a ValueError
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    wrong = [key for key, kind_ in REQUIRED[kind].items() if not isinstance(obj.get(key), kind_)]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} missing or of the wrong type")
    if obj["id"] != name:
        raise ValueError(f"its id {obj['id']!r} is not its name")
    return obj


def _errors(code: str, message: str) -> dict:
    return {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}


def _batch_object(batch_id: str, file_id: str | None, window: str | None, now: int, requests: int,
                  metadata: dict | None, model: str | None) -> dict:
    return {"id": batch_id, "object": "batch", "endpoint": ENDPOINT, "errors": None,
            "input_file_id": file_id, "completion_window": window, "status": None, "output_file_id": None,
            "error_file_id": None, "created_at": now, "in_progress_at": None, "expires_at": now,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": requests, "completed": 0, "failed": 0}, "metadata": metadata, "model": model}

"""Errors the user can fix. Anything else that escapes is a bug and keeps its traceback."""

from __future__ import annotations

import errno
import os
import shutil


class BatchjsonError(Exception):
    """A problem the user can fix: the message says what went wrong, where, and what to do."""

    exit_code = 2


class SpecError(BatchjsonError):
    """The job spec (TOML) is malformed or names something that does not exist."""


class InputError(BatchjsonError):
    """The input Parquet data cannot be used as the spec describes."""


class OutputError(BatchjsonError):
    """The output folder cannot be written, or holds something this run must not touch."""


class StorageFull(OutputError):
    """The disk (or the quota) that holds the output folder ran out of space while this run wrote a file."""

    @classmethod
    def at(cls, path, error: OSError) -> StorageFull:
        """The error for a write of `path` that failed with `error` (ENOSPC or EDQUOT), with the space left."""
        return cls(f"cannot write {path}: the disk is full ({os.strerror(error.errno)}; {_free(str(path))}). Free "
                   "space on it and run the same command again to resume: committed units are kept, and no part "
                   "of this file was left behind.")


def is_full(error: BaseException) -> bool:
    """Whether an OSError says the disk or the quota is full (pyarrow's OSErrors carry the errno too)."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def _free(path: str) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    while folder != "/" and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "free space unknown"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:.0f} {unit} free" if unit == "bytes" else f"{free:.1f} {unit} free"
        free /= 1024
    return ""


class StorageFault(BatchjsonError):
    """Object storage kept failing (throttling, 5xx, resets, timeouts) after pyarrow's retries: transient, so
    running the same command again resumes. Exit 2, as the other errors a rerun or a fix deals with."""


class ResumeConflict(OutputError):
    """The output folder holds a run of a different spec."""


class EngineError(BatchjsonError):
    """The inference engine cannot be started with this model or these settings."""


class EngineDied(Exception):
    """The engine process died mid-pass. Not the user's to fix: worker.py restarts the engine and re-feeds `in_flight`."""

    def __init__(self, in_flight: list, cause: BaseException | None = None):
        super().__init__(f"the engine died with {len(in_flight)} requests in flight: {cause!r}")
        self.in_flight = in_flight

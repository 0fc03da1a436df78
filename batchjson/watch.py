"""A run seen and steered from outside its process: it keeps its progress file current at each commit (what
`batchjson status` reads), obeys `batchjson cancel`'s marker, and knows its deadline (the queue stops handing out
units then, executors/base.py).

Cancel is the same clean stop as SIGTERM: a thread looks for the marker every CANCEL_POLL seconds (one small read)
and sets the run's stop, so the engine stops at its next step, finished units stay committed, and the rows of
units still open are redone by the next run.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from collections.abc import Iterator

from batchjson.errors import BatchjsonError, SpecError
from batchjson.deadline import parse_deadline
from batchjson.records import Stage
from batchjson.report import RunReport
from batchjson.source import UnitRef
from batchjson.storage import Storage
from batchjson.storage.progress import (ProgressFile, cancel_marker, cancelled, finished, layout_of,
                                        progress_file, progress_files, rate)

CANCEL_POLL = 2.0  # seconds between looks for a cancel marker: how long `batchjson cancel` may take to be obeyed
LOG_EVERY = 60.0  # seconds between progress lines in the log (an Airflow task's log, where no bar shows)
log = logging.getLogger("batchjson")


def resolve_deadline(given: str | None, spec_deadline: str) -> float | None:
    """The run's deadline (time.time()) from --deadline, else output.deadline; None without one. A SpecError
    naming the option or key when it is not a time (an empty --deadline is none), or already past."""
    text, where = (given, "--deadline") if given is not None else (spec_deadline, "output.deadline")
    if given is None and not text:
        return None
    try:
        return parse_deadline(text)
    except ValueError as e:
        raise SpecError(f"{where}: {e}.") from None


class RunWatch:
    """The run's progress file, its cancel marker and its deadline, for the driver (job.py)."""

    def __init__(self, storage: Storage, stop: threading.Event, deadline: float | None):
        self.storage, self.stop, self.deadline = storage, stop, deadline
        self.id = uuid.uuid4().hex[:12]
        self.progress: ProgressFile | None = None
        self.cancel: dict | None = None  # the marker that stopped this run
        self.logged = time.monotonic()
        self._done = threading.Event()

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.time() >= self.deadline

    @contextmanager
    def running(self, refs: dict[str, UnitRef], passes: dict) -> Iterator[None]:
        """From the claim's end to the run's: the progress file says "running", then how the run ended; an
        exception ends it as "failed" with its message. `passes`: the committed records of `refs` tallied by pass
        (storage/survey.py)."""
        self._start(refs, passes)
        try:
            yield
        except BaseException as e:
            self._done.set()
            if self.progress is not None:
                try:
                    self.progress.write("failed", str(e) or type(e).__name__)
                except BatchjsonError:
                    pass  # the store failing is what ended the run: its own message says so
            raise
        finally:
            self._done.set()

    def _start(self, refs: dict[str, UnitRef], passes: dict) -> None:
        storage = self.storage
        i, n = storage.shard
        # An earlier layout's progress files (another --shard N) are not this run's.
        for other in progress_files(storage.state, storage.state.names()):
            if layout_of(other) != n:
                other.unlink(missing_ok=True)
        if n == 1:  # a marker here names runs that are gone: this run holds the whole folder
            cancel_marker(storage.state).unlink(missing_ok=True)
        run = {"id": self.id, "host": socket.gethostname(), "pid": os.getpid(), "shard": f"{i}/{n}",
               "started": round(time.time(), 2), "deadline": self.deadline}
        self.progress = ProgressFile(progress_file(storage.state, storage.shard), run,
                                     sum(r.rows for r in refs.values()), len(refs), passes)
        self.progress.write()
        threading.Thread(target=self._poll, name="batchjson-cancel", daemon=True).start()

    def _poll(self) -> None:
        while not self._done.wait(CANCEL_POLL):
            try:
                marker = cancelled(self.storage.state, self.id)
            except BatchjsonError:
                continue  # the store is unreachable for now: commits will say so
            if marker:
                self.cancel = marker
                self.stop.set()
                return

    def committed(self, record: dict) -> None:
        """A unit's commit was accepted: count its record, as the committing worker handed it over."""
        progress = self.progress
        progress.add(record)
        if time.monotonic() - self.logged >= LOG_EVERY:
            self.logged = time.monotonic()
            done, p1 = finished(progress.passes), progress.passes.get(Stage.FIRST, {}).get("units", 0)
            log.info("progress: %d of %d rows finished, %d/%d units of pass 1, %.1f rows/s", done, progress.rows, p1,
                     progress.units, rate(progress.samples, time.time()) or 0.0)

    def end(self, report: RunReport) -> None:
        """Say how the run ended, in the report and the progress file, while the run still holds the folder."""
        self._done.set()
        left = self.progress.rows - finished(self.progress.passes)
        if self.stop.is_set():
            outcome = "cancelled" if self.cancel else "interrupted"
        else:
            outcome = "deadline" if left and self.expired else "done"
        report.outcome, report.rows_left = outcome, left
        detail = ""
        if self.cancel:
            detail = f"cancelled from {self.cancel.get('host')} (pid {self.cancel.get('pid')})"
            report.note("cancelled", f"{detail} by `batchjson cancel`; rerun to resume")
        elif outcome == "deadline":
            detail = f"{left} rows left at the deadline"
        self.progress.write(outcome, detail)

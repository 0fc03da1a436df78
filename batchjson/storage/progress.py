"""A run's live state in its output folder: the progress file `batchjson status` reads, and the cancel marker.

    OUT/_batchjson/progress-<I>of<N>.json    one per shard of the layout that ran last; rewritten by the run
    OUT/_batchjson/cancel.json               written by `batchjson cancel`, naming the runs it stops

A progress file holds what status shows without reading anything else (one GET per shard, at any number of units):

    {"run": {"id", "host", "pid", "shard": "0/1", "started", "deadline"},   (times: seconds since the epoch, UTC)
     "state": "running" | "ended", "outcome": "" | an Outcome, "detail": "...", "updated": ...,
     "rows": 1000, "units": 125,                                            this shard's input
     "passes": {"p1": {"units", "output", "rejects", "requeue", "requeued_units", "reasons": {...}}, "p2": ...},
     "samples": [[time, rows finished], ...]}                               the last RATE_WINDOW s, for the rate

Counts are the commit records' (storage/commits.py) of this shard's units, folded as each commit lands: they
only grow during a run, and equal what the report tallies at its end. A cancel marker names the run ids it stops:
a run started after it (a new id) never obeys it, whoever left it.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from batchjson.errors import StorageFull
from batchjson.storage.location import Location, writing

# How a run ended: every unit done ("done"), SIGTERM or Ctrl-C ("interrupted"), `batchjson cancel` ("cancelled"),
# its deadline with rows left ("deadline"), or an error that ended it ("failed", the message in "detail").
Outcome = Literal["done", "interrupted", "cancelled", "deadline", "failed"]
PREFIX, CANCEL = "progress-", "cancel.json"
RATE_WINDOW = 300.0  # seconds of samples kept: status's rate is that of the last five minutes
log = logging.getLogger("batchjson")


def progress_file(state: Location, shard: tuple[int, int]) -> Location:
    i, n = shard
    return state / f"{PREFIX}{i}of{n}.json"


def progress_files(state: Location, names: list[str]) -> list[Location]:
    """The progress files among `names`, those of a folder's run state (one per shard of the last layout)."""
    return [state / name for name in sorted(names) if name.startswith(PREFIX) and name.endswith(".json")]


def layout_of(file: Location) -> int | None:
    """The shard count N of a progress file's name ("progress-<I>of<N>.json"); None for another name."""
    _, of, n = file.name.removeprefix(PREFIX).removesuffix(".json").partition("of")
    return int(n) if of and n.isdigit() else None


TALLIED = ("units", "output", "rejects", "requeue", "requeued_units")  # a pass's counts, besides its reasons


def empty_tally() -> dict:
    return dict.fromkeys(TALLIED, 0) | {"reasons": {}}


def add_record(passes: dict, record: dict) -> None:
    """Fold one commit record into `passes` (stage -> tally): units, rows by kind, units that sent rows to pass 2."""
    tally = passes.setdefault(str(record["stage"]), empty_tally())
    tally["units"] += 1
    for kind in ("output", "rejects", "requeue"):
        tally[kind] += record["rows"].get(kind, 0)
    tally["requeued_units"] += bool(record["rows"].get("requeue"))
    add_reasons(tally, record.get("reasons", {}))


def add_tallies(passes: dict, more: dict) -> None:
    """Add the tallies of `more` (stage -> tally, as `add_record` makes them) to those of `passes`; a count an older
    file lacks counts 0."""
    for stage, tally in more.items():
        mine = passes.setdefault(stage, empty_tally())
        for name in TALLIED:
            mine[name] += tally.get(name, 0)
        add_reasons(mine, tally.get("reasons", {}))


def add_reasons(tally: dict, reasons: dict, times: int = 1) -> None:
    """Add these reasons' row counts (`times` over) to a pass's tally."""
    for reason, n in reasons.items():
        tally["reasons"][reason] = tally["reasons"].get(reason, 0) + n * times


def finished(passes: dict) -> int:
    """Rows that reached the output or the rejects (a row waiting for pass 2 has not)."""
    return sum(t["output"] + t["rejects"] for t in passes.values())


def rate(samples: list[list[float]], now: float) -> float | None:
    """Rows finished per second over the samples of the last RATE_WINDOW seconds; None without two of them."""
    recent = [s for s in samples if s[0] >= now - RATE_WINDOW] or samples[-1:]
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return None
    return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])


class ProgressFile:
    """The progress file one run keeps: its counts, written at most every WRITE_EVERY seconds and at its end."""

    WRITE_EVERY = 2.0  # at most one PUT per this many seconds, however fast units commit

    def __init__(self, file: Location, run: dict, rows: int, units: int, passes: dict):
        self.file, self.run, self.rows, self.units, self.passes = file, run, rows, units, passes
        self.samples: list[list[float]] = []
        self.written = 0.0  # time.monotonic() of the last write

    def add(self, record: dict) -> None:
        """A unit committed: count it, and write the file when WRITE_EVERY has passed."""
        add_record(self.passes, record)
        if time.monotonic() - self.written >= self.WRITE_EVERY:
            self.write()

    def join(self, passes: dict) -> None:
        """Records counted late (the survey beside the run, job.py): their tally (`add_record`'s) joins the counts,
        and the samples so far, as their rows were finished before them (the rate stays this run's)."""
        add_tallies(self.passes, passes)
        for sample in self.samples:
            sample[1] += finished(passes)

    def write(self, outcome: Outcome | Literal[""] = "", detail: str = "") -> None:
        now = time.time()
        self.samples = [s for s in self.samples if s[0] >= now - RATE_WINDOW] + [[round(now, 2), finished(self.passes)]]
        try:
            with writing(self.file):
                self.file.write_json({"run": self.run, "state": "ended" if outcome else "running",
                                      "outcome": outcome, "detail": detail, "updated": round(now, 2), "rows": self.rows,
                                      "units": self.units, "passes": self.passes, "samples": self.samples})
        except StorageFull as e:
            # The run's own writes fail on a full disk where it matters (a commit, the report), naming their file;
            # status meanwhile shows the counts last written, which the next write brings up to date.
            log.warning("progress file not written: %s", e)
            return
        self.written = time.monotonic()


def cancel_marker(state: Location) -> Location:
    return state / CANCEL


def write_cancel(state: Location, runs: list[str], host: str, pid: int) -> None:
    """The cancel marker that stops the runs `runs` (their ids), asked for by `host`'s process `pid`."""
    cancel_marker(state).write_json({"runs": runs, "host": host, "pid": pid, "at": round(time.time(), 2)})


def cancelled(state: Location, run_id: str) -> dict | None:
    """The cancel marker when it names this run, else None (none, or one left for another run)."""
    try:
        marker = cancel_marker(state).read_json()
    except (FileNotFoundError, ValueError):
        return None
    return marker if isinstance(marker, dict) and run_id in marker.get("runs", []) else None


"""Proof of exactly once: the input's ids, unit by unit, against the ids in the committed output and rejects,
and every file a reader of the output or rejects folder reads against the commit records.

Reads only id (and reject reason) columns, the run state and a listing of both folders, so it is cheap enough to
end every run. A run checks each unit as it finishes it (`UnitChecks`), so that its end check, or its resume's
after a kill, reads only the units no check read before (see `verify`'s `trusted`); the summary says how many
units it read and how many it took on trust. Memory: one unit's ids, and across units
only the ids the input repeats (see `verify`'s `repeated`).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import pyarrow as pa

from batchjson.ends import run_ends
from batchjson.errors import BatchjsonError, OutputError
from batchjson.records import Stage
from batchjson.source import ParquetSource, UnitRef
from batchjson.storage import Commits, DamagedRecord, Unreadable

SHOWN = 5  # offending ids named per problem


@dataclass
class Verdict:
    """What verify found. `ok`: nothing lost or doubled among committed units; `complete`: and nothing pending."""

    units: int = 0
    committed: int = 0
    pending: int = 0
    output_rows: int = 0
    reject_rows: int = 0
    trusted: int = 0
    """Committed units counted from their records without reading their files (the rest were read)."""
    index_written: str = ""
    """When the check that wrote the index those records came from passed."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def complete(self) -> bool:
        return self.ok and not self.pending

    def to_dict(self) -> dict:
        return {"ok": self.ok, "complete": self.complete, "units": self.units, "committed": self.committed,
                "pending": self.pending, "output_rows": self.output_rows, "reject_rows": self.reject_rows,
                "read": self.committed - self.trusted, "trusted": self.trusted, "index_written": self.index_written,
                "problems": self.problems}

    def summary(self) -> str:
        if not self.ok:
            return "exactly-once check FAILED:\n  " + "\n  ".join(self.problems)
        rows = f"{self.output_rows} output + {self.reject_rows} rejected rows, each input row once"
        # What it read is proven; what it trusted is named with what vouches for it, and what reads it.
        check = (f"the check of {self.index_written} read them" if self.index_written else
                 "this run's check read them as they committed")
        basis = (f": {self.committed - self.trusted} read, {self.trusted} trusted from their commit records, not "
                 f"re-read ({check}, and their files' sizes and times are unchanged); `batchjson verify` reads them"
                 ) if self.trusted else ", all read"
        if self.pending:
            return (f"exactly-once check ok so far: {rows}; {self.pending} of {self.units} units still to do "
                    f"({self.committed} committed{basis})")
        return f"exactly-once check ok: {rows} ({self.units} units{basis})"


def _few(ids) -> str:
    ids = sorted(ids)
    return ", ".join(map(repr, ids[:SHOWN])) + (f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else "")


def verify(commits: Commits, source: ParquetSource, refs: list[UnitRef], id_column: str, repeated: Collection[str],
           trusted: frozenset[str] = frozenset()) -> Verdict:
    """Check every committed unit of the folder against the input (`refs`: the whole input's plan, in file order,
    so one row group's ids are in memory at a time).

    Each unit read must hold exactly its own input rows' ids, so an id can be in two units' files only where the
    input holds it in both: across units only the ids the input holds more than once (`repeated`, the input scan's)
    are counted, not every id of the job.

    The units in `trusted` are counted from their commit records, not read: a run's own end check passes those
    whose files an earlier passing check read, unchanged since (`RunIndex.trusted`), and that hold no repeated
    id.
    No other unit can hold their rows, as each unit read is checked against its own input rows. `batchjson
    verify` trusts none."""
    v = Verdict(units=len(refs), index_written=commits.index.written if trusted else "")
    out_ids: Counter = Counter()  # repeated id -> rows in the output
    outcomes: Counter = Counter()  # repeated id -> rows in output or rejects for another reason than duplicate_id

    def read(stage, key, kind, record) -> list[str] | None:
        columns = [id_column] + (["reason"] if kind == "rejects" else [])
        try:
            table = commits.read_ids(stage, key, kind, columns)
        except FileNotFoundError:
            v.problems.append(f"unit {key}: {record['files'][kind]} is listed in its commit record but missing "
                              "(deleted by hand?). Run the job again: it redoes the unit.")
            return None
        except Unreadable as e:
            v.problems.append(f"unit {key}: {e}, but its commit record lists it (truncated or overwritten?). Run "
                              "the job again: it redoes the unit.")
            return None
        ids = table.column(0).to_pylist()
        if kind == "output":
            if repeated:
                mine = [i for i in ids if i in repeated]
                out_ids.update(mine)
                outcomes.update(mine)
            v.output_rows += len(ids)
        elif kind == "rejects":
            if repeated:
                reasons = table.column(1).to_pylist()
                outcomes.update(i for i, r in zip(ids, reasons) if r != "duplicate_id" and i in repeated)
            v.reject_rows += len(ids)
        return ids

    def record_of(stage: Stage, key: str) -> dict | None:
        try:
            return commits.record(stage, key)
        except DamagedRecord as e:
            v.problems.append(f"unit {key}: {e}. Run the job again: it redoes the unit.")
            return None

    planned = set()
    for ref in refs:
        planned.add(ref.key)
        p1 = record_of(Stage.FIRST, ref.key)
        if p1 is None:
            v.pending += 1
            continue
        v.committed += 1
        if ref.key in trusted:
            v.trusted += 1
            p2 = record_of(Stage.SECOND, ref.key) if "requeue" in p1["files"] else None
            for record in filter(None, (p1, p2)):
                v.output_rows += record["rows"].get("output", 0)
                v.reject_rows += record["rows"].get("rejects", 0)
            v.pending += "requeue" in p1["files"] and p2 is None
            continue
        problems, pending = _check_unit(ref, Counter(source.ids(ref).to_pylist()), p1,
                                        lambda: record_of(Stage.SECOND, ref.key), read)
        v.problems += problems
        v.pending += pending
    for record in commits.records():
        if record["key"] not in planned:
            v.problems.append(f"unit {record['key']} ({record.get('path', '?')}) is committed but no longer in the "
                              "input. Restore the input, or start over with --fresh.")
            planned.add(record["key"])
    twice = [i for i, n in out_ids.items() if n > 1]
    if twice:
        v.problems.append(f"{len(twice)} id(s) written to the output more than once: {_few(twice)}")
    both = [i for i, n in outcomes.items() if n > 1 and i not in twice]
    if both:
        v.problems.append(f"{len(both)} id(s) in both output and rejects (or rejected twice): {_few(both)}")
    for path in commits.stray():
        v.problems.append(f"{path} is read by readers of the folder, but no commit lists it (a copy, or a file of "
                          "another tool): its rows would be read besides the committed ones. Remove it.")
    return v


def _check_unit(ref: UnitRef, expected: Counter, p1: dict, second: Callable[[], dict | None],
                read: Callable[[Stage, str, str, dict], list[str] | None]) -> tuple[list[str], bool]:
    """One unit read: pass 1's files against its input rows' ids (`expected`), pass 2's against the rows pass 1
    re-queued (`second()`: pass 2's record, None while it is not committed); `read` gives a file's ids, or None when
    it cannot be read (and says why). Returns the problems found, and whether pass 2 is pending."""
    got: Counter = Counter()
    requeued, problems = None, []
    for kind in p1["files"]:
        ids = read(Stage.FIRST, ref.key, kind, p1)
        got.update(ids or ())
        if kind == "requeue":
            requeued = Counter(ids or ())
    if got != expected:
        problems.append(f"unit {ref.key} ({ref.file}, rows {ref.offset}-{ref.offset + ref.rows - 1}): pass 1 holds "
                        f"other rows than the input (missing {_few(expected - got) or 'none'}; extra "
                        f"{_few(got - expected) or 'none'})")
    if requeued is None:
        return problems, False
    p2 = second()
    if p2 is None:
        return problems, True
    again: Counter = Counter()
    for kind in p2["files"]:
        again.update(read(Stage.SECOND, ref.key, kind, p2) or ())
    if again != requeued:
        problems.append(f"unit {ref.key}: pass 2 holds other rows than pass 1 re-queued (missing "
                        f"{_few(requeued - again) or 'none'}; extra {_few(again - requeued) or 'none'})")
    return problems, False


class UnitChecks:
    """Each unit checked as a run finishes it (its last pass committed), in a thread beside the run, as the end check
    reads a unit: what passes is vouched for by its records' and files' stamps (`RunIndex.vouch`), so the end check,
    this run's or, through the index, a resume's after a kill, counts it from its records instead of reading it
    again. At 100 million rows the end check of a resume read every unit the killed run had committed: 294 of its
    334 s (BENCHMARKS.md). A unit holding a repeated id is left to the end check, which counts such ids across
    units; one that fails, or cannot be read, is read by the end check, which says what is wrong."""

    def __init__(self, commits: Commits, source: ParquetSource, refs: dict[str, UnitRef], id_column: str,
                 skip: Collection[str] = ()):
        self.commits, self.source, self.refs, self.id_column, self.skip = commits, source, refs, id_column, skip
        self.queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.stop = False
        # Set once the run's survey beside it has answered (start.py's `_Later`): the units finished before wait. Their
        # reads (a whole input row group of ids each) and the survey's listings would otherwise stack into the
        # driver's peak (at 100 million rows the resume's first seconds, BENCHMARKS.md).
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="batchjson-unit-checks", daemon=True)
        self.thread.start()

    def add(self, key: str) -> None:
        if key not in self.skip:
            self.queue.put(key)

    def close(self, wait: bool = True) -> None:
        """Wait for the units handed so far to be checked, or (not `wait`: an interrupted or failed run) check no
        more: the end check reads those."""
        self.stop = not wait
        self.queue.put(None)
        self.go.set()
        if wait:
            self.thread.join()

    def _serve(self) -> None:
        self.go.wait()
        while (key := self.queue.get()) is not None and not self.stop:
            try:
                self._check(key)
            except (OSError, Unreadable, DamagedRecord, BatchjsonError, pa.ArrowException):
                continue  # the end check reads the unit, and says what is wrong
        self.source.drop_ids()  # its row group's ids would stand beside the end check's own

    def _check(self, key: str) -> None:
        commits, ref = self.commits, self.refs[key]
        stamps = commits.stamps(key)  # before the files are read: a file changed since is not vouched for
        p1 = commits.record(Stage.FIRST, key)
        if stamps is None or p1 is None:
            return

        def read(stage: Stage, key: str, kind: str, record: dict) -> list[str]:
            return commits.read_ids(stage, key, kind, [self.id_column]).column(0).to_pylist()

        problems, pending = _check_unit(ref, Counter(self.source.ids(ref).to_pylist()), p1,
                                        lambda: commits.record(Stage.SECOND, key), read)
        if not (problems or pending):
            commits.index.vouch(stamps)


def verify_job(spec, output: str | None = None) -> Verdict:
    """`batchjson verify`: check a job's output folder against its input, without an engine."""
    source, storage = run_ends(spec, output)
    if not storage.spec_file.exists():
        raise OutputError(f"{storage.output} holds no batchjson run (no {storage.spec_file}). Check "
                          "--output.")
    source.check()
    scan = source.scan()
    storage.claim()  # no run may write while the folder is checked (and a killed run's commits are rolled forward)
    try:
        storage.commits.recover()
        problems = []
        try:
            storage.check_inputs(scan.fingerprints, write=False)
        except OutputError as e:
            problems.append(str(e))
        verdict = verify(storage.commits, source, source.plan(), spec.input.id_column, scan.repeated)
        verdict.problems[:0] = problems
        return verdict
    finally:
        storage.close()

"""The driver of a job: check and claim the output folder, plan the units, hand both passes' units to the workers
(in this process, local processes or Ray actors: one path for all), then verify what readers will read and report.

The order of stages lives here and in worker.py: source -> prompts -> engine -> validate -> tables -> storage, in
two passes that run as a pipeline, and the exactly-once check that ends every run.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from tqdm import tqdm

from batchjson.errors import SpecError, StorageFault
from batchjson.executors import Layout, Pool, Queue, local_layout, make_pool
from batchjson.report import NoteCode, PassStats, RunReport, process_age
from batchjson.engine.base import EngineFactory
from batchjson.ends import run_ends
from batchjson.source import ParquetSource
from batchjson.spec import JobSpec
from batchjson.storage import location
from batchjson.storage.survey import survey_units
from batchjson.verify import UnitChecks, verify
from batchjson.watch import RunWatch, resolve_deadline
from batchjson.passes import plan_passes
from batchjson.records import Stage
from batchjson.worker import Worker, serve_replica, signals


FOLD_MIN, FOLD_PARTS = 100, 50  # a part of the index every 100 records read, or 2% of the units if more


class JobRun:
    """One invocation of a job on one output folder (one shard of it)."""

    def __init__(self, spec: JobSpec, output: str | None = None, *, fresh: bool = False,
                 shard: tuple[int, int] = (0, 1), engine_factory: EngineFactory | None = None,
                 progress: bool | None = None, replicas: int | None = None, ray: str | None = None,
                 deadline: str | None = None):
        if engine_factory is None:
            from batchjson.engine import VllmEngines

            engine_factory = VllmEngines()
        self.spec, self.shard, self.engines, self.fresh = spec, shard, engine_factory, fresh
        self.output, self.ray = output, ray  # output: --output, handed to replicas as it was given
        self.replicas = replicas if replicas is not None else spec.model.replicas
        if self.replicas is not None and self.replicas < 1:
            raise SpecError(f"replicas must be at least 1, not {self.replicas}.")
        self.source, self.storage = run_ends(spec, output, shard)
        self.progress = None if progress is None else not progress  # tqdm: None hides the bar off a terminal
        self.stop = threading.Event()
        self.watch = RunWatch(self.storage, self.stop, resolve_deadline(deadline, spec.output.deadline))
        self.owners: dict[str, tuple[str, int]] = {}
        self.second: dict[str, int] = {}  # unit -> its rows waiting for pass 2 at the start (survey_units)
        self.checks: UnitChecks | None = None  # each unit checked as it is finished (verify.py)
        self.passes = plan_passes(spec)

    def run(self) -> RunReport:
        started = self.started = time.monotonic()
        mark = lambda: round(time.monotonic() - started, 2)  # noqa: E731
        retried = Counter(location.RETRIED)
        input_rows = self.source.check()
        self.storage.check_paths(self.spec.input.path)
        if self.spec.speculative.draft_model:
            from batchjson.engine import check_draft

            check_draft(self.spec.model.path, self.spec.speculative.draft_model)
        # A null id fails here, before the output folder is claimed; an unchanged input is not scanned again.
        scan = self.source.scan(self.storage.kept_scan())
        # the local replicas' layout (auto: by the job's rows too); Ray's once connected
        rows = input_rows if self.shard[1] == 1 else sum(r.rows for r in self.source.plan(self.shard))
        layout = None if self.ray else local_layout(self.replicas, self.spec.model, rows)
        storage, commits = self.storage, self.storage.commits
        report = RunReport(self.spec.hash(), input_rows, str(storage.output), str(storage.rejects),
                           max_reject_rate=self.spec.output.max_reject_rate,
                           gpu_hour_price=self.spec.report.gpu_hour_price)
        report.timeline["before_run"] = process_age(started)
        try:  # a failed open (a full disk, a changed spec) drops the folder's locks too
            report.resumed = storage.open(self.spec.hash(), self.spec.fingerprint(), self.spec.output.if_exists,
                                          self.fresh, scan.fingerprints)
            # planned beside the folders' listings that `open` began (Commits.read_index)
            everything = self.source.plan()
            mine = self.source.plan(self.shard) if self.shard[1] > 1 else everything
            self.refs = {r.key: r for r in mine}
            if scan.kept:
                storage.keep_scan(scan.kept)
            if self.shard[1] == 1:  # the records fold into the index as the run goes (storage/index.py)
                commits.index.fold_every = max(FOLD_MIN, len(self.refs) // FOLD_PARTS)
            with signals(self.stop), self._early(layout, report.resumed, scan.repeated) as early:
                # The units no pass hands out are surveyed beside the run (`survey.later`, `_redo`); what a killed run
                # left staged is published as the survey finds it (pass 2's units before they are handed out).
                survey = survey_units(commits, list(self.refs), self.spec.input.id_column, defer=True)
                for key, why in survey.damaged.items():
                    commits.drop(key)
                    report.note("unit-redone", f"unit {key}: {why}; the unit was redone")
                self.second = survey.second
                # A repeated id is processed where it was committed already, else at its first occurrence.
                self.owners = {row_id: next((p for p in places if commits.done(Stage.FIRST, p[0])), places[0])
                               for row_id, places in scan.repeated.items()}
                report.timeline["checked"] = mark()
                # A unit holding a repeated id is read by the end check, as its rows' other occurrences are in other
                # units; every other unit is checked as it is finished, beside the run (verify.py).
                repeats = {key for places in scan.repeated.values() for key, _ in places}
                self.checks = UnitChecks(commits, ParquetSource(self.spec.input, self.spec.prompt.columns),
                                         self.refs, self.spec.input.id_column, repeats)  # a source of its own: a thread
                try:
                    # the progress file says "running", or "failed" and why
                    with self.watch.running(self.refs, survey.passes):
                        todo = self._todo()
                        # its tables go once it has answered; the unit checks wait for it (UnitChecks.go)
                        later, survey.later = _Later(survey.later, self.checks.go), None
                        if not any(todo.values()):  # nothing to hand out before the survey has answered
                            todo[Stage.FIRST] = self._redo(later.take(wait=True), report, todo)
                        if any(todo.values()):
                            with early.pop() if early else self._pool(todo, layout, report.resumed) as pool:
                                self._run_passes(report, todo, pool, later)
                        # A survey that answered after the last hand-out (a stop, the deadline): its damaged units
                        # are uncommitted, left for the next run.
                        self._redo(later.take(wait=True), report, todo, redone=False)
                except BaseException:
                    self.checks.close(wait=False)  # a failing store would keep the failed run (and its lease) here
                    raise
                self.checks.close(wait=not self.stop.is_set())
                report.timeline["passes"] = mark()
                # Units a check read (an earlier passing check, or as they were finished), unchanged since, are
                # counted from their records (verify.py), each read from its file first: the tally counts those too.
                trusted = commits.trusted() - repeats
                report.tally(commits.records())
                verdict = verify(commits, self.source, everything, self.spec.input.id_column, scan.repeated, trusted)
                report.timeline["verified"] = mark()
                if not (self.stop.is_set() or self.watch.expired) and self.shard[1] == 1 and verdict.pending \
                        and verdict.ok:
                    verdict.problems.append(f"[internal] {verdict.pending} units left undone by an uninterrupted run")
                if verdict.ok and self.shard[1] == 1:
                    commits.index.write()
                else:
                    commits.index.fold(now=True)
                report.verified = verdict.to_dict()
                report.verified_summary = verdict.summary()
                self.watch.end(report)
        except StorageFault as e:  # the store failing: its lease may stay behind, and then a rerun must wait
            raise StorageFault(f"{e}{storage.close()}") from None
        finally:
            storage.close()
        report.interrupted = self.stop.is_set()
        report.storage_retries = dict((location.RETRIED - retried).most_common())
        report.seconds = round(time.monotonic() - started, 2)
        storage.write_report(report.to_dict())
        return report

    def _todo(self) -> dict[Stage, list[str]]:
        """The units each pass has left, found in storage (so a rerun resumes either pass): from the one listing of
        the records the run took once it held the folder (Commits.listed), as no other run commits this shard's
        units meanwhile. A unit not listed is not looked up on its own: on object storage that was a HEAD and a
        LIST per unit before the first prompt (3,118 requests for a first run of 1,000 units, BENCHMARKS.md)."""
        commits = self.storage.commits
        todo = {Stage.FIRST: commits.left(Stage.FIRST, self.refs)}
        if len(self.passes) > 1:  # the start's survey found them (survey_units): no record is looked up again
            todo[Stage.SECOND] = [k for k in self.refs if k in self.second]
        return todo

    @contextmanager
    def _early(self, layout: Layout | None, resumed: bool, repeated: dict) -> Iterator[list[Pool]]:
        """The local replicas started before the survey, where pass 1 has units left (so the pool will be used) and
        nothing the survey finds changes how they are laid out or what they are handed at their start (a layout
        given, or a first run's; no repeated ids, whose owners the survey's drops decide): their start (spawned
        processes importing) goes on beside the survey. Yields [the pool] or []: the passes take it out
        (`pop`) and close it; one not taken is stopped. (The units left are looked for from the end: the last units
        are the ones a killed run had not reached.)"""
        commits, early = self.storage.commits, []
        if layout is not None and len(layout.placements) > 1 and (self.replicas is not None or not resumed) \
                and not repeated and any(not commits.listed(Stage.FIRST, key) for key in reversed(self.refs)):
            early.append(self._pool({}, layout, resumed))
        try:
            yield early
        finally:
            for pool in early:  # not taken: an error before the passes
                pool.stop()
                pool.close()

    def _redo(self, later: tuple[dict[str, str], dict] | None, report: RunReport, todo: dict[Stage, list[str]],
              redone: bool = True) -> list[str]:
        """The survey beside the run has answered (`Survey.later`): the others' records join the progress file's
        counts, and the units it found damaged, which no pass had been handed, are uncommitted, each named in the
        report. Returns them, for pass 1 (`redone`; else the next run redoes them)."""
        damaged, passes = later or ({}, {})
        if passes:
            self.watch.progress.join(passes)
        keys = [key for key in damaged if key in self.refs]
        commits = self.storage.commits
        for key in keys:
            commits.drop(key)
            self.second.pop(key, None)
            report.note("unit-redone", f"unit {key}: {damaged[key]}; the unit was "
                        + ("redone" if redone else "uncommitted for the next run to redo"))
        return [*todo.get(Stage.FIRST, []), *keys] if redone else keys

    def _left(self, todo: dict[Stage, list[str]]) -> dict[Stage, int]:
        """The rows each pass has left to decode."""
        left = {Stage.FIRST: sum(self.refs[k].rows for k in todo[Stage.FIRST])}
        if todo.get(Stage.SECOND):
            left[Stage.SECOND] = sum(self.second[k] for k in todo[Stage.SECOND])
        return left

    def _pool(self, todo: dict[Stage, list[str]], layout: Layout | None, resumed: bool) -> Pool:
        """Where the passes run (executors.make_pool): in this process, local replicas or Ray actors, one body for
        all. A resumed run with replicas_per_gpu "auto" lays its replicas out by the rows it has left."""
        if layout is not None and resumed and self.replicas is None:
            layout = local_layout(None, self.spec.model, sum(self._left(todo).values()))
        first = todo.get(Stage.FIRST)  # none yet before the survey (`_early`): the units not committed
        left = sum(self.refs[k].rows for k in (self.storage.commits.left(Stage.FIRST, self.refs) if first is None
                                                 else first))
        worker = lambda channel: Worker(self.spec, self.storage, self.source, self.refs, self.owners,  # noqa: E731
                                        self.engines, self.stop, started=self.started, left=left).serve(channel)
        args = (self.spec, self.output, self.shard, self.engines, self.owners, self.source.stamps, left)
        return make_pool(layout, worker, serve_replica, args, self.ray, self.replicas, self.spec.model)

    def _run_passes(self, report: RunReport, todo: dict[Stage, list[str]], pool: Pool, later: _Later) -> None:
        """Both passes through one queue, on the pool it is handed: the same worker body wherever it runs. The queue
        stays open until the survey beside the run has answered (`_Later`); the damaged units it finds join pass 1."""
        work = _Checked(todo, {Stage.FIRST: Stage.SECOND} if len(self.passes) > 1 else {},
                        lambda: self.watch.expired, later, lambda answer: self._redo(answer, report, {}))
        stats = {p.stage: PassStats() for p in self.passes}
        bars: dict[Stage, tqdm] = {}

        def bar(stage: Stage) -> tqdm:
            if stage not in bars:
                bars[stage] = tqdm(total=0, desc=stage.label, unit="row", disable=self.progress, position=len(bars))
            return bars[stage]

        for stage, rows in self._left(todo).items():
            bar(stage).total = rows

        def added(keys: list[str]) -> None:  # damaged units the survey beside the run found, redone by pass 1
            bar(Stage.FIRST).total += sum(self.refs[k].rows for k in keys)
            bar(Stage.FIRST).refresh()

        work.added = added

        def on_done(stage: Stage, key: str, rows: int, requeued: int) -> None:
            self.watch.committed(stage, key)
            if stage == Stage.SECOND or not requeued or Stage.SECOND not in stats:  # the unit is finished
                self.checks.add(key)
            self.storage.commits.index.fold()
            bar(stage).update(rows)
            if requeued and stage == Stage.FIRST and Stage.SECOND in stats:
                bar(Stage.SECOND).total += requeued
                bar(Stage.SECOND).refresh()

        def on_stats(counts: dict) -> None:
            for stage, d in counts.items():
                stats[stage].merge(d)

        def on_note(stage: str, code: NoteCode, text: str) -> None:
            stats[stage].note = "; ".join(filter(None, (stats[stage].note, stats[stage].event(code, text))))

        try:
            report.lay_out(pool.layout)
            pool.drive(work, self.stop, on_done, on_stats, on_note)
        finally:
            for b in bars.values():
                b.close()
            for p in self.passes:
                s = stats[p.stage]
                if p.stage in work.first_handed or s.rows or s.engine_starts:
                    s.seconds = work.seconds(p.stage)
                    s.replicas = report.replicas
                    report.passes[p.stage.label] = s


class _Later:
    """The survey of the units no pass hands out (`Survey.later`) on a thread of its own, started once the first
    unit is handed out (`start`): its listings would otherwise take the cores the replicas start on. `take` gives
    its answer once (the damaged units, the others' tally), then None. `answered` is set once it has answered (or
    there is nothing to survey)."""

    def __init__(self, check: Callable[[], tuple[dict[str, str], dict]] | None, answered: threading.Event):
        self.check, self.future, self.answered = check, None, answered
        if check is None:
            answered.set()

    def start(self) -> None:
        if self.check is not None and self.future is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="batchjson-survey")
            self.future = pool.submit(self.check)
            self.future.add_done_callback(lambda _: self.answered.set())
            pool.shutdown(wait=False)

    def take(self, wait: bool = False) -> tuple[dict[str, str], dict] | None:
        """The check's answer if it has come (`wait`: started if it was not, once it has), the first time asked; a
        failure raises here."""
        if wait:
            self.start()
        future = self.future
        if future is None or not (wait or future.done()):
            return None
        self.check, self.future = None, None
        return future.result()

    @property
    def pending(self) -> bool:
        return self.check is not None


class _Checked(Queue):
    """The run's queue, open until the survey beside the run has answered (`_Later`): till then a worker that finds
    nothing to do waits rather than ends; the units it finds damaged are uncommitted (`redo`) and join pass 1. Its
    answer is taken in the driver's thread, between hand-outs; the units it surveys are none of those handed out
    (they are committed, and wait for no pass), so none is dropped while a worker holds it."""

    def __init__(self, todo: dict[Stage, list[str]], follows: dict[Stage, Stage], expired: Callable[[], bool],
                 later: _Later, redo: Callable[[tuple[dict[str, str], dict]], list[str]]):
        super().__init__(todo, follows, expired)
        self.later, self.redo = later, redo
        self.added: Callable[[list[str]], None] = lambda keys: None  # the progress bar's total grows by their rows

    def _settled(self) -> bool:
        """Whether the survey has answered, its damaged units queued for pass 1."""
        answer = self.later.take()
        keys = self.redo(answer) if answer is not None else []
        if keys:
            with self.lock:
                self.pending.setdefault(Stage.FIRST, deque()).extend(keys)
                self.left.update((Stage.FIRST, key) for key in keys)
            self.added(keys)
        return not self.later.pending

    def want(self, slot: int, stages: Iterable[str]) -> tuple:
        settled = self._settled()
        reply = super().want(slot, stages)
        if reply[0] == "unit" or not self.left:
            self.later.start()
        return ("idle", False) if reply[0] == "end" and not settled and not self.expired() else reply

    @property
    def finished(self) -> bool:
        settled = self._settled()  # first: the units it queues are left to do
        return super().finished and (settled or self.expired())


def run_job(spec: JobSpec, output: str | None = None, **kwargs) -> RunReport:
    """Run (or resume) a job; returns the report, also written to <output>/_report.json."""
    return JobRun(spec, output, **kwargs).run()

"""The run's start, as one thing: check the input and claim the output folder, plan the units and survey what is
committed of them (the units no pass hands out surveyed later, beside the passes), check each unit as it is
finished, and the pool the passes run on, started early beside the survey where nothing the survey finds changes it.

The pieces of the start that run beside the run each get their thread here, and meet here: the survey beside the
run (`_Later`), once it has answered, lets the unit checks begin (`UnitChecks.go`), and holds the passes' queue open
until then (`OpenQueue`); the units it finds damaged join pass 1 through the queue's `add`. The driver (job.py) reads
the start as its steps (`check`, `claim`, `plan`, `pool`); the unit checks run beside the passes (`checking`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from batchjson.engine.base import EngineFactory
from batchjson.executors import Layout, Pool, Queue, local_layout, make_pool
from batchjson.records import Stage
from batchjson.passes import plan_passes
from batchjson.report import RunReport
from batchjson.source import InputScan, ParquetSource, UnitRef
from batchjson.spec import JobSpec
from batchjson.storage import Storage
from batchjson.storage.survey import survey_units
from batchjson.verify import UnitChecks
from batchjson.watch import RunWatch
from batchjson.worker import Worker, serve_replica

FOLD_MIN, FOLD_PARTS = 100, 50  # a part of the index every 100 records read, or 2% of the units if more

Later = tuple[dict[str, str], dict]  # the survey beside the run's answer: the damaged units, the others' tally


@dataclass
class Start:
    """The start of one run on one output folder (one shard of it), in its order: `check` (the input, before
    anything is claimed), `claim`, `plan` (the units, and the survey of what is committed of them), `pool` (the
    passes' pool and queue); and what it found on the way."""

    spec: JobSpec
    source: ParquetSource
    storage: Storage
    watch: RunWatch
    stop: threading.Event
    engines: EngineFactory
    output: str | None  # --output, handed to replicas as it was given
    shard: tuple[int, int]
    replicas: int | None
    ray: str | None
    started: float  # time.monotonic() at the run's start: the workers' first_request_s counts from it
    # What the start finds, step by step:
    scan: InputScan | None = field(default=None, init=False)
    """The input's fingerprints and repeated ids (`check`)."""
    layout: Layout | None = field(default=None, init=False)
    """The local replicas' layout (`check`); None for Ray's, laid out once connected."""
    resumed: bool = field(default=False, init=False)
    """Whether the run resumes an earlier one (`claim`)."""
    everything: list[UnitRef] = field(default_factory=list, init=False)
    """The units of every shard (`plan`): the end check reads the whole folder."""
    refs: dict[str, UnitRef] = field(default_factory=dict, init=False)
    """This shard's units (`plan`)."""
    owners: dict[str, tuple[str, int]] = field(default_factory=dict, init=False)
    """Repeated id -> the unit and row that process it (`plan`)."""
    second: dict[str, int] = field(default_factory=dict, init=False)
    """Unit -> its rows waiting for pass 2 (`plan`, survey_units)."""
    tally: dict = field(default_factory=dict, init=False)
    """The committed records of `refs` tallied by pass (`plan`): the progress file's counts at the start."""
    repeats: set[str] = field(default_factory=set, init=False)
    """The units holding a repeated id (`plan`): the end check reads them, their ids' other occurrences being in
    other units."""
    checks: UnitChecks | None = field(default=None, init=False)
    """Each unit checked as it is finished, beside the passes (`plan`, `checking`)."""
    later: _Later | None = field(default=None, init=False)
    """The survey of the units no pass hands out, beside the passes (`plan`)."""
    early: list[Pool] = field(default_factory=list, init=False)
    """[the pool started before the survey] or [] (`plan`, `_early`): `pool` takes it."""
    todo: dict[Stage, list[str]] = field(default_factory=dict, init=False)
    """The units each pass had left when the passes began (`pool`)."""
    queue: OpenQueue | None = field(default=None, init=False)
    """The passes' queue (`pool`)."""

    def __post_init__(self):
        self.follows = {Stage.FIRST: Stage.SECOND} if len(plan_passes(self.spec)) > 1 else {}

    # -- claim ------------------------------------------------------------------------------------------------

    def check(self) -> int:
        """Before the folder is claimed: the input (its rows, returned), the folder's paths, the draft model, and the
        input's ids (a null id fails here; an unchanged input is not scanned again); the local replicas' layout
        (auto: by the job's rows too; Ray's once connected)."""
        spec, source = self.spec, self.source
        input_rows = source.check()
        self.storage.check_paths(spec.input.path)
        if spec.speculative.draft_model:
            from batchjson.engine import check_draft

            check_draft(spec.model.path, spec.speculative.draft_model)
        self.scan = source.scan(self.storage.kept_scan())
        rows = input_rows if self.shard[1] == 1 else sum(r.rows for r in source.plan(self.shard))
        self.layout = None if self.ray else local_layout(self.replicas, spec.model, rows)
        return input_rows

    def claim(self, fresh: bool) -> bool:
        """Claim the output folder for this spec (a failed claim, a changed spec, is the user's to fix); whether
        the run resumes an earlier one."""
        spec = self.spec
        self.resumed = self.storage.open(spec.hash(), spec.fingerprint(), spec.output.if_exists, fresh,
                                         self.scan.fingerprints)
        return self.resumed

    # -- plan -------------------------------------------------------------------------------------------------

    def plan(self, report: RunReport) -> None:
        """The units, planned beside the folders' listings that the claim began (Commits.read_index), and what is
        committed of them: the units pass 2 hands out surveyed now, the rest beside the run (`_Later`). What a
        killed run left staged is published as the survey finds it (pass 2's units before they are handed out); a
        damaged unit is uncommitted and redone, named in the report. The local replicas start beside the survey
        where they can (`_early`)."""
        storage, commits, scan = self.storage, self.storage.commits, self.scan
        self.everything = self.source.plan()
        mine = self.source.plan(self.shard) if self.shard[1] > 1 else self.everything
        self.refs = {r.key: r for r in mine}
        if scan.kept:
            storage.keep_scan(scan.kept)
        if self.shard[1] == 1:  # the records fold into the index as the run goes (storage/index.py)
            commits.index.fold_every = max(FOLD_MIN, len(self.refs) // FOLD_PARTS)
        self._early()
        survey = survey_units(commits, list(self.refs), self.spec.input.id_column, defer=True)
        for key, why in survey.damaged.items():
            commits.drop(key)
            report.note("unit-redone", f"unit {key}: {why}; the unit was redone")
        self.second, self.tally = survey.second, survey.passes
        # A repeated id is processed where it was committed already, else at its first occurrence.
        self.owners = {row_id: next((p for p in places if commits.done(Stage.FIRST, p[0])), places[0])
                       for row_id, places in scan.repeated.items()}
        # A unit holding a repeated id is read by the end check; every other unit is checked as it is finished,
        # beside the run (verify.py), once the survey beside the run has answered (`UnitChecks.go`).
        self.repeats = {key for places in scan.repeated.values() for key, _ in places}
        self.checks = UnitChecks(commits, ParquetSource(self.spec.input, self.spec.prompt.columns),
                                 self.refs, self.spec.input.id_column, self.repeats)  # a source of its own: a thread
        self.later = _Later(survey.later, self.checks.go)

    def _early(self) -> None:
        """The local replicas started before the survey, where pass 1 has units left (so the pool will be used) and
        nothing the survey finds changes how they are laid out or what they are handed at their start (a layout
        given, or a first run's; no repeated ids, whose owners the survey's drops decide): their start (spawned
        processes importing) goes on beside the survey. The passes take the pool (`pool`); one not taken is stopped
        (`close`). (The units left are looked for from the end: the last units are the ones a killed run had not
        reached.)"""
        layout, commits = self.layout, self.storage.commits
        if layout is not None and len(layout.placements) > 1 and (self.replicas is not None or not self.resumed) \
                and not self.scan.repeated \
                and any(not commits.listed(Stage.FIRST, key) for key in reversed(self.refs)):
            self.early.append(self._pool(None))

    # -- pool -------------------------------------------------------------------------------------------------

    @contextmanager
    def pool(self, report: RunReport) -> Iterator[Pool | None]:
        """The pool the passes run on, with their queue (`queue`) of the units each pass has left: the early pool,
        else one started now; None when nothing is left to hand out (the survey beside the run has answered then)."""
        todo = self._todo()
        if not any(todo.values()):  # nothing to hand out before the survey has answered
            todo[Stage.FIRST] = self._redo(self.later.take(wait=True), report, todo)
        self.todo = todo
        if not any(todo.values()):
            yield None
            self._settle(report)
            return
        self.queue = OpenQueue(todo, self.follows,
                               lambda: self.watch.expired, self.later, lambda answer: self._redo(answer, report, {}))
        with self.early.pop() if self.early else self._pool(todo) as pool:
            yield pool
        self._settle(report)

    def _settle(self, report: RunReport) -> None:
        """After the passes: a survey that answered after the last hand-out (a stop, the deadline) has its damaged
        units uncommitted, left for the next run."""
        self._redo(self.later.take(wait=True), report, {}, redone=False)

    @contextmanager
    def checking(self) -> Iterator[None]:
        """Each unit checked as it is finished, beside the passes (`checks`): those handed so far are checked at the
        end, or none more after a stop or a failure (the end check reads them)."""
        try:
            yield
        except BaseException:
            self.checks.close(wait=False)  # a failing store would keep the failed run (and its lease) here
            raise
        self.checks.close(wait=not self.stop.is_set())

    def __enter__(self) -> Start:
        return self

    def __exit__(self, *exc) -> None:
        """An early pool the passes did not take (an error before them) is stopped."""
        while self.early:
            pool = self.early.pop()
            pool.stop()
            pool.close()

    def left(self, todo: dict[Stage, list[str]] | None = None) -> dict[Stage, int]:
        """The rows each pass has left to decode (of `todo`, else of the queue's units at its start)."""
        todo = self.todo if todo is None else todo
        left = {Stage.FIRST: sum(self.refs[k].rows for k in todo[Stage.FIRST])}
        if todo.get(Stage.SECOND):
            left[Stage.SECOND] = sum(self.second[k] for k in todo[Stage.SECOND])
        return left

    def _todo(self) -> dict[Stage, list[str]]:
        """The units each pass has left, found in storage (so a rerun resumes either pass): from the one listing of
        the records the run took once it held the folder (Commits.listed), as no other run commits this shard's
        units meanwhile. A unit not listed is not looked up on its own: on object storage that was a HEAD and a
        LIST per unit before the first prompt (3,118 requests for a first run of 1,000 units, BENCHMARKS.md)."""
        commits = self.storage.commits
        todo = {Stage.FIRST: commits.left(Stage.FIRST, self.refs)}
        if self.follows:  # the start's survey found them (survey_units): no record is looked up again
            todo[Stage.SECOND] = [k for k in self.refs if k in self.second]
        return todo

    def _redo(self, later: Later | None, report: RunReport, todo: dict[Stage, list[str]],
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

    def _pool(self, todo: dict[Stage, list[str]] | None) -> Pool:
        """Where the passes run (executors.make_pool): in this process, local replicas or Ray actors, one body for
        all. A resumed run with replicas_per_gpu "auto" lays its replicas out by the rows it has left. `todo` None
        (the early pool, before the survey): pass 1's units are those not committed."""
        layout = self.layout
        if layout is not None and self.resumed and self.replicas is None:
            layout = local_layout(None, self.spec.model, sum(self.left(todo).values()))
        first = self.storage.commits.left(Stage.FIRST, self.refs) if todo is None else todo[Stage.FIRST]
        left = sum(self.refs[k].rows for k in first)
        worker = lambda channel: Worker(self.spec, self.storage, self.source, self.refs, self.owners,  # noqa: E731
                                        self.engines, self.stop, started=self.started, left=left).serve(channel)
        args = (self.spec, self.output, self.shard, self.engines, self.owners, self.source.stamps, left)
        return make_pool(layout, worker, serve_replica, args, self.ray, self.replicas, self.spec.model)


class _Later:
    """The survey of the units no pass hands out (`Survey.later`) on a thread of its own, started once the first
    unit is handed out (`start`): its listings would otherwise take the cores the replicas start on. `take` gives
    its answer once (the damaged units, the others' tally), then None. `answered` is set once it has answered (or
    there is nothing to survey): the unit checks wait for it (`UnitChecks.go`)."""

    def __init__(self, check: Callable[[], Later] | None, answered: threading.Event):
        self.check, self.future, self.answered = check, None, answered
        if check is None:
            answered.set()

    def start(self) -> None:
        if self.check is not None and self.future is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="batchjson-survey")
            self.future = pool.submit(self.check)
            self.future.add_done_callback(lambda _: self.answered.set())
            pool.shutdown(wait=False)

    def take(self, wait: bool = False) -> Later | None:
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


class OpenQueue(Queue):
    """The run's queue, open until the survey beside the run has answered (`_Later`): till then a worker that finds
    nothing to do waits rather than ends; the units it finds damaged are uncommitted (`redo`) and join pass 1
    (`Queue.add`). Its answer is taken in the driver's thread, between hand-outs; the units it surveys are none of
    those handed out (they are committed, and wait for no pass), so none is dropped while a worker holds it."""

    def __init__(self, todo: dict[Stage, list[str]], follows: dict[Stage, Stage], expired: Callable[[], bool],
                 later: _Later, redo: Callable[[Later], list[str]]):
        super().__init__(todo, follows, expired)
        self.later, self.redo = later, redo
        self.added: Callable[[list[str]], None] = lambda keys: None  # the progress bar's total grows by their rows

    def _settled(self) -> bool:
        """Whether the survey has answered, its damaged units queued for pass 1."""
        answer = self.later.take()
        keys = self.redo(answer) if answer is not None else []
        if keys:
            self.add(Stage.FIRST, keys)
            self.added(keys)
        return not self.later.pending

    def want(self, slot: int, stages: Iterable[str], take: bool = True) -> tuple:
        settled = self._settled()
        reply = super().want(slot, stages, take)
        if reply[0] != "idle":  # a unit handed out, or none left: the survey's listings no longer slow a start
            self.later.start()
        return ("idle", False) if reply[0] == "end" and not settled and not self.expired() else reply

    @property
    def finished(self) -> bool:
        settled = self._settled()  # first: the units it queues are left to do
        return super().finished and (settled or self.expired())

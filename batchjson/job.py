"""The driver of a job: claim the output folder and plan the units (start.py), hand both passes' units to the
workers on the start's pool (in this process, local processes or Ray actors: one path for all), then verify what
readers will read, keep the index, and report.

The order of stages lives here and in worker.py: source -> prompts -> engine -> validate -> tables -> storage, in
two passes that run as a pipeline, and the exactly-once check that ends every run.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from tqdm import tqdm

from batchjson.engine.base import EngineFactory
from batchjson.ends import run_ends
from batchjson.errors import SpecError, StorageFault
from batchjson.executors import Pool
from batchjson.passes import plan_passes
from batchjson.records import Stage
from batchjson.report import NoteCode, PassStats, RunReport, process_age
from batchjson.spec import JobSpec
from batchjson.start import Start
from batchjson.storage import location
from batchjson.verify import Verdict, verify
from batchjson.watch import RunWatch, resolve_deadline
from batchjson.worker import signals


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
        self.passes = plan_passes(spec)

    def run(self) -> RunReport:
        """The run, in its order: claim -> plan -> pool -> passes -> verify -> index -> report."""
        self.started, retried = time.monotonic(), Counter(location.RETRIED)
        start = Start(self.spec, self.source, self.storage, self.watch, self.stop, self.engines, self.output,
                      self.shard, self.replicas, self.ray, self.started)
        report = RunReport(self.spec.hash(), start.check(), str(self.storage.output), str(self.storage.rejects),
                           max_reject_rate=self.spec.output.max_reject_rate,
                           gpu_hour_price=self.spec.report.gpu_hour_price)
        report.timeline["before_run"] = process_age(self.started)
        try:  # a failed claim (a full disk, a changed spec) drops the folder's locks too
            report.resumed = start.claim(self.fresh)
            with signals(self.stop), start:
                start.plan(report)
                report.timeline["checked"] = self._mark()
                # the progress file says "running", or "failed" and why; units are checked as they are finished
                with start.checking(), self.watch.running(start.refs, start.tally), start.pool(report) as pool:
                    if pool is not None:
                        self._run_passes(report, start, pool)
                report.timeline["passes"] = self._mark()
                verdict = self._verify(report, start)
                report.timeline["verified"] = self._mark()
                self._index(verdict)
                self.watch.end(report)
        except StorageFault as e:  # the store failing: its lease may stay behind, and then a rerun must wait
            raise StorageFault(f"{e}{self.storage.close()}") from None
        finally:
            self.storage.close()
        return self._report(report, retried)

    def _mark(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def _report(self, report: RunReport, retried: Counter) -> RunReport:
        """The report's last lines, written beside the output (`<output>/_report.json`) once the folder is let go."""
        report.interrupted = self.stop.is_set()
        report.storage_retries = dict((location.RETRIED - retried).most_common())
        report.seconds = round(time.monotonic() - self.started, 2)
        self.storage.write_report(report.to_dict())
        return report

    def _verify(self, report: RunReport, start: Start) -> Verdict:
        """The exactly-once check of the whole folder. Units a check read (an earlier passing check, or as they
        were finished), unchanged since, are counted from their records (verify.py), each read from its file first:
        the tally counts those too."""
        commits = self.storage.commits
        trusted = commits.trusted() - start.repeats
        report.tally(commits.records())
        verdict = verify(commits, self.source, start.everything, self.spec.input.id_column, start.scan.repeated,
                         trusted)
        if not (self.stop.is_set() or self.watch.expired) and self.shard[1] == 1 and verdict.pending and verdict.ok:
            verdict.problems.append(f"[internal] {verdict.pending} units left undone by an uninterrupted run")
        report.verified = verdict.to_dict()
        report.verified_summary = verdict.summary()
        return verdict

    def _index(self, verdict: Verdict) -> None:
        """A passing check of the whole folder writes the index afresh; else the records read since its last part
        are folded into one more (storage/index.py)."""
        if verdict.ok and self.shard[1] == 1:
            self.storage.commits.index.write()
        else:
            self.storage.commits.index.fold(now=True)

    def _run_passes(self, report: RunReport, start: Start, pool: Pool) -> None:
        """Both passes through the start's queue, on the pool it is handed: the same worker body wherever it runs.
        The queue stays open until the survey beside the run has answered; the damaged units it finds join pass 1."""
        work = start.queue
        stats = {p.stage: PassStats() for p in self.passes}
        bars: dict[Stage, tqdm] = {}

        def bar(stage: Stage) -> tqdm:
            if stage not in bars:
                bars[stage] = tqdm(total=0, desc=stage.label, unit="row", disable=self.progress, position=len(bars))
            return bars[stage]

        for stage, rows in start.left().items():
            bar(stage).total = rows

        def added(keys: list[str]) -> None:  # damaged units the survey beside the run found, redone by pass 1
            bar(Stage.FIRST).total += sum(start.refs[k].rows for k in keys)
            bar(Stage.FIRST).refresh()

        work.added = added

        def on_done(record: dict) -> None:
            stage, key, rows = record["stage"], record["key"], record["rows"]
            requeued = rows.get("requeue", 0)
            self.storage.commits.received(record)
            self.watch.committed(record)
            if stage == Stage.SECOND or not requeued or Stage.SECOND not in stats:  # the unit is finished
                start.checks.add(key)
            self.storage.commits.index.fold()
            bar(stage).update(sum(rows.values()))
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


def run_job(spec: JobSpec, output: str | None = None, **kwargs) -> RunReport:
    """Run (or resume) a job; returns the report, also written to <output>/_report.json."""
    return JobRun(spec, output, **kwargs).run()

"""The one place that knows the stage order: source -> prompts -> engine -> validate -> sink, in two passes."""

from __future__ import annotations

import signal
import threading
import time
from itertools import chain
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from batchjson.errors import EngineDied, EngineError, SpecError
from batchjson.ledger import Ledger
from batchjson.prompts import Renderer
from batchjson.records import Generation, Outcome, Prompt
from batchjson.report import PassStats, RunReport
from batchjson.sink import PartSink, write_atomic
from batchjson.source import ParquetSource
from batchjson.spec import DecodingSpec, JobSpec, SpeculativeSpec
from batchjson.validate import Validator

# Failures that another pass with the same model cannot fix: they go straight to rejects.
FINAL_REASONS = {"empty_prompt", "prompt_too_long", "duplicate_id"}
# Engine deaths in one pass before speculation is switched off for the rest of it (grammar/speculation desyncs
# have killed engines in recent vLLM releases), and before the pass gives up without speculation.
DEATHS_BEFORE_NO_SPECULATION = 2
DEATHS_BEFORE_GIVING_UP = 3
# A row in flight at this many engine deaths is taken for the cause and fails with engine_error.
DEATHS_PER_ROW = 2

# A unit of work on its way into a pass: its key, and a function that makes its rows (called once the engine is up).
Unit = tuple[str, Callable[[], list[Prompt | Generation]]]
EngineFactory = Callable[[JobSpec, DecodingSpec, "SpeculativeSpec | None"], "Engine"]  # noqa: F821


def vllm_engine(spec: JobSpec, decoding: DecodingSpec, speculative: SpeculativeSpec | None):
    from batchjson.engine import VllmEngine

    return VllmEngine(spec.model, decoding, spec.schema_doc, speculative)


class _Pass:
    """Tracks the rows of each open unit through one pass and commits a unit when its last row is checked."""

    def __init__(self, validator: Validator, stats: PassStats, commit: Callable[[str, list[Outcome]], None],
                 bar, stop: threading.Event):
        self.validator, self.stats, self.commit, self.bar, self.stop = validator, stats, commit, bar, stop
        self.remaining: dict[str, int] = {}
        self.outcomes: dict[str, list[Outcome]] = {}
        self.deaths_seen: Counter = Counter()

    def feed(self, units: Iterable[Unit]) -> Iterator[Prompt]:
        """Prompts for the engine; rows that failed before reaching it are checked here directly."""
        for key, rows in units:
            if self.stop.is_set():
                return
            items = rows()
            self.remaining[key], self.outcomes[key] = len(items), []
            if not items:
                self._close(key)
            for item in items:
                if isinstance(item, Generation):
                    self.finish(item)
                else:
                    yield item

    def finish(self, gen: Generation) -> None:
        outcome = self.validator.check(gen)
        self.stats.add(outcome.ok, outcome.reason, gen.prompt_tokens, gen.output_tokens)
        self.bar.update(1)
        key = gen.prompt.unit
        self.outcomes[key].append(outcome)
        self.remaining[key] -= 1
        if self.remaining[key] == 0:
            self._close(key)

    def _close(self, key: str) -> None:
        self.commit(key, self.outcomes.pop(key))
        del self.remaining[key]

    def survivors(self, in_flight: list[Prompt]) -> list[Prompt]:
        """After an engine death: the in-flight prompts to feed again; a row at its second death fails instead."""
        again = []
        for prompt in in_flight:
            self.deaths_seen[prompt.row_id] += 1
            if self.deaths_seen[prompt.row_id] >= DEATHS_PER_ROW:
                self.finish(Generation(prompt, error="engine_error",
                                       detail=f"in flight at {DEATHS_PER_ROW} engine deaths"))
            else:
                again.append(prompt)
        return again


class JobRun:
    """One invocation of a job on one output folder (one shard of it)."""

    def __init__(self, spec: JobSpec, output: str | None = None, *, fresh: bool = False,
                 shard: tuple[int, int] = (0, 1), engine_factory: EngineFactory = vllm_engine, progress: bool | None = None):
        out = output or spec.output.path
        if not out:
            raise SpecError("no output folder: set output.path in the spec or pass --output.")
        self.spec, self.shard, self.make_engine, self.fresh = spec, shard, engine_factory, fresh
        self.output = Path(out)
        self.rejects = Path(spec.output.rejects) if spec.output.rejects else self.output / "_rejects"
        self.source = ParquetSource(spec.input, spec.prompt.columns)
        self.progress = None if progress is None else not progress  # tqdm: None hides the bar off a terminal
        self.validator = Validator(spec.schema_doc)
        self.ledger = Ledger(self.output, self.rejects, shard)
        self.stop = threading.Event()
        self.renderer: Renderer | None = None

    def run(self) -> RunReport:
        started = time.monotonic()
        input_rows = self.source.check()
        first = pq.ParquetFile(self.source.files[0]).schema_arrow
        self.sink = PartSink(self.spec.input.id_column, pa.schema([first.field(c) for c in self.spec.input.passthrough]),
                             self.spec.schema_doc)
        report = RunReport(self.spec.hash(), input_rows, str(self.output), str(self.rejects),
                           max_reject_rate=self.spec.output.max_reject_rate)
        self.duplicates = self.source.check_ids()  # a null id fails here, before the output folder is claimed
        report.resumed = self.ledger.open(self.spec, self.spec.output.if_exists, self.fresh)
        try:
            with self._signals():
                keys: list[str] = []
                self._pass1(report, keys)
                if self.spec.fallback.enabled and not self.stop.is_set():
                    self._pass2(report, keys)
        finally:
            self.ledger.close()
        report.interrupted = self.stop.is_set()
        report.seconds = round(time.monotonic() - started, 2)
        report.tally()
        i, n = self.shard
        report.write(self.output / ("_report.json" if n == 1 else f"_report-{i}of{n}.json"))
        return report

    @contextmanager
    def _signals(self):
        """SIGTERM and Ctrl-C stop the run at the next engine step: finished units are committed, the rest are
        redone by the next run. A second signal acts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            self.stop.set()
            signal.signal(signum, previous[signum])

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _run_pass(self, report: RunReport, name: str, decoding: DecodingSpec, speculative: SpeculativeSpec | None,
                  units: Iterator[Unit], total: int, commit) -> None:
        """Run one pass, starting an engine only when the pass has work.

        If the engine dies, a new one takes the rows that were in flight; after DEATHS_BEFORE_NO_SPECULATION
        deaths the pass goes on without speculation, and after DEATHS_BEFORE_GIVING_UP more it fails (committed
        units are kept, so the next run resumes).
        """
        first = next(units, None)
        if first is None:
            return
        stats = report.passes[name] = PassStats()
        started = time.monotonic()
        with tqdm(total=total, desc=name, unit="row", disable=self.progress) as bar:
            tracker = _Pass(self.validator, stats, commit, bar, self.stop)
            feed, retry, deaths = tracker.feed(chain([first], units)), [], 0
            while True:
                engine = self.make_engine(self.spec, decoding, speculative)
                try:
                    if self.renderer is None:
                        self.renderer = Renderer(self.spec.prompt, engine.chat_frame(self.spec.prompt.system, Renderer.MARK),
                                                 self.spec.input.id_column, self.spec.input.passthrough, self.duplicates)
                    # itertools.chain, not a generator: a dead engine's stream must not close `feed` as it goes.
                    for gen in engine.stream(chain(retry, feed), self.stop):
                        tracker.finish(gen)
                    stats.speculative = engine.stats() if speculative else {}
                    break
                except EngineDied as died:
                    deaths += 1
                    retry = tracker.survivors(died.in_flight)
                    if speculative and deaths >= DEATHS_BEFORE_NO_SPECULATION:
                        speculative, deaths = None, 0
                        stats.note = f"speculation switched off after {DEATHS_BEFORE_NO_SPECULATION} engine deaths"
                    elif deaths >= DEATHS_BEFORE_GIVING_UP:
                        raise EngineError(f"the engine died {deaths} times in {name} ({died}). Finished units are "
                                          "kept: rerun the same command to resume.") from died
                    stats.note = stats.note or f"engine restarted after {deaths} death(s)"
                finally:
                    engine.close()
                    stats.seconds = round(time.monotonic() - started, 2)
        if tracker.remaining and not self.stop.is_set():
            raise RuntimeError(f"[internal] units left open after {name}: {sorted(tracker.remaining)[:3]}")

    def _pass1(self, report: RunReport, keys: list[str]) -> None:
        def units():
            for unit in self.source.units(self.shard):
                keys.append(unit.key)
                if not self.ledger.done("p1", unit.key):
                    yield unit.key, lambda unit=unit: list(self.renderer.render(unit))

        def commit(key: str, outcomes: list[Outcome]) -> None:
            bad = [o for o in outcomes if not o.ok]
            final = [o for o in bad if o.reason in FINAL_REASONS or not self.spec.fallback.enabled]
            retry = [o for o in bad if o not in final]
            if final:
                write_atomic(self.sink.rejected(final, 1), self.rejects / f"p1-{key}.parquet")
            if retry:
                write_atomic(self.sink.rejected(retry, 1, with_prompt=True), self.ledger.requeue / f"{key}.parquet")
            if len(bad) < len(outcomes):
                write_atomic(self.sink.valid([o for o in outcomes if o.ok], 1), self.output / f"p1-{key}.parquet")
            self.ledger.mark("p1", key)

        speculative = self.spec.speculative if self.spec.speculative.enabled else None
        self._run_pass(report, "pass1", self.spec.sampling, speculative, units(), report.input_rows, commit)

    def _pass2(self, report: RunReport, keys: list[str]) -> None:
        todo = [k for k in keys if (self.ledger.requeue / f"{k}.parquet").exists() and not self.ledger.done("p2", k)]
        total = sum(pq.ParquetFile(self.ledger.requeue / f"{k}.parquet").metadata.num_rows for k in todo)

        def commit(key: str, outcomes: list[Outcome]) -> None:
            bad = [o for o in outcomes if not o.ok]
            if bad:
                write_atomic(self.sink.rejected(bad, 2), self.rejects / f"p2-{key}.parquet")
            if len(bad) < len(outcomes):
                write_atomic(self.sink.valid([o for o in outcomes if o.ok], 2), self.output / f"p2-{key}.parquet")
            self.ledger.mark("p2", key)

        units = ((key, lambda key=key: self._requeued(key)) for key in todo)
        self._run_pass(report, "pass2", self.spec.fallback, None, units, total, commit)

    def _requeued(self, key: str) -> list[Prompt]:
        cols = pq.read_table(self.ledger.requeue / f"{key}.parquet").to_pydict()
        ids, texts = cols[self.spec.input.id_column], cols["prompt"]
        return [Prompt(ids[i], key, texts[i], {c: cols[c][i] for c in self.spec.input.passthrough})
                for i in range(len(ids))]


def run_job(spec: JobSpec, output: str | None = None, **kwargs) -> RunReport:
    """Run (or resume) a job; returns the report, also written to <output>/_report.json."""
    return JobRun(spec, output, **kwargs).run()

"""The one place that knows the stage order: source -> prompts -> engine -> validate -> sink, in two passes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from batchjson.errors import SpecError
from batchjson.ledger import Ledger
from batchjson.prompts import Renderer
from batchjson.records import Generation, Outcome, Prompt
from batchjson.report import PassStats, RunReport
from batchjson.sink import PartSink, write_atomic
from batchjson.source import ParquetSource
from batchjson.spec import DecodingSpec, JobSpec, SpeculativeSpec
from batchjson.validate import Validator

# Failures that another pass with the same model cannot fix: they go straight to rejects.
FINAL_REASONS = {"empty_prompt", "prompt_too_long"}

# A unit of work on its way into a pass: its key, and a function that makes its rows (called once the engine is up).
Unit = tuple[str, Callable[[], list[Prompt | Generation]]]
EngineFactory = Callable[[JobSpec, DecodingSpec, "SpeculativeSpec | None"], "Engine"]  # noqa: F821


def vllm_engine(spec: JobSpec, decoding: DecodingSpec, speculative: SpeculativeSpec | None):
    from batchjson.engine import VllmEngine

    return VllmEngine(spec.model, decoding, spec.schema_doc, speculative)


class _Pass:
    """Tracks the rows of each open unit through one pass and commits a unit when its last row is checked."""

    def __init__(self, validator: Validator, stats: PassStats, commit: Callable[[str, list[Outcome]], None], bar):
        self.validator, self.stats, self.commit, self.bar = validator, stats, commit, bar
        self.remaining: dict[str, int] = {}
        self.outcomes: dict[str, list[Outcome]] = {}

    def feed(self, units: Iterable[Unit]) -> Iterator[Prompt]:
        """Prompts for the engine; rows that failed before reaching it are checked here directly."""
        for key, rows in units:
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
        self.stats.add(outcome.ok, outcome.reason, gen.output_tokens)
        self.bar.update(1)
        key = gen.prompt.unit
        self.outcomes[key].append(outcome)
        self.remaining[key] -= 1
        if self.remaining[key] == 0:
            self._close(key)

    def _close(self, key: str) -> None:
        self.commit(key, self.outcomes.pop(key))
        del self.remaining[key]

    def run(self, engine, units: Iterable[Unit]) -> None:
        for gen in engine.stream(self.feed(units)):
            self.finish(gen)
        if self.remaining:
            raise RuntimeError(f"[internal] units left open after the pass: {sorted(self.remaining)[:3]}")


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

    def run(self) -> RunReport:
        started = time.monotonic()
        input_rows = self.source.check()
        first = pq.ParquetFile(self.source.files[0]).schema_arrow
        self.sink = PartSink(self.spec.input.id_column, pa.schema([first.field(c) for c in self.spec.input.passthrough]),
                             self.spec.schema_doc)
        report = RunReport(self.spec.hash(), input_rows, str(self.output), str(self.rejects),
                           max_reject_rate=self.spec.output.max_reject_rate)
        report.resumed = self.ledger.open(self.spec, self.spec.output.if_exists, self.fresh)
        try:
            keys: list[str] = []
            self._pass1(report, keys)
            if self.spec.fallback.enabled:
                self._pass2(report, keys)
        finally:
            self.ledger.close()
        report.seconds = round(time.monotonic() - started, 2)
        report.tally()
        report.write(self.output / "_report.json")
        return report

    def _run_pass(self, report: RunReport, name: str, decoding: DecodingSpec, speculative: SpeculativeSpec | None,
                  units: Iterator[Unit], total: int, commit) -> None:
        """Start an engine only when the pass has work, run the pass, shut the engine down."""
        first = next(units, None)
        if first is None:
            return
        stats = report.passes[name] = PassStats()
        started = time.monotonic()
        engine = self.make_engine(self.spec, decoding, speculative)
        try:
            if name == "pass1":
                self.renderer = Renderer(self.spec.prompt, engine.chat_frame(self.spec.prompt.system, Renderer.MARK),
                                         self.spec.input.id_column, self.spec.input.passthrough)
            with tqdm(total=total, desc=name, unit="row", disable=self.progress) as bar:
                _Pass(self.validator, stats, commit, bar).run(engine, _chain(first, units))
            stats.speculative = engine.stats() if speculative else {}
        finally:
            engine.close()
            stats.seconds = round(time.monotonic() - started, 2)

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

        def units():
            for key in todo:
                yield key, lambda key=key: self._requeued(key)

        def commit(key: str, outcomes: list[Outcome]) -> None:
            bad = [o for o in outcomes if not o.ok]
            if bad:
                write_atomic(self.sink.rejected(bad, 2), self.rejects / f"p2-{key}.parquet")
            if len(bad) < len(outcomes):
                write_atomic(self.sink.valid([o for o in outcomes if o.ok], 2), self.output / f"p2-{key}.parquet")
            self.ledger.mark("p2", key)

        self._run_pass(report, "pass2", self.spec.fallback, None, units(), total, commit)

    def _requeued(self, key: str) -> list[Prompt]:
        cols = pq.read_table(self.ledger.requeue / f"{key}.parquet").to_pydict()
        ids, texts = cols[self.spec.input.id_column], cols["prompt"]
        return [Prompt(ids[i], key, texts[i], {c: cols[c][i] for c in self.spec.input.passthrough})
                for i in range(len(ids))]


def _chain(first, rest):
    yield first
    yield from rest


def run_job(spec: JobSpec, output: str | None = None, **kwargs) -> RunReport:
    """Run (or resume) a job; returns the report, also written to <output>/_report.json."""
    return JobRun(spec, output, **kwargs).run()

"""The one place that knows the stage order: source -> prompts -> engine -> validate -> sink -> storage, in two
passes, and the exactly-once check that ends every run."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain

from tqdm import tqdm

from batchjson import replicas
from batchjson.engine import Engine
from batchjson.errors import BatchjsonError, EngineDied, EngineError, SpecError
from batchjson.prompts import Renderer, chat_frame
from batchjson.records import WAIT, Generation, Outcome, Prompt
from batchjson.report import PassStats, RunReport
from batchjson.tables import PartSink
from batchjson.source import ParquetSource
from batchjson.speculation import Auto
from batchjson.spec import DecodingSpec, JobSpec, SpeculativeSpec
from batchjson.storage import Stage, Storage
from batchjson.schema.validate import Validator
from batchjson.verify import verify

# Failures that another pass with the same model cannot fix: they go straight to rejects.
FINAL_REASONS = {"empty_prompt", "invalid_input", "prompt_too_long", "duplicate_id"}
# Engine deaths in one pass before speculation is switched off for the rest of it (grammar/speculation desyncs
# have killed engines in recent vLLM releases), and before the pass gives up without speculation.
DEATHS_BEFORE_NO_SPECULATION = 2
DEATHS_BEFORE_GIVING_UP = 3
# A row in flight at this many engine deaths is taken for the cause and fails with engine_error.
DEATHS_PER_ROW = 2

# A unit of work on its way into a pass: its key and its rows (prompts, or rows that already failed).
Work = tuple[str, list[Prompt | Generation]]
EngineFactory = Callable[[JobSpec, DecodingSpec, "SpeculativeSpec | None"], Engine]


def vllm_engine(spec: JobSpec, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> Engine:
    from batchjson.engine import VllmEngine

    return VllmEngine(spec.model, decoding, spec.schema_doc, speculative)


@dataclass(frozen=True)
class Pass:
    """One pass as a value: where it commits, how it decodes, and where its failures go."""

    stage: Stage
    name: str
    number: int
    decoding: DecodingSpec
    speculative: SpeculativeSpec | None
    last: bool
    """Failures of the last pass go to rejects; those of an earlier one to the re-queue of the next."""


def plan_passes(spec: JobSpec) -> list[Pass]:
    speculative = spec.speculative if spec.speculative.enabled else None
    first = Pass("p1", "pass1", 1, spec.sampling, speculative, last=not spec.fallback.enabled)
    return [first, Pass("p2", "pass2", 2, spec.fallback, None, last=True)] if spec.fallback.enabled else [first]


class _Tracker:
    """Tracks the rows of each open unit through one pass and commits a unit when its last row is checked."""

    def __init__(self, validator: Validator, stats: PassStats, commit: Callable[[str, list[Outcome]], None],
                 bar, stop: threading.Event):
        self.validator, self.stats, self.commit, self.bar, self.stop = validator, stats, commit, bar, stop
        self.remaining: dict[str, int] = {}
        self.outcomes: dict[str, list[Outcome]] = {}
        self.deaths_seen: Counter = Counter()

    def feed(self, work: Iterable[Work]) -> Iterator[Prompt]:
        """Prompts for the engine; rows that failed before reaching it are checked here directly."""
        for unit in work:
            if self.stop.is_set():
                return
            if unit is WAIT:
                yield WAIT
                continue
            key, items = unit
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
        if self.bar is not None:
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
                 shard: tuple[int, int] = (0, 1), engine_factory: EngineFactory = vllm_engine, progress: bool | None = None,
                 replicas: int | None = None, ray: str | None = None):
        out = output or spec.output.path
        if not out:
            raise SpecError("no output folder: set output.path in the spec or pass --output.")
        self.spec, self.shard, self.make_engine, self.fresh = spec, shard, engine_factory, fresh
        self.output, self.ray = out, ray
        self.replicas = replicas if replicas is not None else spec.model.replicas
        if self.replicas is not None and self.replicas < 1:
            raise SpecError(f"replicas must be at least 1, not {self.replicas}.")
        self.storage = Storage(out, spec.output.rejects or None, shard)
        self.source = ParquetSource(spec.input, spec.prompt.columns)
        self.progress = None if progress is None else not progress  # tqdm: None hides the bar off a terminal
        self.validator = Validator(spec.schema_doc, spec.schema.check_format)
        self.stop = threading.Event()
        self.owners: dict[str, tuple[str, int]] = {}
        self.engine: Engine | None = None  # kept from pass to pass while their engine-wide settings agree
        self.passes = plan_passes(spec)
        self.slot: int | None = None  # this process's replica number, when it runs as one
        self.share = 1  # replicas sharing the passes' units (auto judges this replica's part of a pass)

    def run(self) -> RunReport:
        started = time.monotonic()
        input_rows, everything = self._prepare()
        self.storage.check_paths(self.spec.input.path)
        scan = self.source.scan()  # a null id fails here, before the output folder is claimed
        layout = self._layout()
        storage = self.storage
        report = RunReport(self.spec.hash(), input_rows, str(storage.output), str(storage.rejects),
                           max_reject_rate=self.spec.output.max_reject_rate)
        report.resumed = storage.open(self.spec.hash(), self.spec.fingerprint(), self.spec.output.if_exists, self.fresh)
        try:
            with self._signals():
                storage.check_inputs(scan.fingerprints)
                for key, why in storage.damaged(list(self.refs), self.spec.input.id_column).items():
                    storage.drop(key)
                    report.notes.append(f"unit {key}: {why}; the unit was redone")
                # A repeated id is processed where it was committed already, else at its first occurrence.
                self.owners = {row_id: next((p for p in places if storage.done("p1", p[0])), places[0])
                               for row_id, places in scan.repeated.items()}
                if len(layout) > 1 or self.ray:
                    self._run_replicated(report, layout)
                else:
                    for p in self.passes:
                        if self.stop.is_set():
                            break
                        self._run_pass(report, p)
                self._close_engine()
                report.tally(storage.records())
                verdict = verify(storage, self.source, everything, self.spec.input.id_column)
                if not self.stop.is_set() and self.shard[1] == 1 and verdict.pending and verdict.ok:
                    verdict.problems.append(f"[internal] {verdict.pending} units left undone by an uninterrupted run")
                report.verified = verdict.to_dict()
                report.verified_summary = verdict.summary()
        finally:
            self._close_engine()
            storage.close()
        report.interrupted = self.stop.is_set()
        report.seconds = round(time.monotonic() - started, 2)
        storage.write_report(report.to_dict())
        return report

    def _prepare(self) -> tuple[int, list]:
        """Check the input's footers and plan the units (this shard's in self.refs); returns the input's rows and
        every unit of it."""
        input_rows = self.source.check()
        everything = self.source.plan()
        mine = self.source.plan(self.shard) if self.shard[1] > 1 else everything
        self.refs = {r.key: r for r in mine}
        self.sink = PartSink(self.spec.input.id_column, self.source.passthrough_schema(), self.spec.schema_doc)
        return input_rows, everything

    def _layout(self) -> list:
        """The replicas this run decodes on: one per GPU (group) of the host unless told otherwise."""
        if self.ray:
            return []
        return replicas.local_layout(self.replicas, self.spec.model.engine)

    def _run_replicated(self, report: RunReport, layout: list) -> None:
        """Every pass on several engine replicas that pull units from one queue (see replicas.py)."""
        os.environ["BATCHJSON_RUNNER_PID"] = str(os.getpid())  # local replicas die with this process
        args = (self.spec, str(self.output), self.shard, self.make_engine, self.owners)
        if self.ray:
            pool = replicas.ray_pool(serve_replica, args, self.ray, self.replicas, self.spec.model.engine)
        else:
            pool = replicas.LocalPool(serve_replica, args, layout)
        report.replicas = len(pool.slots)
        try:
            for p in self.passes:
                keys = self._todo(p)
                stats = PassStats(replicas=len(pool.slots))
                started = time.monotonic()
                with tqdm(total=self._rows(p, keys), desc=p.name, unit="row", disable=self.progress) as bar:
                    notes = replicas.dispatch(pool, p.stage, keys, lambda key, rows: bar.update(rows),
                                              stats.merge, self.stop)
                stats.seconds = round(time.monotonic() - started, 2)
                if keys:
                    stats.note = "; ".join([stats.note] * bool(stats.note) + notes)
                    report.passes[p.name] = stats
                if self.stop.is_set():
                    break
        finally:
            pool.close()

    def serve(self, channel: replicas.Channel, owners: dict) -> None:
        """Run as one replica: take units from the runner's queue pass by pass, decode, check and commit them, and
        report each commit and each pass's counts. The runner holds the folder; a replica never claims it."""
        self._prepare()
        self.owners, self.slot, self.share = owners, channel.slot, channel.replicas
        try:
            with self._signals():
                for p in self.passes:
                    stats = PassStats()
                    work = self._load(p, channel.keys(p.stage))
                    rows = self._share_of(p)
                    self._decode(p, work, rows, stats, None,
                                 lambda key, done: channel.send("done", p.stage, key, done))
                    channel.send("stats", p.stage, stats.to_dict())
                    if self.stop.is_set():
                        return
        finally:
            self._close_engine()

    def _share_of(self, p: Pass) -> int:
        """About this replica's rows of a pass, for auto's estimate of how long the pass is: from the footers and one
        listing of the commit records (not a check per unit, as _todo makes). Only a speculative pass needs it."""
        if p.speculative is None:
            return 0
        committed = self.storage.committed()
        return self._rows(p, [key for key in self.refs if f"{p.stage}-{key}" not in committed]) // self.share

    @functools.cached_property
    def platform(self) -> str:
        """"gpu" or "cpu", asked once (nvidia-smi) when speculation's auto policy first needs it."""
        return "gpu" if replicas.visible_gpus() else "cpu"

    @functools.cached_property
    def renderer(self) -> Renderer:
        """Made on first use: a run with nothing to render never loads the model's tokenizer."""
        from batchjson.engine import resolve_model

        frame = chat_frame(resolve_model(self.spec.model.path), self.spec.prompt.system)
        return Renderer(self.spec.prompt, frame, self.spec.input.id_column, self.spec.input.passthrough, self.owners)

    @contextmanager
    def _signals(self):
        """SIGTERM and Ctrl-C stop the run at the next engine step: finished units are committed, the rest are
        redone by the next run. A second signal exits at once (130); the engine processes die with the runner."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.stop.is_set():
                sys.stderr.write("\nstopped at once: finished units are committed; run the same command again to "
                                 "resume\n")
                sys.stderr.flush()
                os._exit(130)
            self.stop.set()

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _engine_for(self, p: Pass, speculative: SpeculativeSpec | None) -> tuple[Engine, bool]:
        """The engine for a pass: the previous pass's one when its engine-wide settings fit (sampling is per
        request), so a small fallback does not pay a second engine start; else a new one."""
        if self.engine is not None and self.engine.accepts(p.decoding, speculative):
            self.engine.use(p.decoding)
            return self.engine, True
        self._close_engine()
        # On CPU the seed is engine-wide: seed the engine with the first seed any pass asks for, so that the
        # fallback's seed holds when it runs on this engine.
        seed = next((q.decoding.seed for q in self.passes if q.decoding.seed is not None), None)
        decoding = p.decoding if p.decoding.seed is not None else dataclasses.replace(p.decoding, seed=seed)
        self.engine = self.make_engine(self.spec, decoding, speculative)
        self.engine.use(p.decoding)
        return self.engine, False

    def _close_engine(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()

    def _todo(self, p: Pass) -> list[str]:
        """The units a pass has left to do, found in storage (so a rerun resumes either pass)."""
        storage = self.storage
        if p.stage == "p1":
            return [k for k in self.refs if not storage.done("p1", k)]
        return [k for k in self.refs if storage.requeued(k) and not storage.done("p2", k)]

    def _rows(self, p: Pass, keys: list[str]) -> int:
        if p.stage == "p1":
            return sum(self.refs[k].rows for k in keys)
        return sum(self.storage.record("p1", k)["rows"]["requeue"] for k in keys)

    def _load(self, p: Pass, keys: Iterable[str]) -> Iterator[Work]:
        """The rows of each unit, as they are asked for (WAIT passes through: no unit is ready yet)."""
        for key in keys:
            if key is WAIT:
                yield WAIT
            elif p.stage == "p1":
                yield key, list(self.renderer.render(self.source.unit(self.refs[key])))
            else:
                yield key, self._requeued(key)

    def _requeued(self, key: str) -> list[Prompt]:
        cols = self.storage.read_requeue(key).to_pydict()
        ids, texts = cols[self.spec.input.id_column], cols["prompt"]
        return [Prompt(ids[i], key, texts[i], {c: cols[c][i] for c in self.spec.input.passthrough})
                for i in range(len(ids))]

    def _commit(self, p: Pass, key: str, outcomes: list[Outcome]) -> None:
        ok, final, retry = [], [], []
        for o in outcomes:
            (ok if o.ok else final if p.last or o.reason in FINAL_REASONS else retry).append(o)
        ref = self.refs[key]
        tables = {"output": self.sink.valid(ok, p.number), "rejects": self.sink.rejected(final, p.number),
                  "requeue": self.sink.rejected(retry, p.number, with_prompt=True)}
        meta = {"file": ref.tag, "path": ref.file, "reasons": dict(Counter(o.reason for o in final))}
        if self.slot is not None:
            meta["replica"] = self.slot
        self.storage.commit(p.stage, key, tables, meta)

    def _run_pass(self, report: RunReport, p: Pass) -> None:
        """Run one pass on this process's engine, starting it only when the pass has work."""
        keys = self._todo(p)
        if not keys:
            return
        stats = report.passes[p.name] = PassStats()
        rows = self._rows(p, keys)
        with tqdm(total=rows, desc=p.name, unit="row", disable=self.progress) as bar:
            self._decode(p, self._load(p, keys), rows, stats, bar)

    def _decode(self, p: Pass, work: Iterator[Work], rows: int, stats: PassStats, bar,
                committed: Callable[[str, int], None] | None = None) -> None:
        """Decode, check and commit the units of `work`, starting an engine when the first one arrives.

        If the engine dies, a new one takes the rows that were in flight; after DEATHS_BEFORE_NO_SPECULATION
        deaths the pass goes on without speculation, and after DEATHS_BEFORE_GIVING_UP more it fails (committed
        units are kept, so the next run resumes). A stop never starts an engine: a signal that reached the
        engine processes too (Ctrl-C in a terminal) kills them, and that is not a death to recover from.
        """
        first = _first(work)
        if first is None:
            return
        started = time.monotonic()
        auto = None
        if p.speculative is not None and p.speculative.method == "auto":
            # A speculative pass sends its failures to a next pass that needs an engine of its own (no draft).
            auto = Auto(p.speculative, self.spec.model.max_in_flight, self.platform, rows, next_pass_starts=not p.last)
        speculative = auto.current() if auto else p.speculative

        def commit(key: str, outcomes: list[Outcome]) -> None:
            self._commit(p, key, outcomes)
            if committed:
                committed(key, len(outcomes))

        tracker = _Tracker(self.validator, stats, commit, bar, self.stop)
        feed, retry, deaths = tracker.feed(chain([first], work)), [], 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                engine, reused = self._engine_for(p, speculative)
            except EngineError as e:
                if not (auto and speculative):
                    raise
                auto.could_not_start(str(e))  # auto's own choice, not the user's: the job goes on without it
                speculative = None
                continue
            stats.grammar = stats.grammar or (engine.choice.summary if engine.choice else "")
            if reused:
                stats.note = stats.note or "ran on the previous pass's engine (no second engine start)"
            else:
                start_s = time.monotonic() - t0
                stats.engine_starts += 1
                stats.engine_start_s += start_s
                if auto:
                    auto.started(start_s)
            switch = threading.Event()
            try:
                # itertools.chain, not a generator: a dead engine's stream must not close `feed` as it goes.
                t0, steps0, wanted = time.monotonic(), engine.steps, "stay"

                def measure() -> None:  # this engine's decoding so far, as auto's measurement of its choice
                    auto.measure(time.monotonic() - t0, engine.steps - steps0,
                                 engine.stats() if speculative else None)

                for gen in engine.stream(chain(retry, feed), _Either(self.stop, switch) if auto else self.stop):
                    tracker.finish(gen)
                    if auto and auto.add(gen.output_tokens):
                        measure()
                        wanted = auto.wanted()
                        if wanted != "stay":
                            switch.set()
                stats.speculative = engine.stats() if speculative else {}
                if auto:
                    if wanted == "stay":  # the stream ended: its numbers so far are the choice's measurement
                        measure()
                    stats.auto = [auto.report()]
                if wanted != "stay" and not self.stop.is_set():  # auto tries (or goes back to) the other choice
                    speculative, retry = wanted, list(engine.unfinished)
                    continue
                break
            except EngineDied as died:
                self._close_engine()
                if self.stop.is_set():
                    break
                deaths += 1
                retry = tracker.survivors(died.in_flight)
                if speculative and deaths >= DEATHS_BEFORE_NO_SPECULATION:
                    speculative, deaths = None, 0
                    stats.note = f"speculation switched off after {DEATHS_BEFORE_NO_SPECULATION} engine deaths"
                elif deaths >= DEATHS_BEFORE_GIVING_UP:
                    raise EngineError(f"the engine died {deaths} times in {p.name} ({died}). Finished units are "
                                      "kept: rerun the same command to resume.") from died
                stats.note = stats.note or f"engine restarted after {deaths} death(s)"
            finally:
                stats.seconds = round(time.monotonic() - started, 2)
        if tracker.remaining and not self.stop.is_set():
            raise RuntimeError(f"[internal] units left open after {p.name}: {sorted(tracker.remaining)[:3]}")


class _Either:
    """Set when either event is: a stream stops on a signal, or when auto switches engines."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


def _first(work: Iterator[Work]) -> Work | None:
    """The first unit of `work` (None if it has none), waiting while a replica's queue has none ready."""
    for unit in work:
        if unit is not WAIT:
            return unit
        time.sleep(0.01)
    return None


def serve_replica(spec: JobSpec, output: str, shard: tuple[int, int], engine_factory: EngineFactory, owners: dict,
                  slot: int, count: int, inbox, outbox) -> None:
    """The body of replica `slot` of `count` (a local process or a Ray actor): see JobRun.serve."""
    channel = replicas.Channel(slot, inbox, outbox, count)
    os.environ["BATCHJSON_REPLICA"] = str(slot)
    try:
        JobRun(spec, output, shard=shard, engine_factory=engine_factory, progress=False).serve(channel, owners)
    except BatchjsonError as e:
        channel.send("error", str(e))
    except BaseException as e:
        channel.send("error", f"[internal] {type(e).__name__}: {e}")
        raise


def run_job(spec: JobSpec, output: str | None = None, **kwargs) -> RunReport:
    """Run (or resume) a job; returns the report, also written to <output>/_report.json."""
    return JobRun(spec, output, **kwargs).run()

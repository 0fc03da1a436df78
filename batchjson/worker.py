"""One engine's share of a job: take units of either pass from the queue, load and render them, decode, check and
commit each one; recover from engine deaths; run auto's engine switches and pass 1's change of sampling
settings (passes.py). Every executor runs this body.

Both passes share the worker's engine where it can take both (sampling is per request; pass 2's requests go
without a draft on a speculative engine, see engine/internals.py), so a unit's pass 2 decodes beside other units'
pass 1. An engine that cannot take a pass (a vLLM without the per-request draft switch, another grammar backend)
makes the worker ask only for what it can take; when nothing else is left it changes engines.

Over 250 lines because the decode loop, engine deaths, auto's switches and the choice of work share one engine's
state; Pass and Tracker, the values it moves, stay beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import chain

from batchjson.engine import Engine
from batchjson.errors import EngineDied, EngineError
from batchjson.executors.base import Channel, Work
from batchjson.passes import Recipe, plan_passes
from batchjson.prompts import Renderer, chat_frame
from batchjson.records import WAIT, Generation, Outcome, Prompt
from batchjson.report import PassStats
from batchjson.tables import PartSink
from batchjson.source import ParquetSource, UnitRef
from batchjson.spec import DecodingSpec, JobSpec, SpeculativeSpec
from batchjson.engine.speculation import Auto
from batchjson.storage import Storage
from batchjson.schema.validate import Validator

# Failures that another pass with the same model cannot fix: they go straight to rejects.
FINAL_REASONS = {"empty_prompt", "invalid_input", "prompt_too_long", "duplicate_id"}
# Engine deaths before speculation is switched off (grammar/speculation desyncs have killed engines in recent vLLM
# releases), and before the worker gives up without speculation.
DEATHS_BEFORE_NO_SPECULATION = 2
DEATHS_BEFORE_GIVING_UP = 3
# A row in flight at this many engine deaths is taken for the cause and fails with engine_error.
DEATHS_PER_ROW = 2

EngineFactory = Callable[[JobSpec, DecodingSpec, "SpeculativeSpec | None"], Engine]
# A unit on its way into the engine: its stage, its key and its rows (prompts, or rows that already failed).
Loaded = tuple[str, str, list[Prompt | Generation]]


@contextmanager
def signals(stop: threading.Event):
    """SIGTERM and Ctrl-C stop the run at the next engine step: finished units are committed, the rest are
    redone by the next run. A second signal exits at once (130); the engine processes die with the runner."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.is_set():
            sys.stderr.write("\nstopped at once: finished units are committed; run the same command again to resume\n")
            sys.stderr.flush()
            os._exit(130)
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Tracker:
    """Tracks the rows of each open unit and commits a unit when its last row is checked."""

    def __init__(self, validator: Validator, stats: dict[str, PassStats],
                 commit: Callable[[str, str, list[Outcome]], None], stop: threading.Event, started: float):
        self.validator, self.stats, self.commit, self.stop = validator, stats, commit, stop
        self.started = started  # time.monotonic() at the run's start: first_request_s counts from it
        self.remaining: dict[Work, int] = {}
        self.outcomes: dict[Work, list[Outcome]] = {}
        self.deaths_seen: Counter = Counter()

    def feed(self, work: Iterable[Loaded]) -> Iterator[Prompt]:
        """Prompts for the engine; rows that failed before reaching it are checked here directly."""
        for unit in work:
            if self.stop.is_set():
                return
            if unit is WAIT:
                yield WAIT
                continue
            stage, key, items = unit
            self.remaining[stage, key], self.outcomes[stage, key] = len(items), []
            if not items:
                self._close((stage, key))
            for item in items:
                if isinstance(item, Generation):
                    self.finish(item)
                else:
                    if self.stats[stage].first_request_s is None:
                        self.stats[stage].first_request_s = time.monotonic() - self.started
                    yield item

    def finish(self, gen: Generation) -> Outcome:
        outcome = self.validator.check(gen)
        stage = gen.prompt.stage
        self.stats[stage].add(outcome.ok, outcome.reason, gen.prompt_tokens, gen.output_tokens)
        pair = (stage, gen.prompt.unit)
        self.outcomes[pair].append(outcome)
        self.remaining[pair] -= 1
        if self.remaining[pair] == 0:
            self._close(pair)
        return outcome

    def _close(self, pair: Work) -> None:
        self.commit(*pair, self.outcomes.pop(pair))
        del self.remaining[pair]

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


class Worker:
    """One engine (replica) working through the queue. `storage` is the driver's (inline) or a replica's own,
    which never claims the folder: the driver holds it."""

    def __init__(self, spec: JobSpec, storage: Storage, source: ParquetSource, refs: dict[str, UnitRef],
                 owners: dict, make_engine: EngineFactory, stop: threading.Event, *, slot: int | None = None,
                 share: int = 1, started: float | None = None):
        self.spec, self.storage, self.source, self.refs, self.owners = spec, storage, source, refs, owners
        self.make_engine, self.stop, self.slot, self.share = make_engine, stop, slot, share
        # The run's start (a replica's: its own), for first_request_s.
        self.started = time.monotonic() if started is None else started
        self.passes = plan_passes(spec)
        self.by_stage = {p.stage: p for p in self.passes}
        self.validator = Validator(spec.schema_doc, spec.schema.check_format)
        self.sink = PartSink(spec.input.id_column, source.passthrough_schema(), spec.schema_doc)
        self.engine: Engine | None = None
        self.takes: tuple[str, ...] = ()  # the stages self.engine takes, asked of it once when it starts
        self.held: deque[Work] = deque()  # handed to this worker, not takeable by its engine yet
        self.stats = {p.stage: PassStats() for p in self.passes}
        self.speculative: SpeculativeSpec | None = self.passes[0].speculative  # pass 1's draft, now
        self.auto: Auto | None = None
        self.recipe = Recipe.for_job(spec)  # pass 1's sampling settings now (None: always its own)

    @functools.cached_property
    def renderer(self) -> Renderer:
        """Made on first use: a run with nothing to render never loads the model's tokenizer."""
        from batchjson.engine import resolve_model

        frame = chat_frame(resolve_model(self.spec.model.path), self.spec.prompt.system)
        return Renderer(self.spec.prompt, frame, self.spec.input.id_column, self.spec.input.passthrough, self.owners)

    def serve(self, channel: Channel) -> None:
        """Work until the queue says the run is over (or a stop); then report this worker's counts per pass."""
        self.channel = channel
        self._plan_auto()
        tracker = Tracker(self.validator, self.stats, self._commit, self.stop, self.started)
        try:
            while not self.stop.is_set():
                pairs = self._takeable(channel.work(self._stages, hold=lambda: bool(self.held)))
                first = _first(pairs)
                if first is None:
                    if channel.ended == "end" and not self.held:
                        break
                    self._close_engine()  # other stages have work this engine cannot take: the next one can
                    continue
                self._decode(tracker, first[0], chain([first], pairs))
            if tracker.remaining and not self.stop.is_set():
                raise RuntimeError(f"[internal] units left open: {sorted(tracker.remaining)[:3]}")
        finally:
            self._close_engine()
        first = self.stats[self.passes[0].stage]
        for p in self.passes[1:]:
            later = self.stats[p.stage]
            if later.rows and not later.engine_starts:
                later.note = later.note or "decoded on pass 1's engine, beside pass 1 (no engine start of its own)"
                later.grammar = later.grammar or first.grammar
        channel.send("stats", {stage: s.to_dict() for stage, s in self.stats.items() if s.rows or s.engine_starts})

    # -- which work this worker's engine takes ----------------------------------------------------------------

    def _takes(self, stage: str) -> bool:
        return self.engine is None or stage in self.takes  # no engine yet: the first unit picks it

    def _stages(self) -> tuple[str, ...]:
        return self.takes if self.engine is not None else tuple(self.by_stage)

    def _taken_by(self, engine: Engine) -> tuple[str, ...]:
        """The stages `engine` can decode: pass 1 with its draft or without one, pass 2 without (engine-wide
        settings only change with the engine: auto's switches and deaths start a new one)."""
        first = self.passes[0]
        return tuple(p.stage for p in self.passes
                     if (p is first and engine.accepts(p.decoding, self.speculative))
                     or engine.accepts(p.decoding, None))

    def _takeable(self, work: Iterator[Work]) -> Iterator[Work]:
        """Held pairs the engine now takes first, then the channel's; a pair it cannot take is held back."""
        for _ in range(len(self.held)):
            pair = self.held.popleft()
            if self._takes(pair[0]):
                yield pair
            else:
                self.held.append(pair)
        for pair in work:
            if pair is WAIT or self._takes(pair[0]):
                yield pair
            else:
                self.held.append(pair)

    def _load(self, pairs: Iterator[Work]) -> Iterator[Loaded]:
        """The rows of each unit, as they are asked for (WAIT passes through: no unit is ready yet)."""
        for pair in pairs:
            if pair is WAIT:
                yield WAIT
                continue
            stage, key = pair
            if stage == "p1":
                yield stage, key, list(self.renderer.render(self.source.unit(self.refs[key])))
            else:
                yield stage, key, self._requeued(key)

    def _requeued(self, key: str) -> list[Prompt]:
        cols = self.storage.read_requeue(key).to_pydict()
        ids, texts = cols[self.spec.input.id_column], cols["prompt"]
        return [Prompt(ids[i], key, texts[i], {c: cols[c][i] for c in self.spec.input.passthrough}, "p2")
                for i in range(len(ids))]

    def _commit(self, stage: str, key: str, outcomes: list[Outcome]) -> None:
        p = self.by_stage[stage]
        ok, final, retry = [], [], []
        for o in outcomes:
            (ok if o.ok else final if p.last or o.reason in FINAL_REASONS else retry).append(o)
        ref = self.refs[key]
        tables = {"output": self.sink.valid(ok, p.number), "rejects": self.sink.rejected(final, p.number),
                  "requeue": self.sink.rejected(retry, p.number, with_prompt=True)}
        meta = {"file": ref.tag, "path": ref.file, "reasons": dict(Counter(o.reason for o in final))}
        if self.slot is not None:
            meta["replica"] = self.slot
        self.source.check_unchanged(ref)  # the last moment before the commit: nothing mixed is committed
        self.storage.commit(p.stage, key, tables, meta)
        self.channel.send("done", stage, key, len(outcomes), len(retry))

    # -- engines ----------------------------------------------------------------------------------------------

    def _plan_auto(self) -> None:
        first = self.passes[0]
        if first.speculative is None or first.speculative.method != "auto":
            return
        shares_engine = first.last or self._drafts_optional()
        if not shares_engine:
            # Pass 2 could not run on a speculative engine here: a draft would cost it an engine start of its own.
            self.speculative = None
            self.stats["p1"].note = ("auto: no speculation: this vLLM cannot decode pass 2 without a draft on a "
                                     "speculative engine, so pass 2 shares pass 1's engine without one")
            return
        rows = sum(r.rows for key, r in self.refs.items() if not self.storage.listed("p1", key)) // self.share
        self.auto = Auto(first.speculative, self.spec.model.max_in_flight, self.platform, rows)
        self.speculative = self.auto.current()

    def _drafts_optional(self) -> bool:
        """Whether this run's engines can decode a request without a draft on a speculative engine."""
        probe = getattr(self.make_engine, "no_draft", None)
        if probe is None:
            from batchjson.engine import internals

            return internals.no_draft_ready()
        return bool(probe)

    @functools.cached_property
    def platform(self) -> str:
        """"gpu" or "cpu", asked once (nvidia-smi) when speculation's auto policy first needs it."""
        from batchjson.engine.devices import visible_gpus

        return "gpu" if visible_gpus() else "cpu"

    def _engine_for(self, stage: str) -> tuple[Engine, bool]:
        """The engine for a unit of `stage`: the current one when it takes the stage, else a new one."""
        if self.engine is not None and self._takes(stage):
            return self.engine, True
        self._close_engine()
        p = self.by_stage[stage]
        speculative = self.speculative if p is self.passes[0] else None
        # On CPU the seed is engine-wide: seed the engine with the first seed any pass asks for, so that the
        # other pass's seed holds when it runs on this engine.
        seed = next((q.decoding.seed for q in self.passes if q.decoding.seed is not None), None)
        decoding = p.decoding if p.decoding.seed is not None else dataclasses.replace(p.decoding, seed=seed)
        engine = self.make_engine(self.spec, decoding, speculative)
        self.engine, self.takes = engine, self._taken_by(engine)
        return engine, False

    def _use(self, engine: Engine) -> None:
        """Give the engine each pass's sampling settings that it takes: pass 1 with drafts, pass 2 without."""
        for p in self.passes:
            if p.stage in self.takes:
                first = p is self.passes[0]
                engine.use(self.recipe.decoding if first and self.recipe else p.decoding, p.stage, draft=first)

    def _close_engine(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()

    def _decode(self, tracker: Tracker, stage: str, pairs: Iterator[Work]) -> None:
        """Decode, check and commit the units of `pairs` on an engine for `stage`, until the channel has no more
        for it.

        If the engine dies, a new one takes the rows that were in flight; after DEATHS_BEFORE_NO_SPECULATION
        deaths the worker goes on without speculation, and after DEATHS_BEFORE_GIVING_UP more it fails (committed
        units are kept, so the next run resumes). A stop never starts an engine: a signal that reached the
        engine processes too (Ctrl-C in a terminal) kills them, and that is not a death to recover from.
        """
        stats, auto = self.stats[stage], self.auto if stage == "p1" else None
        recipe = self.recipe
        feed, retry, deaths, since = tracker.feed(self._load(pairs)), [], 0, None
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                engine, reused = self._engine_for(stage)
            except EngineError as e:
                if not (auto and self.speculative):
                    raise
                auto.could_not_start(str(e))  # auto's own choice, not the user's: the job goes on without it
                self.speculative = None
                continue
            self._use(engine)
            stats.grammar = stats.grammar or (engine.choice.summary if engine.choice else "")
            stats.notice = stats.notice or engine.notice
            if not reused:
                start_s = time.monotonic() - t0
                stats.engine_starts += 1
                stats.engine_start_s += start_s
                if auto:
                    auto.started(start_s)
            if not reused or since is None:
                since = (time.monotonic(), engine.steps)  # this engine's decoding, for auto
            switch = threading.Event()
            try:
                wanted, resample = "stay", False
                decoded_with = recipe.current if recipe else ""  # pass 1's settings for this stream's requests

                def measure() -> None:  # this engine's decoding so far, as auto's measurement of its choice
                    auto.measure(time.monotonic() - since[0], engine.steps - since[1],
                                 engine.stats() if self.speculative else None)

                # itertools.chain, not a generator: a dead engine's stream must not close `feed` as it goes. What
                # it has not taken of `retry` when it ends stays in `again`.
                again = iter(retry)
                for gen in engine.stream(chain(again, feed), _Either(self.stop, switch)):
                    outcome = tracker.finish(gen)
                    if recipe and gen.prompt.stage == "p1" and (change := recipe.add(outcome, decoded_with)):
                        self._use(engine)  # the requests from now on
                        if change == "fallback":  # and those in flight again: most of them were failing
                            resample = True
                            switch.set()
                    if auto and auto.add(gen.output_tokens):
                        measure()
                        wanted = auto.wanted()
                        if wanted != "stay":
                            switch.set()
                if self.speculative:
                    stats.speculative = engine.stats()
                if recipe and (judged := recipe.report()):
                    self.stats["p1"].recipe = [judged]
                if auto:
                    if wanted == "stay":  # the stream ended: its numbers so far are the choice's measurement
                        measure()
                    stats.auto = [auto.report()]
                if self.stop.is_set():
                    return
                if wanted != "stay":  # auto tries (or goes back to) the other choice
                    self.speculative, retry = wanted, [*engine.unfinished, *again]
                    self._close_engine()
                    continue
                if resample:  # the same engine takes the rows in flight again with pass 1's new settings
                    retry = [*engine.unfinished, *again]
                    continue
                return
            except EngineDied as died:
                self._close_engine()
                if self.stop.is_set():
                    return
                deaths += 1
                retry = tracker.survivors(died.in_flight) + list(again)
                if self.speculative and deaths >= DEATHS_BEFORE_NO_SPECULATION:
                    self.speculative, deaths = None, 0
                    stats.note = f"speculation switched off after {DEATHS_BEFORE_NO_SPECULATION} engine deaths"
                elif deaths >= DEATHS_BEFORE_GIVING_UP:
                    raise EngineError(f"the engine died {deaths} times ({died}). Finished units are kept: rerun "
                                      "the same command to resume.") from died
                stats.note = stats.note or f"engine restarted after {deaths} death(s)"


class _Either:
    """Set when either event is: a stream stops on a signal, or when auto switches engines."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


def _first(pairs: Iterator[Work]) -> Work | None:
    """The first pair of `pairs` (None if it has none), waiting while the queue has none ready."""
    for pair in pairs:
        if pair is not WAIT:
            return pair
        time.sleep(0.01)
    return None

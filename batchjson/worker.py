"""One engine's share of a job: take units of either pass from the queue, load and render them, decode, check and
commit each one; recover from engine deaths; apply the answers of the adaptive policies (adapt/: pass 1's recipe,
auto's engine switches, the speculation audit). Every executor runs this body: inline in the runner's process, or as
a replica's whole life (`serve_replica`, at the end).

Both passes share the worker's engine where it decodes both (sampling is per request; pass 2's requests go
without a draft on a speculative engine, see engine/vllm/scheduler.py), so a unit's pass 2 decodes beside other units'
pass 1. An engine that does not decode a pass (a vLLM without the per-request draft switch, another grammar
backend; passes.decoded_by says) makes the worker ask only for the passes it decodes and park the rest;
when nothing else is left it changes engines.

Over 250 lines because the decode loop, engine deaths and the choice of work share one engine's state; Units,
the open units it moves, stays beside it.
"""

from __future__ import annotations

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

from batchjson.adapt.audit import Audit
from batchjson.adapt.auto import Auto
from batchjson.adapt.base import Answer, Policy, Resample, Switch
from batchjson.adapt.recipe import Recipe
from batchjson.engine import reaper
from batchjson.engine.base import Engine, EngineFactory, EngineFacts
from batchjson.errors import BatchjsonError, EngineDied, EngineError
from batchjson.executors.base import IDLE_POLL, Channel, Work, queue_channel
from batchjson.executors.placement import Placement
from batchjson.passes import decoded_by, engine_decoding, plan_passes
from batchjson.prompts import Renderer, chat_frame, chat_messages
from batchjson.records import FINAL, WAIT, Generation, Outcome, Prompt, Stage
from batchjson.report import PassStats
from batchjson.tables import PartSink
from batchjson.source import ParquetSource, UnitRef
from batchjson.spec import JobSpec, SpeculativeSpec
from batchjson.ends import run_ends
from batchjson.storage import Storage
from batchjson.schema.validate import Validator

# Engine deaths before speculation is switched off (grammar/speculation desyncs have killed engines in recent vLLM
# releases), and before the worker gives up without speculation.
DEATHS_BEFORE_NO_SPECULATION = 2
DEATHS_BEFORE_GIVING_UP = 3
# A row in flight at this many engine deaths is taken for the cause and fails with engine_error.
DEATHS_PER_ROW = 2

# A unit on its way into the engine: its stage, its key and its rows (prompts, or rows that already failed).
Loaded = tuple[Stage, str, list[Prompt | Generation]]


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


class Units:
    """The open units of one worker, each from its rows in to its commit: rows are counted as they finish, each
    checked here (the worker's one row check), and a unit whose last row finished is ready; the worker commits the
    ready units between the engine's rows (`commit_ready`), never inside the engine's refill (`feed`)."""

    def __init__(self, validator: Validator, stats: dict[Stage, PassStats],
                 commit: Callable[[Stage, str, list[Outcome]], None], stop: threading.Event, started: float):
        self.validator, self.stats, self.commit, self.stop = validator, stats, commit, stop
        self.started = started  # time.monotonic() at the run's start: first_request_s counts from it
        self.remaining: dict[Work, int] = {}
        self.outcomes: dict[Work, list[Outcome]] = {}
        self.ready: deque[Work] = deque()  # units whose every row finished, in the order they did
        self.paused = False  # the last feed ended to let ready units commit (see feed)
        self.deaths_seen: Counter = Counter()

    def feed(self, work: Iterable[Loaded]) -> Iterator[Prompt]:
        """Prompts for the engine; rows that failed before reaching it are finished here directly. When the queue has
        nothing ready (WAIT), the engine holds no row and units are ready, the feed ends (`paused`): the engine gives
        the worker its thread back only with a row, and those commits may be what the queue waits for."""
        self.paused = False
        for unit in work:
            if self.stop.is_set():
                return
            if unit is WAIT:
                if self.ready and not any(self.remaining.values()):  # every row fed is finished: none in flight
                    self.paused = True
                    return
                yield WAIT
                continue
            stage, key, items = unit
            self.remaining[stage, key], self.outcomes[stage, key] = len(items), []
            if not items:
                self.ready.append((stage, key))
            for item in items:
                if isinstance(item, Generation):
                    self.finish(item)
                else:
                    if self.stats[stage].first_request_s is None:
                        self.stats[stage].first_request_s = time.monotonic() - self.started
                    yield item

    def finish(self, gen: Generation) -> Outcome:
        """Check and count a row; the last one of its unit makes the unit ready to commit."""
        outcome = self.validator.check(gen)
        stage = gen.prompt.stage
        self.stats[stage].add(outcome.ok, outcome.reason, gen.prompt_tokens, gen.output_tokens)
        pair = (stage, gen.prompt.unit)
        self.outcomes[pair].append(outcome)
        self.remaining[pair] -= 1
        if self.remaining[pair] == 0:
            self.ready.append(pair)
        return outcome

    def commit_ready(self) -> None:
        """Commit every unit whose rows have all finished."""
        while self.ready:
            pair = self.ready.popleft()
            self.commit(*pair, self.outcomes.pop(pair))
            del self.remaining[pair]

    def survivors(self, in_flight: list[Prompt]) -> list[Prompt]:
        """After an engine death: the in-flight prompts to feed again; a row at its second death fails instead."""
        again = []
        for prompt in in_flight:
            self.deaths_seen[prompt.row_id] += 1
            if self.deaths_seen[prompt.row_id] >= DEATHS_PER_ROW:
                self.finish(Generation(prompt, error="engine_error", detail=f"in flight at {DEATHS_PER_ROW} engine "
                                       "deaths"))
            else:
                again.append(prompt)
        return again


class Worker:
    """One engine (replica) working through the queue. `storage` is the driver's (inline) or a replica's own,
    which never claims the folder: the driver holds it."""

    def __init__(self, spec: JobSpec, storage: Storage, source: ParquetSource, refs: dict[str, UnitRef],
                 owners: dict, engines: EngineFactory, stop: threading.Event, *, slot: int | None = None,
                 share: int = 1, started: float | None = None, left: int = 0):
        self.spec, self.storage, self.source, self.refs, self.owners = spec, storage, source, refs, owners
        self.left = left  # the rows pass 1 has left in the run (the driver's count), for speculation's auto policy
        self.engines, self.stop, self.slot, self.share = engines, stop, slot, share
        # The run's start (a replica's: its own), for first_request_s.
        self.started = time.monotonic() if started is None else started
        self.passes = plan_passes(spec)
        self.by_stage = {p.stage: p for p in self.passes}
        self.validator = Validator(spec.schema_doc, spec.schema.check_format)
        self.sink = PartSink(spec.input.id_column, source.passthrough_schema(), spec.schema_doc)
        self.engine: Engine | None = None
        self.decodes: tuple[Stage, ...] = ()  # the passes self.engine decodes (passes.decoded_by, at its start)
        self.parked: deque[Work] = deque()  # handed to this worker for a pass its engine does not decode
        self.stats = {p.stage: PassStats() for p in self.passes}
        self.speculative: SpeculativeSpec | None = self.passes[0].speculative  # pass 1's draft, now
        self.sampling = {p.stage: p.decoding for p in self.passes}  # each pass's sampling settings, now
        self.policies: list[Policy] = []

    @functools.cached_property
    def renderer(self) -> Renderer:
        """Made on first use: a run with nothing to render never loads the model's tokenizer, and one whose engine
        has started takes the engine's (Engine.tokenizer)."""
        from batchjson.engine import resolve_model

        model, prompt = resolve_model(self.spec.model.path), self.spec.prompt
        loaded = self.engine.tokenizer if self.engine is not None else None
        if prompt.messages:
            return Renderer(prompt, ("", ""), self.spec.input.id_column, self.spec.input.passthrough, self.owners,
                            chat=chat_messages(model, loaded))
        frame = chat_frame(model, prompt.system, loaded)
        return Renderer(prompt, frame, self.spec.input.id_column, self.spec.input.passthrough, self.owners)

    def serve(self, channel: Channel) -> None:
        """Work until the queue says the run is over (or a stop); then report this worker's counts per pass."""
        self.channel = channel
        self.policies = [p for p in (Recipe.for_job(self.spec), self._plan_auto(),
                                     Audit.for_job(self.passes[0].speculative)) if p]
        units = Units(self.validator, self.stats, self._commit, self.stop, self.started)
        try:
            while not self.stop.is_set():
                pairs = self._fitting(channel.work(self._wanted, hold=lambda: bool(self.parked)))
                if self.engine is None and not self.parked:
                    # The engine starts before the worker takes a unit: a replica started late (in a dead one's
                    # place) holds none through its start while the others could decode them.
                    stage = self._next_stage(channel)
                    if stage is None:  # the run is over, or a stop
                        break
                    self._decode(units, stage, pairs)
                    continue
                first = _first(pairs)
                if first is None:
                    if channel.ended == "end" and not self.parked:
                        break
                    self._close_engine()  # other stages have work this engine does not decode: the next one does
                    continue
                self._decode(units, first[0], chain([first], pairs))
            if units.remaining and not self.stop.is_set():
                raise RuntimeError(f"[internal] units left open: {sorted(units.remaining)[:3]}")
        finally:
            self._close_engine()
        for policy in self.policies:
            policy.report(self.stats[Stage.FIRST])
        first = self.stats[self.passes[0].stage]
        for p in self.passes[1:]:
            later = self.stats[p.stage]
            if later.rows and not later.engine_starts:
                later.first_note("shared-engine",
                                 "decoded on pass 1's engine, beside pass 1 (no engine start of its own)")
                later.grammar = later.grammar or first.grammar
        channel.send("stats", {stage: s.to_dict() for stage, s in self.stats.items() if s.rows or s.engine_starts})

    # -- which work this worker's engine decodes --------------------------------------------------------------

    def _next_stage(self, channel: Channel) -> Stage | None:
        """The stage to start an engine for, no unit taken yet (waiting while the queue has none for this worker);
        None at the run's end or a stop."""
        while not self.stop.is_set():
            stage = channel.upcoming(self._wanted())
            if stage is not None:
                return Stage(stage)
            if channel.ended == "end":
                return None
            time.sleep(IDLE_POLL)
        return None

    def _fits(self, stage: Stage) -> bool:
        return self.engine is None or stage in self.decodes  # no engine yet: the first unit picks it

    def _wanted(self) -> tuple[Stage, ...]:
        """The passes to ask the queue for: those the engine decodes (any, before it starts)."""
        return self.decodes if self.engine is not None else tuple(self.by_stage)

    def _fitting(self, work: Iterator[Work]) -> Iterator[Work]:
        """Parked pairs that fit the engine now first, then the channel's; a pair that does not fit is parked."""
        for _ in range(len(self.parked)):
            pair = self.parked.popleft()
            if self._fits(pair[0]):
                yield pair
            else:
                self.parked.append(pair)
        for pair in work:
            if pair is WAIT or self._fits(pair[0]):
                yield pair
            else:
                self.parked.append(pair)

    def _load(self, pairs: Iterator[Work]) -> Iterator[Loaded]:
        """The rows of each unit, as they are asked for (WAIT passes through: no unit is ready yet)."""
        for pair in pairs:
            if pair is WAIT:
                yield WAIT
                continue
            stage, key = pair
            if stage == Stage.FIRST:
                yield stage, key, list(self.renderer.render(self.source.unit(self.refs[key])))
            else:
                yield stage, key, self._requeued(key)

    def _requeued(self, key: str) -> list[Prompt]:
        cols = self.storage.commits.read_requeue(key).to_pydict()
        ids, texts = cols[self.spec.input.id_column], cols["prompt"]
        return [Prompt(ids[i], key, texts[i], {c: cols[c][i] for c in self.spec.input.passthrough}, Stage.SECOND)
                for i in range(len(ids))]

    def _commit(self, stage: Stage, key: str, outcomes: list[Outcome]) -> None:
        p = self.by_stage[stage]
        ok, final, retry = [], [], []
        for o in outcomes:
            (ok if o.ok else final if p.last or o.reason in FINAL else retry).append(o)
        ref = self.refs[key]
        n = stage.number
        tables = {"output": self.sink.valid(ok, n), "rejects": self.sink.rejected(final, n),
                  "requeue": self.sink.rejected(retry, n, with_prompt=True)}
        meta = {"file": ref.tag, "path": ref.file, "reasons": dict(Counter(o.reason for o in final))}
        if self.slot is not None:
            meta["replica"] = self.slot
        self.source.check_unchanged(ref)  # the last moment before the commit: nothing mixed is committed
        self.channel.send("done", self.storage.commits.commit(p.stage, key, tables, meta))

    # -- engines ----------------------------------------------------------------------------------------------

    def _plan_auto(self) -> Auto | None:
        first = self.passes[0]
        if first.speculative is None or first.speculative.method != "auto":
            return None
        if not (first.last or self.engines.drafts_optional):
            # Pass 2 could not run on a speculative engine here: a draft would cost it an engine start of its own.
            self.speculative = None
            self.stats[Stage.FIRST].note = self.stats[Stage.FIRST].event(
                "auto-no-speculation", "auto: no speculation: this vLLM cannot decode pass 2 without a draft on a "
                "speculative engine, so pass 2 shares pass 1's engine without one")
            return None
        auto = Auto.for_job(self.spec, first.speculative, self.engines, self.left // self.share)
        self.speculative = auto.current()
        return auto

    def _engine_for(self, stage: Stage) -> Engine | None:
        """The engine for a unit of `stage`: the current one when it decodes the stage, else a new one, started in
        this replica's turn on its GPUs (executors/base.py, Turns); None if a stop came first."""
        stats = self.stats[stage]
        if self.engine is None or not self._fits(stage):
            self._close_engine()
            p = self.by_stage[stage]
            decoding = engine_decoding(self.passes, p.decoding)
            speculative = self.speculative if p is self.passes[0] else None
            started = self._start(decoding, speculative)
            if started is None:
                return None
            engine, seconds = started
            self.engine, self.decodes = engine, decoded_by(engine, self.passes, self.speculative)
            for q in self.passes:  # each pass it decodes, with its sampling settings now: pass 1 with drafts
                if q.stage in self.decodes:
                    engine.use(self.sampling[q.stage], q.stage, draft=q is self.passes[0])
            stats.engine_starts += 1
            stats.engine_start_s += seconds
            if kept := engine.facts().kv_kept:
                stats.event("kv-size-kept", f"the engine's KV cache took the {kept / 2**30:.2f} GiB vLLM "
                            "measured at an earlier start of these settings on this kind of GPU: it started without "
                            "measuring the GPU's memory, beside any other replica on its GPU")
            for policy in self.policies:
                policy.engine_started(engine, stage, seconds)
        facts = self.engine.facts()
        stats.grammar = stats.grammar or facts.grammar
        if facts.notice and not stats.notice:
            stats.notice = stats.event(facts.notice_code or "engine-notice", facts.notice)
        return self.engine

    def _start(self, decoding, speculative) -> tuple[Engine, float] | None:
        """An engine with these settings and the seconds its start took, started in this replica's turn on its GPUs
        (executors/base.py, Turns): alone where it measures the GPU's memory. One given a size kept from an earlier
        start that fails (another process took memory since, say) forgets it and starts again, measuring. None if a
        stop came first."""
        alone = self.engines.measures(self.spec, decoding, speculative)
        while True:
            with self.channel.turn(self.stop, alone=alone) as go:
                if not go:
                    return None
                t0 = time.monotonic()
                try:
                    with reaper.stopping_on(self.stop):  # a stop fails the start at once (cancel within seconds)
                        return self.engines.start(self.spec, decoding, speculative), time.monotonic() - t0
                except EngineError:
                    if self.stop.is_set():
                        return None
                    if alone or not self.engines.measures(self.spec, decoding, speculative):
                        raise
            alone = True

    def _close_engine(self) -> None:
        """Close the engine in this replica's turn on its GPUs: memory freed under another engine's profiling is
        miscounted as much as memory taken (at once on a stop); beside other closes and starts that do not measure."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            with self.channel.turn(self.stop, alone=False):
                t0 = time.monotonic()
                engine.close()
                closer = next((s for s in reversed(self.decodes) if self.stats[s].rows), Stage.FIRST)
                self.stats[closer].engine_close_s += time.monotonic() - t0

    def _decode(self, units: Units, stage: Stage, pairs: Iterator[Work]) -> None:
        """Decode, check and commit the units of `pairs` on an engine for `stage`, until the channel has no more
        for it; after each row, apply the policies' answers (adapt/).

        A stop never starts an engine: a signal that reached the engine processes too (Ctrl-C in a terminal) kills
        them, and that is not a death to recover from (see `_died`).
        """
        loaded = self._load(pairs)
        feed, retry, deaths = units.feed(loaded), [], 0
        while not self.stop.is_set():
            try:
                engine = self._engine_for(stage)
            except EngineError as e:
                self._refused(stage, e)
                continue
            if engine is None:
                return
            ends, ending = threading.Event(), None  # an answer that ends this stream: Switch, or Resample again
            # itertools.chain, not a generator: a dead engine's stream must not close `feed` as it goes. What it has
            # not taken of `retry` when it ends stays in `again`.
            again = iter(retry)
            before = engine.facts()
            try:
                for gen in engine.stream(chain(again, feed), _Either(self.stop, ends)):
                    outcome = units.finish(gen)
                    units.commit_ready()
                    for policy in self.policies:
                        ending = self._apply(engine, policy.observe(engine, gen, outcome), ending)
                    if ending:
                        ends.set()
            except EngineDied as died:
                self._count_steps(stage, engine, before)
                self._close_engine()
                units.commit_ready()  # units the feed finished before the death
                if self.stop.is_set():
                    return
                retry = units.survivors(died.in_flight) + list(again)
                units.commit_ready()
                deaths = self._died(stage, died, deaths + 1)
                continue
            self._count_steps(stage, engine, before)
            if self.speculative:
                self.stats[stage].speculative = engine.stats()
            for policy in self.policies:
                policy.stream_ended(engine)
            units.commit_ready()  # units the feed finished after the engine's last row
            if self.stop.is_set():
                return
            if ending is None:
                if not units.paused:
                    return
                feed, retry = units.feed(loaded), []  # it paused for those commits: on to the queue's next units
                continue
            retry = [*engine.unfinished, *again]  # to the next engine (Switch) or this one again (Resample)
            if isinstance(ending, Switch):
                self.speculative = ending.speculative
                self._close_engine()

    def _count_steps(self, stage: Stage, engine: Engine, before: EngineFacts) -> None:
        """The engine steps a stream of `stage` took (since `before`), for the report's ms per step."""
        now = engine.facts()
        self.stats[stage].engine_steps += now.steps - before.steps
        self.stats[stage].engine_step_s += now.step_s - before.step_s

    def _apply(self, engine: Engine, answer: Answer, ending: Answer | None) -> Answer | None:
        """Apply a policy's answer now where it can be (pass 1's new settings, for the requests from now on); the
        answer that ends the stream, if any: a Switch wins over a Resample of the rows in flight."""
        if isinstance(answer, Resample):
            self.sampling[Stage.FIRST] = answer.decoding
            engine.use(answer.decoding, Stage.FIRST, draft=True)
            return ending or (answer if answer.again else None)
        if isinstance(answer, Switch):
            return answer
        return ending

    def _refused(self, stage: Stage, error: EngineError) -> None:
        """Pass 1's speculative engine did not start: a policy that chose it (auto) may go on with another; else
        the error is the user's to fix."""
        if self.by_stage[stage] is not self.passes[0] or self.speculative is None:
            raise error
        answer = next((a for a in (p.refused(str(error)) for p in self.policies) if isinstance(a, Switch)), None)
        if answer is None:
            raise error
        self.speculative = answer.speculative

    def _died(self, stage: Stage, died: EngineDied, deaths: int) -> int:
        """After the engine's `deaths`-th death in a row: go on without speculation after
        DEATHS_BEFORE_NO_SPECULATION, fail after DEATHS_BEFORE_GIVING_UP more (committed units are kept, so the
        next run resumes). The deaths counted from now on."""
        stats = self.stats[stage]
        if self.speculative and deaths >= DEATHS_BEFORE_NO_SPECULATION:
            self.speculative, deaths = None, 0
            stats.note = stats.event("speculation-off",
                                     f"speculation switched off after {DEATHS_BEFORE_NO_SPECULATION} engine deaths")
        elif deaths >= DEATHS_BEFORE_GIVING_UP:
            raise EngineError(f"the engine died {deaths} times ({died}). Finished units are kept: rerun the same "
                              "command to resume.") from died
        hung = "hung:" in str(died)
        if hung:
            stats.hung += 1
        if hung:
            stats.first_note("engine-hung", f"engine hung and was restarted (no step for "
                             f"{self.spec.model.hang_timeout_s:.0f} s, model.hang_timeout_s)")
        else:
            stats.first_note("engine-restarted", f"engine restarted after {deaths} death(s)")
        return deaths


class _Either:
    """Set when either event is: a stream stops on a signal, or on a policy's answer that ends it."""

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


def serve_replica(spec: JobSpec, output: str | None, shard: tuple[int, int], engines: EngineFactory, owners: dict,
                  stamps: dict, left: int, placement: Placement, slot: int, count: int, inbox, outbox) -> None:
    """The body of replica `slot` of `count` (a local process or a Ray actor) at `placement`: a worker on the
    driver's queue. The driver holds the folder; a replica never claims it, and neither plans the input nor lists
    the records: it makes the units it is handed from the footers (`ParquetSource.refs`), and is told the rows
    pass 1 has left (`left`)."""
    channel = queue_channel(slot, inbox, outbox)
    spec = placement.applied(spec)  # its share of the GPUs' memory
    try:
        source, storage = run_ends(spec, output, shard)
        source.stamps.update(stamps)  # the input as the driver found it: a change since is refused at the commit
        stop = threading.Event()
        with signals(stop):
            Worker(spec, storage, source, source.refs(shard), owners, engines, stop, slot=slot, share=count,
                   left=left).serve(channel)
    except BatchjsonError as e:
        channel.send("error", str(e))
    except BaseException as e:
        channel.send("error", f"[internal] {type(e).__name__}: {e}")
        raise

"""The driver's queue of units over both passes, and a worker's end of it: every executor hands out work this way.

The driver (job.py) holds a `Queue` of (stage, unit) pairs. A worker asks for work its engine can take; the queue
hands it one pair, says nothing fits now ("idle"), or that the run is over ("end"). When a unit's pass-1 commit
lands with rows to redo, its pass-2 pair joins the queue at once: the passes run as a pipeline, with no barrier
between them. A pass-2 pair is handed out only after its pass-1 commit is accepted, and a pass-1 pair is never
handed out again after that, so pass 2 always reads the requeue file of the unit's final pass-1 commit.

Messages, worker -> driver: ("want", slot, stages[, take]) (take False: which stage would come, none handed
out), ("done", slot, record) with the unit's commit record,
("stats", slot, {stage: PassStats dict}), ("error", slot, message), and around each engine start or close,
("turn", slot, gpus, alone) then ("turned", slot). Driver -> worker: the queue's replies, ("unit", stage, key) |
("idle", others) | ("end",), and ("go",) when it is the worker's turn.

Turns: replicas that share a GPU start (and close) their engines one at a time. vLLM sizes an engine's KV cache by
profiling: it measures the GPU's memory before and after a dummy forward pass and charges every change to itself,
another process's allocations included (vllm/v1/worker/gpu_worker.py, determine_available_memory, in 0.26 as in
0.32). Two engines starting side by side each count the other's weights and cache as their own, and the second finds
no memory for its cache ("No available memory for the cache blocks"). Started one after the other, each profiles a
GPU whose other engines hold still, and gets its gpu_memory_utilization share (placement.py). An explicit
kv_cache_memory_bytes skips the profiling; a guess of each engine's other memory (activations, CUDA graphs, per model
and vLLM version) could not size it (too large runs out of memory mid-run, too small decodes fewer rows at once), but
vLLM's own measurement of the same settings can: engine/kv_sizes.py keeps it from an engine's first start. A start
that measures goes alone; starts given a kept size, and closes, go side by side (`Turns`, `alone`), never beside one
that measures.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from batchjson.errors import EngineError
from batchjson.records import WAIT, Stage

# A replica that dies is replaced this many times per slot before the run gives up (its units are kept).
RESPAWNS_PER_SLOT = 2
TICK = 0.2  # seconds between the driver's looks at its replicas
DRAIN = 0.01  # seconds the driver waits for a message already sent (Ray's queue answers a wait of 0 with none)
IDLE_POLL = 0.05  # seconds a worker waits before asking again when nothing fits now

Work = tuple[Stage, str]  # (stage, unit key)


class Queue:
    """Every (stage, unit) pair of the run that is not committed yet: pending, or held by a worker."""

    def __init__(self, todo: dict[str, list[str]], follows: dict[str, str],
                 expired: Callable[[], bool] = lambda: False):
        self.lock = threading.Lock()
        self.expired = expired  # whether the run's deadline has come: no unit is handed out from then on
        self.pending = {stage: deque(keys) for stage, keys in todo.items()}
        self.left = {(stage, key) for stage, keys in todo.items() for key in keys}
        self.follows = follows  # stage -> the stage its failed rows go to
        self.held: dict[int, set[Work]] = defaultdict(set)
        self.starting: set[int] = set()  # workers told to start an engine for pending pairs, taking none yet
        self.first_handed: dict[str, float] = {}
        self.last_done: dict[str, float] = {}

    def want(self, slot: int, stages: Iterable[str], take: bool = True) -> tuple:
        """The next pair of `stages` for `slot` ("unit", stage, key), ("idle", whether other stages have work) or
        ("end",). `take` False: the pair that would come, left pending (a worker starts its engine for its stage
        before it takes one), and only while the pending pairs outnumber the workers already told so: a run of
        fewer units than replicas starts no engine for nothing."""
        stages = tuple(stages)
        with self.lock:
            if self.expired():  # the units held are finished and committed; the rest wait for the next run
                return ("end",)
            if take:
                self.starting.discard(slot)
            elif sum(len(self.pending.get(stage, ())) for stage in stages) <= len(self.starting - {slot}):
                stages = ()  # as many engines start for them as there are pairs
            # A unit's pass 2 before more first passes: it is the older work, and the tail of the run stays short.
            for stage in sorted(stages, reverse=True):
                if self.pending.get(stage):
                    if not take:
                        self.starting.add(slot)
                        return ("unit", stage, self.pending[stage][0])
                    key = self.pending[stage].popleft()
                    self.held[slot].add((stage, key))
                    self.first_handed.setdefault(stage, time.monotonic())
                    return ("unit", stage, key)
            if not self.left:
                return ("end",)
            return ("idle", any(keys for stage, keys in self.pending.items() if stage not in stages))

    def add(self, stage: str, keys: list[str]) -> None:
        """More units for `stage`, handed out after those pending (units found damaged beside the run, start.py)."""
        with self.lock:
            self._add(stage, keys)

    def _add(self, stage: str, keys: list[str]) -> None:
        self.pending.setdefault(stage, deque()).extend(keys)
        self.left.update((stage, key) for key in keys)

    def done(self, slot: int, stage: str, key: str, requeued: int) -> bool:
        """A worker committed (stage, key); False if that was already accepted (the pair was redone)."""
        with self.lock:
            self.held[slot].discard((stage, key))
            if (stage, key) not in self.left:
                return False
            self.left.discard((stage, key))
            self.last_done[stage] = time.monotonic()
            after = self.follows.get(stage)
            if requeued and after:
                self._add(after, [key])
            return True

    def lost(self, slot: int) -> list[Work]:
        """A worker died: the pairs it held go back to the front of the queue."""
        with self.lock:
            self.starting.discard(slot)
            back = sorted(self.held.pop(slot, set()) & self.left, reverse=True)
            for stage, key in back:
                self.pending[stage].appendleft(key)
            return back

    @property
    def finished(self) -> bool:
        """Every pair committed, or the deadline passed and every pair handed out committed."""
        return not self.left or (self.expired() and not any(self.held.values()))

    def seconds(self, stage: str) -> float:
        """From the stage's first hand-out to its last accepted commit (passes overlap, so each has its own)."""
        start, end = self.first_handed.get(stage), self.last_done.get(stage)
        return round(end - start, 2) if start is not None and end is not None and end >= start else 0.0


class Channel:
    """A worker's end of the queue: work arrives one ahead of need, fetched by a thread, so the engine never waits
    for the driver while it has work in flight.

    `ask(stages, take)` sends a want and returns the queue's reply; `send(kind, *payload)` reports to the driver.
    `prefetch=False` (the queue is in this process, and answers at once): ask when the engine wants work.
    """

    def __init__(self, ask: Callable[[tuple, bool], tuple], send: Callable[..., None], prefetch: bool = True,
                 wait_turn: Callable[[threading.Event, bool], bool] | None = None):
        self.ask, self.send, self.prefetch, self.wait_turn = ask, send, prefetch, wait_turn
        self.ended = ""  # how the last `work` ended: "end" (the run is over) or "idle" (other stages have work)

    @contextmanager
    def turn(self, stop: threading.Event, alone: bool = True) -> Iterator[bool]:
        """This worker's turn to start or close an engine on its GPUs (see Turns): `alone`, for a start that
        measures the GPU's memory, while other replicas on them do neither; else beside their closes and starts
        that measure nothing. True once it is; False on a stop first. A worker alone on its GPUs (or on none) goes
        at once."""
        go = self.wait_turn(stop, alone) if self.wait_turn else True
        try:
            yield go
        finally:
            if self.wait_turn:
                self.send("turned")  # also withdraws a wait a stop cut short

    def upcoming(self, stages: tuple) -> str | None:
        """The stage of the pair the queue would hand out next, none taken; None when none is ready for this worker
        now (`ended` is "end" when the run is over)."""
        reply = self.ask(stages, False)
        if reply[0] == "end":
            self.ended = "end"
        return reply[1] if reply[0] == "unit" else None

    def work(self, stages: Callable[[], tuple], hold: Callable[[], bool] = lambda: False) -> Iterator[Work]:
        """(stage, key) pairs of the stages `stages()` names (asked anew each time); WAIT while none is ready. Ends
        when the run is over, or when nothing fits but other stages have work, or `hold()` (the worker holds work
        its engine cannot take): then the worker changes engines."""
        if not self.prefetch:
            while True:
                reply = self.ask(stages(), True)
                if reply[0] == "unit":
                    yield reply[1], reply[2]
                elif reply[0] == "idle" and not reply[1] and not hold():
                    yield WAIT  # the engine steps what it holds; its commits may bring work
                else:
                    self.ended = reply[0]
                    return
        ready: queue.Queue = queue.Queue(maxsize=1)

        def fetch():
            while True:
                reply = self.ask(stages(), True)
                if reply[0] == "idle" and not reply[1] and not hold():
                    time.sleep(IDLE_POLL)  # nothing for anyone now: units in flight elsewhere may bring some
                    continue
                ready.put(reply)
                if reply[0] != "unit":
                    return

        threading.Thread(target=fetch, name="batchjson-fetch", daemon=True).start()
        while True:
            try:
                reply = ready.get(timeout=0.002)
            except queue.Empty:
                yield WAIT
                continue
            if reply[0] != "unit":
                self.ended = reply[0]
                return
            yield reply[1], reply[2]


class Turns:
    """Whose turn it is to start or close an engine on each GPU (group), in the order asked: a start that measures
    the GPU's memory goes alone; closes and starts that measure nothing go side by side, never beside one that
    measures. A replica that dies in its turn passes it on."""

    def __init__(self):
        self.holders: dict[str, set[int]] = defaultdict(set)
        self.alone: dict[str, bool] = {}  # gpus -> whether its holder holds it alone
        self.waiting: dict[str, deque[tuple[int, bool]]] = defaultdict(deque)
        self.where: dict[int, str] = {}

    def ask(self, slot: int, gpus: str, alone: bool = True) -> bool:
        """Whether `slot` may go now (else it waits for release to name it); `alone`: its start measures."""
        self.where[slot] = gpus
        if self.waiting[gpus] or not self._fits(gpus, alone):
            self.waiting[gpus].append((slot, alone))
            return False
        self._hold(gpus, slot, alone)
        return True

    def release(self, slot: int) -> list[int]:
        """`slot` is done (or dead, or gave up waiting): the slots whose turn it is now."""
        gpus = self.where.pop(slot, None)
        if gpus is None:
            return []
        waiting = self.waiting[gpus]
        for entry in waiting:
            if entry[0] == slot:
                waiting.remove(entry)
                break
        else:
            self.holders[gpus].discard(slot)
        after = []
        while waiting and self._fits(gpus, waiting[0][1]):
            after.append(waiting[0][0])
            self._hold(gpus, *waiting.popleft())
        return after

    def _fits(self, gpus: str, alone: bool) -> bool:
        return not self.holders[gpus] or not (alone or self.alone[gpus])

    def _hold(self, gpus: str, slot: int, alone: bool) -> None:
        self.holders[gpus].add(slot)
        self.alone[gpus] = alone


class Pool:
    """The workers of a run and their mailboxes; subclasses start them in this process (inline.py), as processes
    (local.py) or as Ray actors (ray.py), and carry their messages: the driver's into a worker's inbox (`put`), the
    workers' to the driver each subclass its own way (`receive`: those that came within `timeout`). Each replica gets
    its placement (placement.py): the GPUs it sees, its share of their memory. A pool is closed when its run is over
    (`with pool:`)."""

    def __init__(self, target: Callable, args: tuple, layout):
        self.target, self.args, self.layout = target, args, layout
        self.slots = list(layout.placements)
        self.turns = Turns()
        self.respawns = [0] * len(self.slots)
        self.live: dict[int, object] = {}
        self.inboxes: dict[int, object] = {}
        self.committed: set[int] = set()  # the live workers with an accepted commit
        for slot in range(len(self.slots)):
            self._spawn(slot)

    def _spawn(self, slot: int) -> None: ...
    def receive(self, timeout: float) -> list[tuple]: ...
    def dead(self) -> list[int]: ...
    def stop(self) -> None: ...
    def dismiss(self, slot: int) -> None: ...
    def close(self) -> None: ...

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def replace(self, slot: int) -> bool:
        """Start a new worker in a dead one's place; False once the slot has used up its respawns."""
        del self.live[slot]
        self.committed.discard(slot)
        if self.respawns[slot] >= RESPAWNS_PER_SLOT:
            return False
        self.respawns[slot] += 1
        self._spawn(slot)
        return True

    def put(self, slot: int, message: tuple) -> None:
        self.inboxes[slot].put(message)

    def drive(self, work: Queue, stop: threading.Event, on_done: Callable, on_stats: Callable,
              on_note: Callable[[str, str, str], None]) -> None:
        """Serve the workers until every pair is committed and every worker has reported: hand out work, take back
        a dead worker's pairs (a new worker takes its place). Each accepted commit goes to `on_done(record)`, its
        commit record as the worker wrote it (the driver reads none back: a GET each on object storage). Deaths are
        noted on the stage of the work they cost (`on_note(stage, code, text)`, code a report.NoteCode)."""
        reported: set[int] = set()

        def take(message: tuple) -> None:
            kind, slot, *payload = message
            if kind == "error":
                self.stop()
                raise EngineError(f"replica {slot}: {payload[0]}")
            if slot not in self.live:
                return  # from a worker already replaced: its pairs were handed to others
            if kind == "stats":
                reported.add(slot)
            self.answer(work, on_done, on_stats, slot, kind, *payload)

        while True:
            if stop.is_set():
                self.stop()
                return
            dead = self.dead()
            # A worker sends its last commits and its stats before it returns, but Ray may report the return before
            # the driver has read them: what was sent is taken first (for at most a TICK, as idle workers keep
            # asking), so that a worker that finished is not taken for one that died (noted "replica-died",
            # replaced, its last commits handed out again).
            until = time.monotonic() + TICK
            while dead and time.monotonic() < until and (messages := self.receive(DRAIN)):
                for message in messages:
                    take(message)
            for slot in dead:
                self._go(*self.turns.release(slot))
                lost = work.lost(slot)
                if slot in reported and not lost:
                    continue  # it finished and then exited: the end of the run, or a crash after it
                for stage in sorted({stage for stage, _ in lost}) or [Stage.FIRST]:
                    count = sum(s == stage for s, _ in lost)
                    on_note(stage, "replica-died", f"replica {slot} died; {count} open unit(s) handed to others")
                reported.discard(slot)
                if not self.replace(slot) and not self.live:
                    raise EngineError(f"every replica died (each slot restarted {RESPAWNS_PER_SLOT} times). "
                                      "Finished units are kept: rerun the same command to resume.")
            if work.finished:
                waiting = set(self.live) - reported
                if not waiting & self.committed:
                    # Those still out committed nothing and hold nothing (one started in a dead one's place, most
                    # likely, its engine still starting): the run does not wait for them.
                    for slot in waiting:
                        self.dismiss(slot)
                    return
            for message in self.receive(TICK):
                take(message)

    def answer(self, work: Queue, on_done: Callable, on_stats: Callable, slot: int, kind: str, *payload) -> None:
        """One message of a live worker (see the module's docstring): the one dispatch of every pool."""
        if kind == "want":
            self.put(slot, work.want(slot, *payload))
        elif kind == "done":  # the commit record: the driver reads nothing back
            record = payload[0]
            if work.done(slot, record["stage"], record["key"], record["rows"].get("requeue", 0)):
                self.committed.add(slot)
                on_done(record)
        elif kind == "stats":
            on_stats(payload[0])
        elif kind == "turn":
            if self.turns.ask(slot, *payload):
                self._go(slot)
        elif kind == "turned":
            self._go(*self.turns.release(slot))

    def _go(self, *slots: int) -> None:
        for slot in slots:
            if slot in self.live:
                self.put(slot, ("go",))


def queue_channel(slot: int, inbox, outbox) -> Channel:
    """A worker's channel over its inbox (`get`) and its outbox (`put`): a local process's queue and pipe, or a Ray
    actor's two queues. One question at a time: a reply is the answer to the question just asked, whichever
    thread asked it (the fetch thread's wants, the worker's turn)."""
    from batchjson.engine.devices import gpus_here

    asking = threading.Lock()
    gpus = gpus_here()

    def ask(stages: tuple, take: bool) -> tuple:
        with asking:
            outbox.put(("want", slot, stages, take))
            return inbox.get()

    def wait_turn(stop: threading.Event, alone: bool) -> bool:
        with asking:  # the fetch thread waits meanwhile: this worker decodes nothing while it starts or closes one
            outbox.put(("turn", slot, gpus, alone))
            while not stop.is_set():
                try:
                    return inbox.get(timeout=TICK)[0] == "go"
                except queue.Empty:  # ray.util.queue.Empty is one too
                    continue
            return False

    return Channel(ask, lambda kind, *payload: outbox.put((kind, slot, *payload)),
                   wait_turn=wait_turn if gpus else None)

"""Where decoding runs when one engine is not enough: one engine replica per GPU (or per tensor-parallel group) of
this host, as local processes, or as Ray actors over a cluster. Replicas pull units from one queue held by the
runner, so a slow replica never holds the others up.

The runner (the driver) owns the output folder: it plans the units, hands each one to exactly one live replica,
and takes it back when that replica dies. A replica decodes, checks and commits its units itself, with the same
commit protocol as a single run (storage.py), and says so. So whatever dies, a unit is either committed once or
redone by another replica: the ledger is the same as for a single engine, and so is the final check.

Messages, replica -> driver: ("want", slot, stage), ("done", slot, stage, key, rows), ("stats", slot, stage, dict),
("error", slot, message). Driver -> replica: ("unit", stage, key) or ("end", stage, None).
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterator

from batchjson.errors import EngineError, SpecError
from batchjson.records import WAIT

# A replica that dies is replaced this many times per slot before the run gives up (its units are kept).
RESPAWNS_PER_SLOT = 2
TICK = 0.2  # seconds between the driver's looks at its replicas
# torch's thread pool per GPU replica, unless OMP_NUM_THREADS says otherwise: 4 made two replicas on one host faster
# and left one replica's time as it was; pinning each replica to its own cores on top of that gained nothing
# (BENCHMARKS.md, "Scaling over the GPUs of one host", "5,000 rows, no speculation").
THREADS_PER_REPLICA = 4


def visible_gpus() -> list[str]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi), without initialising CUDA here."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def gpus_per_replica(engine: dict) -> int:
    return int(engine.get("tensor_parallel_size", 1)) * int(engine.get("pipeline_parallel_size", 1))


def local_layout(requested: int | None, engine: dict) -> list[str | None]:
    """The device list of each local replica: every GPU of the host in groups of gpus_per_replica, or as many as
    asked for. Without GPUs (a CPU build) one replica, or as many CPU replicas as asked for."""
    gpus, per = visible_gpus(), gpus_per_replica(engine)
    if not gpus:
        return [None] * (requested or 1)
    fit = len(gpus) // per
    if fit == 0:
        raise SpecError(f"[model.engine] asks for {per} GPUs per replica, but this host shows {len(gpus)}.")
    n = requested or fit
    if n > fit:
        raise SpecError(f"--replicas {n}: this host has {len(gpus)} GPU(s), room for {fit} replica(s) of {per} GPU(s). "
                        "Ask for fewer, or run on a Ray cluster (--ray).")
    return [",".join(gpus[i * per:(i + 1) * per]) for i in range(n)]


class Channel:
    """A replica's end of the queue: units arrive one ahead of need, fetched by a thread, so the engine never
    waits for the driver while it has work in flight."""

    def __init__(self, slot: int, inbox, outbox, replicas: int = 1):
        self.slot, self.inbox, self.outbox, self.replicas = slot, inbox, outbox, replicas

    def send(self, kind: str, *payload) -> None:
        self.outbox.put((kind, self.slot, *payload))

    def keys(self, stage: str) -> Iterator[str]:
        """The keys the driver hands this replica in one pass; WAIT while none is ready; ends with the pass."""
        ready: queue.Queue = queue.Queue(maxsize=1)

        def fetch():
            while True:
                self.send("want", stage)
                kind, _, key = self.inbox.get()
                ready.put(key if kind == "unit" else None)
                if kind != "unit":
                    return

        threading.Thread(target=fetch, name=f"batchjson-fetch-{stage}", daemon=True).start()
        while True:
            try:
                key = ready.get(timeout=0.002)
            except queue.Empty:
                yield WAIT
                continue
            if key is None:
                return
            yield key


class _Pool:
    """Replicas and their mailboxes; subclasses start them as processes or as Ray actors."""

    def __init__(self, target: Callable, args: tuple, slots: list):
        self.target, self.args, self.slots = target, args, slots
        self.respawns = [0] * len(slots)
        self.live: dict[int, object] = {}
        self.early: list[tuple] = []  # requests for the next pass, made before this one ended
        self.inboxes: dict[int, object] = {}
        self.outbox = self._queue()
        for slot in range(len(slots)):
            self._spawn(slot)

    def _queue(self): ...
    def _spawn(self, slot: int) -> None: ...
    def dead(self) -> list[int]: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...

    def replace(self, slot: int) -> bool:
        """Start a new replica in a dead one's place; False once the slot has used up its respawns."""
        del self.live[slot]
        if self.respawns[slot] >= RESPAWNS_PER_SLOT:
            return False
        self.respawns[slot] += 1
        self._spawn(slot)
        return True

    def put(self, slot: int, message: tuple) -> None:
        self.inboxes[slot].put(message)

    empty: type[Exception] = queue.Empty

    def get(self, timeout: float):
        try:
            return self.outbox.get(timeout=timeout)
        except self.empty:
            return None


class LocalPool(_Pool):
    """One process per replica on this host, each seeing only its own GPUs. They die with the runner."""

    def _queue(self):
        import multiprocessing

        self.mp = multiprocessing.get_context("spawn")  # vLLM and CUDA need spawn
        return self.mp.Queue()

    def _spawn(self, slot: int) -> None:
        inbox = self.inboxes[slot] = self.mp.Queue()
        process = self.mp.Process(target=_local, args=(self.target, self.slots[slot], *self.args, slot,
                                                       len(self.slots), inbox, self.outbox),
                                  name=f"batchjson-replica-{slot}", daemon=False)
        process.start()
        self.live[slot] = process

    def dead(self) -> list[int]:
        return [slot for slot, p in self.live.items() if p.exitcode is not None]

    def stop(self) -> None:
        for p in self.live.values():
            if p.exitcode is None:
                p.terminate()  # SIGTERM: the replica stops at its next engine step, its finished units committed

    def close(self) -> None:
        for p in self.live.values():
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
                p.join()


def _local(target: Callable, devices: str | None, *args) -> None:
    """A local replica process: it sees only its own GPUs (its engine processes inherit them, and a small torch
    thread pool), and dies with the runner however the runner dies."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
        os.environ.setdefault("OMP_NUM_THREADS", str(THREADS_PER_REPLICA))
    from batchjson.vllm_plugin import register

    register()  # BATCHJSON_RUNNER_PID is the runner's here (see vllm_plugin.py)
    target(*args)


class RayPool(_Pool):
    """One Ray actor per replica, placed by Ray on the cluster's nodes (num_gpus GPUs each)."""

    def __init__(self, target: Callable, args: tuple, slots: list, gpus: int, cpus: float):
        import ray
        from ray.util.queue import Empty, Queue

        self.ray, self.Queue, self.empty = ray, Queue, Empty
        self.actor_class = ray.remote(num_gpus=gpus, num_cpus=cpus, max_restarts=0)(RayReplica)
        self.actors: dict[int, object] = {}
        super().__init__(target, args, slots)

    def _queue(self):
        return self.Queue()

    def _spawn(self, slot: int) -> None:
        inbox = self.inboxes[slot] = self.Queue()
        actor = self.actors[slot] = self.actor_class.remote()
        self.live[slot] = actor.serve.remote(self.target, (*self.args, slot, len(self.slots), inbox, self.outbox))

    def dead(self) -> list[int]:
        refs = list(self.live.values())
        finished, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        return [slot for slot, ref in self.live.items() if ref in finished]

    def stop(self) -> None:
        for slot in list(self.live):
            self.ray.kill(self.actors[slot])  # an actor has no signal to catch: its open units are redone next run

    def close(self) -> None:
        for slot, ref in self.live.items():
            try:
                self.ray.get(ref, timeout=60)
            except Exception:
                self.ray.kill(self.actors[slot])


class RayReplica:
    """The Ray actor around a replica's body (the same function a local replica process runs)."""

    def serve(self, target: Callable, args: tuple) -> None:
        target(*args)


def ray_pool(target: Callable, args: tuple, address: str, requested: int | None, engine: dict) -> RayPool:
    """Connect to the Ray cluster at `address` ("auto": RAY_ADDRESS or a new local one) and place the replicas."""
    try:
        import ray
    except ImportError:
        raise SpecError("--ray needs Ray: pip install 'batchjson[ray]'.") from None
    if not ray.is_initialized():
        try:
            ray.init(address=None if address == "auto" else address, log_to_driver=False,
                     runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                               if k.startswith(("BATCHJSON_", "VLLM_", "HF_", "AWS_"))}})
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise SpecError(f"--ray {address}: cannot connect to a Ray cluster ({e}).") from None
    per = gpus_per_replica(engine)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus:
        n = requested or gpus // per
        if n < 1 or n * per > gpus:
            raise SpecError(f"the Ray cluster has {gpus} GPU(s): room for {gpus // per} replica(s) of {per} GPU(s), "
                            f"not {n}.")
        return RayPool(target, args, [None] * n, gpus=per, cpus=1)
    return RayPool(target, args, [None] * (requested or 1), gpus=0, cpus=1)


def dispatch(pool: _Pool, stage: str, keys: list[str], on_done: Callable[[str, int], None],
             on_stats: Callable[[dict], None], stop: threading.Event) -> list[str]:
    """Run one pass over the replicas: hand out `keys` one at a time to whoever asks, take back the units of a
    replica that dies (a new one takes its place), and return when every unit is committed and every replica has
    reported. Returns notes on what happened (deaths, respawns)."""
    pending, held = deque(keys), {slot: set() for slot in pool.live}
    left, parked, reported, notes = set(keys), set(), set(), []
    early, pool.early = pool.early, []
    while True:
        if stop.is_set():
            pool.stop()
            return notes
        for slot in pool.dead():
            lost = held.pop(slot, set())
            parked.discard(slot)
            if slot in reported and not lost:
                continue  # it finished this pass and then exited: the end of the run, or a crash after it
            pending.extendleft(sorted(lost & left, reverse=True))
            notes.append(f"replica {slot} died in pass {stage[1]}; {len(lost & left)} open unit(s) handed to others")
            if pool.replace(slot):
                held[slot] = set()
            elif not pool.live:
                raise EngineError(f"every replica died (each slot restarted {RESPAWNS_PER_SLOT} times). Finished units "
                                  "are kept: rerun the same command to resume.")
        while parked and (pending or not left):
            slot = parked.pop()
            _hand(pool, slot, stage, pending, held)
        if not left and set(pool.live) <= reported:
            return notes
        message = early.pop(0) if early else pool.get(TICK)
        if message is None:
            continue
        kind, slot, *payload = message
        if kind == "error":
            pool.stop()
            raise EngineError(f"replica {slot}: {payload[0]}")
        if slot not in pool.live:
            continue  # from a replica already replaced
        if kind == "want":
            if payload[0] < stage:  # a new replica catching up through passes that are over
                pool.put(slot, ("end", payload[0], None))
            elif payload[0] > stage:  # a replica done with this pass asks for the next one: answered there
                pool.early.append(message)
            elif pending or not left:
                _hand(pool, slot, stage, pending, held)
            else:
                parked.add(slot)  # nothing to hand out now; a unit may come back from a replica that dies
        elif kind == "done" and payload[0] == stage:
            key, rows = payload[1], payload[2]
            held.get(slot, set()).discard(key)
            if key in left:
                left.discard(key)
                on_done(key, rows)
        elif kind == "stats" and payload[0] == stage:
            reported.add(slot)
            on_stats(payload[1])


def _hand(pool: _Pool, slot: int, stage: str, pending: deque, held: dict) -> None:
    if pending:
        key = pending.popleft()
        held.setdefault(slot, set()).add(key)
        pool.put(slot, ("unit", stage, key))
    else:
        pool.put(slot, ("end", stage, None))


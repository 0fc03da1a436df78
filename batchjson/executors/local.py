"""Workers as local processes, one per replica: by default one per GPU (or tensor-parallel group) of this host,
model.replicas_per_gpu per GPU when set, each seeing only its own GPUs. They die with the runner.

Each replica sends to the driver down a pipe of its own, which ends when the replica dies. A queue shared by all (a
multiprocessing.Queue) does not survive a replica killed while it sends: the queue's write lock stays held, or half a
message stays in its pipe, and every other replica's messages wait behind it for good."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from batchjson.engine.devices import host_cores
from batchjson.executors.base import Pool
from batchjson.executors.placement import Placement

# torch's thread pool per GPU replica, unless OMP_NUM_THREADS says otherwise (BENCHMARKS.md, "Scaling over the GPUs
# of one host", "5,000 rows, no speculation"); fewer where the host's cores, split among its replicas, give fewer.
THREADS_PER_REPLICA = 4


def threads_per_replica(replicas: int, cores: int) -> int:
    """torch's threads for each of `replicas` GPU replicas on `cores` cores."""
    return max(1, min(THREADS_PER_REPLICA, cores // replicas))


class LocalPool(Pool):
    """One process per replica on this host."""

    def __init__(self, target: Callable, args: tuple, layout):
        import multiprocessing

        self.mp = multiprocessing.get_context("spawn")  # vLLM and CUDA need spawn
        self.pipes: dict[int, Connection] = {}  # slot -> the driver's end of its replica's pipe
        super().__init__(target, args, layout)

    def _spawn(self, slot: int) -> None:
        inbox = self.inboxes[slot] = self.mp.Queue()
        self._drop(slot)  # a replaced replica's pipe, with what it left unread: its units went to others
        self.pipes[slot], outbox = self.mp.Pipe(duplex=False)
        process = self.mp.Process(target=_local, args=(self.target, self.slots[slot], self.args, slot,
                                                       len(self.slots), inbox, outbox),
                                  name=f"batchjson-replica-{slot}", daemon=False)
        process.start()
        outbox.close()  # the replica holds the only sending end left: its death ends the pipe
        self.live[slot] = process

    def receive(self, timeout: float) -> list[tuple]:
        """A message from each replica that sent one (waiting up to `timeout` for the first). A pipe that ends, at a
        message's end or in its middle, is dropped: its replica died, and `dead` says so."""
        ready = wait(list(self.pipes.values()), timeout)
        messages = []
        for slot, pipe in list(self.pipes.items()):
            if pipe in ready:
                try:
                    messages.append(pipe.recv())
                except (EOFError, OSError):  # OSError: "got end of file during message"
                    self._drop(slot)
        return messages

    def _drop(self, slot: int) -> None:
        if slot in self.pipes:
            self.pipes.pop(slot).close()

    def dead(self) -> list[int]:
        return [slot for slot, p in self.live.items() if p.exitcode is not None]

    def stop(self) -> None:
        for p in self.live.values():
            if p.exitcode is None:
                p.terminate()  # SIGTERM: the replica stops at its next engine step, its finished units committed

    def dismiss(self, slot: int) -> None:
        self.live[slot].kill()  # it holds nothing; its engine processes die with it (engine/reaper.py)

    def close(self) -> None:
        for p in self.live.values():
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
                p.join()
        for slot in list(self.pipes):
            self._drop(slot)


class Outbox:
    """A replica's end of its pipe to the driver. Its threads all send (the fetch thread its wants, the worker its
    commits and turns): one whole message at a time."""

    def __init__(self, pipe: Connection):
        self.pipe, self.lock = pipe, threading.Lock()
        # A process forked here (vLLM's engine core) keeps no copy: the pipe ends when the replica dies, not after.
        os.register_at_fork(after_in_child=pipe.close)

    def put(self, message: tuple) -> None:
        with self.lock:
            self.pipe.send(message)


def _local(target: Callable, placement: Placement, args: tuple, slot: int, count: int, inbox,
           outbox: Connection) -> None:
    """A local replica process: it sees only its own GPUs (its engine processes inherit them, and its share of the
    host's cores for torch's threads), and dies with the runner however the runner dies. It reads its inbox (a
    queue) and sends down its own pipe."""
    if placement.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.devices
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_replica(count, host_cores())))
    from batchjson.engine.plugin import register

    register(replica=True)  # BATCHJSON_RUNNER_PID is the runner's here (see engine/plugin.py)
    target(*args, placement, slot, count, inbox, Outbox(outbox))

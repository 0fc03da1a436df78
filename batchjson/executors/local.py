"""Workers as local processes, one per replica: by default one per GPU (or tensor-parallel group) of this host,
model.replicas_per_gpu per GPU when set, each seeing only its own GPUs. They die with the runner."""

from __future__ import annotations

import os
from collections.abc import Callable

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

    def _queue(self):
        import multiprocessing

        self.mp = multiprocessing.get_context("spawn")  # vLLM and CUDA need spawn
        return self.mp.Queue()

    def _spawn(self, slot: int) -> None:
        inbox = self.inboxes[slot] = self.mp.Queue()
        process = self.mp.Process(target=_local, args=(self.target, self.slots[slot], self.args, slot,
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


def _local(target: Callable, placement: Placement, args: tuple, slot: int, count: int, inbox, outbox) -> None:
    """A local replica process: it sees only its own GPUs (its engine processes inherit them, and its share of the
    host's cores for torch's threads), and dies with the runner however the runner dies."""
    if placement.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.devices
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_replica(count, host_cores())))
    from batchjson.engine.plugin import register

    register(replica=True)  # BATCHJSON_RUNNER_PID is the runner's here (see engine/plugin.py)
    target(*args, placement, slot, count, inbox, outbox)

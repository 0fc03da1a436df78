"""Workers as local processes, one per GPU (or tensor-parallel group) of this host, each seeing only its own GPUs.
They die with the runner."""

from __future__ import annotations

import os
from collections.abc import Callable

from batchjson.engine.devices import gpus_per_replica, replica_count, visible_gpus
from batchjson.executors.base import Pool

# torch's thread pool per GPU replica, unless OMP_NUM_THREADS says otherwise (BENCHMARKS.md, "Scaling over the GPUs
# of one host", "5,000 rows, no speculation").
THREADS_PER_REPLICA = 4


def local_layout(requested: int | None, engine: dict) -> list[str | None]:
    """The device list of each local replica: every GPU of the host in groups of gpus_per_replica, or as many as
    asked for. Without GPUs (a CPU build) one replica, or as many CPU replicas as asked for."""
    gpus, per = visible_gpus(), gpus_per_replica(engine)
    if not gpus:
        return [None] * (requested or 1)
    n = replica_count(len(gpus), per, requested, "this host",
                      "Ask for fewer (--replicas, [model.engine]), or run on a Ray cluster (--ray).")
    return [",".join(gpus[i * per:(i + 1) * per]) for i in range(n)]


class LocalPool(Pool):
    """One process per replica on this host."""

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
    from batchjson.engine.plugin import register

    register()  # BATCHJSON_RUNNER_PID is the runner's here (see engine/plugin.py)
    target(*args)

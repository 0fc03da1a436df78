"""Workers as Ray actors over a cluster, placed by Ray on its nodes (num_gpus GPUs each)."""

from __future__ import annotations

import os
from collections.abc import Callable

from batchjson.engine.devices import gpus_per_replica, replica_count
from batchjson.errors import SpecError
from batchjson.executors.base import Pool


class RayPool(Pool):
    """One Ray actor per replica."""

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
    """The Ray actor around a worker's body (the same function a local replica process runs)."""

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
        n = replica_count(gpus, per, requested, "the Ray cluster", "Ask for fewer replicas.")
        return RayPool(target, args, [None] * n, gpus=per, cpus=1)
    return RayPool(target, args, [None] * (requested or 1), gpus=0, cpus=1)

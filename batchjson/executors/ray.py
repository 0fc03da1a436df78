"""Workers as Ray actors over a cluster, placed by Ray on its nodes (num_gpus GPUs each, a fraction of one where
model.replicas_per_gpu shares each GPU)."""

from __future__ import annotations

import os
from collections.abc import Callable

from batchjson.errors import EngineError, SpecError
from batchjson.executors.base import Pool
from batchjson.executors.placement import Layout, ray_layout
from batchjson.spec import ModelSpec


class RayPool(Pool):
    """One Ray actor per replica."""

    def __init__(self, target: Callable, args: tuple, layout: Layout, gpus: float, cpus: float):
        import ray
        from ray.util.queue import Empty, Queue

        self.ray, self.Queue, self.empty = ray, Queue, Empty
        self.actor_class = ray.remote(num_gpus=gpus, num_cpus=cpus, max_restarts=0)(RayReplica)
        self.actors: dict[int, object] = {}
        self.outbox = Queue()  # every actor's messages: a put is one call to the queue's actor, whole or not at all
        super().__init__(target, args, layout)

    def _spawn(self, slot: int) -> None:
        inbox = self.inboxes[slot] = self.Queue()
        actor = self.actors[slot] = self.actor_class.remote()
        self.live[slot] = actor.serve.remote(self.target, (*self.args, self.slots[slot], slot, len(self.slots), inbox,
                                                            self.outbox))

    def receive(self, timeout: float) -> list[tuple]:
        try:
            return [self.outbox.get(timeout=timeout)]
        except self.empty:
            return []

    def dead(self) -> list[int]:
        refs = list(self.live.values())
        finished, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        return [slot for slot, ref in self.live.items() if ref in finished]

    def stop(self) -> None:
        for slot in list(self.live):
            self.dismiss(slot)  # an actor has no signal to catch: its open units are redone next run

    def dismiss(self, slot: int) -> None:
        self.ray.kill(self.actors[slot])

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


def ray_pool(target: Callable, args: tuple, address: str, requested: int | None, model: ModelSpec) -> RayPool:
    """Connect to the Ray cluster at `address` ("auto": RAY_ADDRESS or a new local one) and place the replicas."""
    try:
        import ray
    except ImportError:
        raise SpecError("--ray needs Ray: pip install 'batchjson[ray]'.") from None
    if not ray.is_initialized():
        _connect(ray, address)
    layout, gpus = ray_layout(int(ray.cluster_resources().get("GPU", 0)), model, requested)
    return RayPool(target, args, layout, gpus=gpus, cpus=1)


def _connect(ray, address: str, attempts: int = 2) -> None:
    """ray.init at `address` ("auto": RAY_ADDRESS or a new local instance). A local instance whose start timed out
    (Ray waits 30 s for its node to register, which a loaded small machine can miss) is started once more."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("BATCHJSON_", "VLLM_", "HF_", "AWS_"))}
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=None if address == "auto" else address, log_to_driver=False,
                     runtime_env={"env_vars": env})
            return
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise SpecError(f"--ray {address}: cannot connect to a Ray cluster ({e}).") from None
        except Exception as e:  # noqa: BLE001 - Ray's own start of a local instance raises a bare Exception
            ray.shutdown()
            if attempt == attempts or address != "auto" or os.environ.get("RAY_ADDRESS"):
                raise EngineError(f"--ray: Ray could not start a local instance ({e}). On a busy machine run the job "
                                  "again, or start Ray first (ray start --head) and set RAY_ADDRESS.") from None


"""Where a job's workers run: in this process (inline.py), as local processes (local.py) or as Ray actors (ray.py).
Every executor runs the same worker body (worker.py) against the same queue and dispatch (base.py), with replicas
laid out by placement.py. The driver (start.py, job.py) imports this face only, and runs its passes on the pool
`make_pool` hands it."""

from __future__ import annotations

from collections.abc import Callable

from batchjson.engine import reaper
from batchjson.executors.base import Channel, Pool, Queue
from batchjson.executors.inline import InlinePool
from batchjson.executors.placement import Layout, local_layout
from batchjson.spec import ModelSpec

__all__ = ["Channel", "Layout", "Pool", "Queue", "local_layout", "make_pool"]


def make_pool(layout: Layout | None, inline: Callable[[Channel], None], target: Callable, args: tuple,
              ray: str | None, replicas: int | None, model: ModelSpec) -> Pool:
    """The pool a run's passes run on: Ray actors where `ray` names a cluster (laid out once connected), a process
    per replica where `layout` has several, else one worker in this process (`inline`, a worker's serve). A replica
    runs `target(*args, placement, slot, count, inbox, outbox)`."""
    if not ray and len(layout.placements) == 1:
        return InlinePool(inline, layout)
    with reaper.guard():  # replicas die with this process, however and whenever it dies
        if ray:
            from batchjson.executors.ray import ray_pool

            return ray_pool(target, args, ray, replicas, model)
        from batchjson.executors.local import LocalPool

        return LocalPool(target, args, layout)

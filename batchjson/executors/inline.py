"""A pool of one worker in this process: a one-engine run takes the same path as many, with the queue called
directly instead of through mailboxes. Signals reach the worker here, so a stop ends the stream at its next step.

It shares the queue, the channel and the worker's body with the other pools, not `Pool.drive`: drive() owns the
driver's thread while the workers run elsewhere, and a worker's end is a death to it. Here the worker runs on the
driver's thread, so its exceptions reach the job as they are (a BatchjsonError the job tells by type, a bug's
traceback) and are never respawned, and the counts it sends after a stop still reach the report (drive() returns at
the stop, leaving replicas' last messages unread).
"""

from __future__ import annotations

from collections.abc import Callable

from batchjson.executors.base import Channel, Queue


def run_inline(body: Callable[[Channel], None], work: Queue, on_done: Callable, on_stats: Callable) -> None:
    """Run `body` (a worker's serve) on this process's one engine against the queue `work`."""

    def send(kind: str, *payload) -> None:
        if kind == "done":
            stage, key, rows, requeued = payload
            if work.done(0, stage, key, requeued):
                on_done(stage, key, rows, requeued)
        elif kind == "stats":
            on_stats(payload[0])

    body(Channel(lambda stages: work.want(0, stages), send, prefetch=False))

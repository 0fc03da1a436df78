"""A pool of one worker in this process: a one-engine run takes the same path as many, with the queue called
directly instead of through mailboxes. Signals reach the worker here, so a stop ends the stream at its next step."""

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

"""A pool of one worker in this process: a one-engine run takes the same path as many, its messages answered by the
same dispatch (`Pool.answer`) but called directly instead of through mailboxes. Signals reach the worker here, so a
stop ends the stream at its next step.

It does not share `Pool.drive`'s loop: drive() owns the driver's thread while the workers run elsewhere, and a
worker's end is a death to it. Here the worker runs on the driver's thread, so its exceptions reach the job as they
are (a BatchjsonError the job tells by type, a bug's traceback) and are never respawned, and the counts it sends
after a stop still reach the report (drive() returns at the stop, leaving replicas' last messages unread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from batchjson.executors.base import Channel, Pool, Queue
from batchjson.executors.placement import Layout


class InlinePool(Pool):
    """`body` (a worker's serve) on this process's one engine, as slot 0 of a pool of one. No mailboxes: the worker
    calls the dispatch itself."""

    def __init__(self, body: Callable[[Channel], None], layout: Layout):
        self.reply: tuple = ()
        super().__init__(body, (), layout)

    def _spawn(self, slot: int) -> None:
        self.live[slot] = self.target

    def dead(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass  # the worker sees the stop itself, on this thread

    def close(self) -> None:
        pass

    def put(self, slot: int, message: tuple) -> None:
        self.reply = message

    def drive(self, work: Queue, stop: threading.Event, on_done: Callable, on_stats: Callable,
              on_note: Callable[[str, str, str], None]) -> None:
        answer = lambda kind, *payload: self.answer(work, on_done, on_stats, 0, kind, *payload)  # noqa: E731

        def ask(stages: tuple, take: bool) -> tuple:
            answer("want", stages, take)
            return self.reply

        self.target(Channel(ask, answer, prefetch=False))

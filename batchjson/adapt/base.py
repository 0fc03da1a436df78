"""The contract of a worker's adaptive policies: pass 1's recipe (recipe.py), auto's engine switches (auto.py) and
the speculation audit (audit.py).

A policy watches the rows its worker's engine finishes and answers after each one: keep going (KEEP), decode pass 1
with other sampling settings on this engine (Resample), or go on on another engine (Switch). The worker applies the
answer (worker.py, `_decode`); the policy never touches an engine or the queue. At the end it writes what it chose
and why into pass 1's stats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchjson.records import Generation, Outcome, Stage
from batchjson.spec import DecodingSpec, SpeculativeSpec

if TYPE_CHECKING:
    from batchjson.engine.base import Engine
    from batchjson.report import PassStats


@dataclass(frozen=True)
class Keep:
    """Go on as before."""


@dataclass(frozen=True)
class Resample:
    """Pass 1's requests decode with `decoding` on this engine from now on; `again`: the rows in flight too (their
    stream stops and they are fed again)."""

    decoding: DecodingSpec
    again: bool


@dataclass(frozen=True)
class Switch:
    """Pass 1 goes on on a new engine with `speculative` (None: no draft); the rows in flight move to it."""

    speculative: SpeculativeSpec | None


Answer = Keep | Resample | Switch
KEEP = Keep()


class Policy(ABC):
    """One adaptive policy of one worker (engine replica): it judges the rows that worker decodes, no other's."""

    def engine_started(self, engine: Engine, stage: Stage, seconds: float) -> None:
        """A new engine, started for a unit of `stage`, took `seconds` to start."""

    @abstractmethod
    def observe(self, engine: Engine, gen: Generation, outcome: Outcome) -> Answer:
        """A row finished on `engine` and was checked: what to do now."""

    def stream_ended(self, engine: Engine) -> None:
        """A stream on `engine` ended: at the end of the work, a stop, or an answer that ends it."""

    def refused(self, reason: str) -> Answer:
        """Pass 1's speculative engine could not start: Switch to go on with another, KEEP to fail the run."""
        return KEEP

    @abstractmethod
    def report(self, stats: PassStats) -> None:
        """Write what it chose and why into pass 1's stats (nothing when it had too little to judge)."""

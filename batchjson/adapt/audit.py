"""The speculation audit (an adapt.Policy): speculation off for the rest of the run once a row decoded with drafts
differs from its twin decoded without."""

from __future__ import annotations

from batchjson.adapt.base import KEEP, Answer, Policy, Switch
from batchjson.engine.base import Engine, EngineFacts
from batchjson.records import Generation, Outcome
from batchjson.spec import SpeculativeSpec


class Audit(Policy):
    """The speculation audit: under greedy decoding an answer with drafts must be the answer without them. The engine
    decodes a twin without drafts of pass 1's first `[speculative] audit_rows` rows beside them (counted in its
    facts, `Engine.facts`); once a row's two answers differ, speculation is off for the rest of the run: pass 1
    goes on on an engine without drafts, the rows in flight with it. One differing row is enough: greedy decoding
    with drafts is exact by design, so a difference is a fault (or, rarely, floating-point noise between two
    batches, which costs one engine start). The report says how many rows were audited and how many differed."""

    def __init__(self) -> None:
        self.off: EngineFacts | None = None  # the engine's facts (its audit's numbers) when it turned speculation off

    @classmethod
    def for_job(cls, speculative: SpeculativeSpec | None) -> Audit | None:
        return cls() if speculative is not None and speculative.enabled and speculative.audit_rows else None

    def observe(self, engine: Engine, gen: Generation, outcome: Outcome) -> Answer:
        if self.off is not None:
            return KEEP
        facts = engine.facts()
        if not facts.differ:
            return KEEP
        self.off = facts
        return Switch(None)

    def report(self, stats) -> None:
        if self.off is not None:
            stats.first_note("speculation-off", f"speculation switched off: {self.off.differ} of the "
                             f"{self.off.audited} rows audited so far decoded otherwise without drafts")

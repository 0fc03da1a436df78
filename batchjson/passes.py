"""The passes of a job as values: where each commits, how it decodes, where its failures go, and which of them an
engine decodes.

Pass 1 decodes with [sampling] (greedy by default) and its failures go to pass 2, which decodes them with
[fallback] (sampled) and without a draft. Both share one engine where it decodes both (worker.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from batchjson.engine.base import Engine
from batchjson.records import Stage
from batchjson.spec import DecodingSpec, JobSpec, SpeculativeSpec


@dataclass(frozen=True)
class Pass:
    """One pass as a value: where it commits (its stage), how it decodes, and where its failures go."""

    stage: Stage
    decoding: DecodingSpec
    speculative: SpeculativeSpec | None
    last: bool
    """Failures of the last pass go to rejects; those of an earlier one to the re-queue of the next."""


def plan_passes(spec: JobSpec) -> list[Pass]:
    speculative = spec.speculative if spec.speculative.enabled else None
    first = Pass(Stage.FIRST, spec.sampling, speculative, last=not spec.fallback.enabled)
    return [first, Pass(Stage.SECOND, spec.fallback, None, last=True)] if spec.fallback.enabled else [first]


def decoded_by(engine: Engine, passes: Sequence[Pass], speculative: SpeculativeSpec | None) -> tuple[Stage, ...]:
    """The passes `engine` decodes as it is: the first with `speculative` (its draft now) or without a draft, the
    others without. Engine-wide settings change only with the engine (auto's switches, deaths)."""
    first = passes[0]
    return tuple(p.stage for p in passes
                 if (p is first and engine.accepts(p.decoding, speculative)) or engine.accepts(p.decoding, None))


def engine_decoding(passes: Sequence[Pass], decoding: DecodingSpec) -> DecodingSpec:
    """The settings an engine starts with for a pass with `decoding`. On a CPU the seed is engine-wide
    (Engine.accepts): a pass that sets none seeds the engine with the first seed another pass asks for, so that pass's
    seed holds on this engine and both share it. Elsewhere seeds are per request and this changes nothing."""
    if decoding.seed is not None:
        return decoding
    seed = next((p.decoding.seed for p in passes if p.decoding.seed is not None), None)
    return dataclasses.replace(decoding, seed=seed)

"""The Engine contract (engine/base.py) and the fake engine that implements it without a model (engine/fake.py)."""

from __future__ import annotations

import threading

import pytest

from batchjson.engine import Engine, EngineWrapper
from batchjson.errors import EngineDied
from batchjson.engine.fake import FakeEngine
from batchjson.records import WAIT, Prompt


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"r{i}", "u", "text") for i in range(n)]


def test_an_engine_that_misses_a_method_cannot_be_made():
    class NoStats(Engine):
        def accepts(self, decoding, speculative):
            return True

        def use(self, decoding):
            pass

        def stream(self, prompts, stop=None):
            yield from ()

        def close(self):
            pass

    with pytest.raises(TypeError, match="stats"):
        NoStats()
    assert isinstance(FakeEngine(), Engine) and isinstance(EngineWrapper(FakeEngine()), Engine)


def test_every_prompt_is_answered_once_even_with_prompts_in_flight():
    engine = FakeEngine(valid=1.0, max_in_flight=4)
    got = [g.prompt.row_id for g in engine.stream([*prompts(3), WAIT, *prompts(9)[3:]])]
    assert got == [f"r{i}" for i in range(9)] and engine.unfinished == []


def test_a_stop_leaves_what_was_in_flight_in_unfinished():
    engine, stop = FakeEngine(max_in_flight=3), threading.Event()
    stream = engine.stream(prompts(10), stop)
    assert next(stream).prompt.row_id == "r0"
    stop.set()
    assert list(stream) == []
    assert [p.row_id for p in engine.unfinished] == ["r1", "r2", "r3"]


def test_a_dying_engine_returns_its_prompts_in_flight():
    engine = FakeEngine(die_after=2, max_in_flight=2)
    with pytest.raises(EngineDied) as died:
        list(engine.stream(prompts(5)))
    assert [p.row_id for p in died.value.in_flight] == ["r1", "r2"]


def test_a_cycle_fails_the_same_share_every_run():
    engine = FakeEngine(valid=0.89, cycle=True)
    reasons = [g.finish_reason for g in engine.stream(prompts(1000))]
    assert reasons.count("stop") + reasons.count("length") == 1000
    valid = sum(g.text.startswith('{"name":"ab","n"') for g in FakeEngine(valid=0.89, cycle=True).stream(prompts(1000)))
    assert valid == 890


def test_a_speculative_engine_takes_passes_without_a_draft_only_where_it_can_skip_drafts():
    from batchjson.spec import DecodingSpec, SpeculativeSpec

    spec = SpeculativeSpec(method="ngram")
    assert FakeEngine(speculative=True).accepts(DecodingSpec(), spec)
    assert FakeEngine(speculative=True).accepts(DecodingSpec(), None)  # per-request no-draft (vLLM with the patch)
    assert not FakeEngine(speculative=True, no_draft=False).accepts(DecodingSpec(), None)
    assert FakeEngine().accepts(DecodingSpec(), None) and not FakeEngine().accepts(DecodingSpec(), spec)
    engine = FakeEngine(speculative=True)
    engine.use(DecodingSpec(), "p1")
    engine.use(DecodingSpec(max_tokens=9), "p2", draft=False)
    list(engine.stream([Prompt("a", "u", "x"), Prompt("b", "u", "y", stage="p2")]))
    assert engine.stages == {"p1": 1, "p2": 1} and engine.drafted == {"p1": 1}

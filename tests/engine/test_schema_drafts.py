"""`[speculative] method = "schema"` on the real CPU engine: batchjson's drafter (engine/internals.py SchemaProposer,
vLLM's custom_class proposer) proposes what the grammar forces and what the prompt holds, and greedy outputs stay
token for token those of an engine without speculation; on a vLLM it has not read, the method is refused clearly."""

from __future__ import annotations

import pytest

from batchjson.engine import internals
from batchjson.engine.vllm_engine import speculative_config
from batchjson.errors import EngineError
from batchjson.records import Prompt
from batchjson.spec import DecodingSpec, ModelSpec, SpeculativeSpec
from helpers import TINY_SCHEMA

PROMPTS = [f'<|im_start|>user\nAnswer like {{"name":"thing{i % 7}","n":{i % 10}}}: item {i}<|im_end|>\n'
           "<|im_start|>assistant\n" for i in range(24)]


def decode(tiny_model, speculative):
    from batchjson.engine import VllmEngine

    model = ModelSpec(path=tiny_model, dtype="float32", max_model_len=512, max_in_flight=16)
    engine = VllmEngine(model, DecodingSpec(max_tokens=40, seed=0), TINY_SCHEMA, speculative)
    try:
        gens = {g.prompt.row_id: g.text for g in engine.stream(Prompt(str(i), "u", t) for i, t in enumerate(PROMPTS))}
        return gens, engine.stats()
    finally:
        engine.close()


@pytest.mark.engine
def test_schema_drafts_are_proposed_and_accepted_and_change_no_token(tiny_model):
    plain, _ = decode(tiny_model, None)
    drafted, stats = decode(tiny_model, SpeculativeSpec(method="schema", num_speculative_tokens=4))
    assert drafted == plain  # greedy: the drafts are verified, never taken on trust
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    # the speculation audit (its default 32 rows): each row decoded again without drafts, beside it, the same
    assert stats["audit_rows"] == len(PROMPTS) and stats["audit_differ"] == 0, stats


def test_schema_drafts_name_batchjsons_proposer_and_are_refused_on_an_unread_vllm(monkeypatch):
    config = speculative_config(SpeculativeSpec(method="schema", num_speculative_tokens=6, options={"x": 1}))
    assert config == {"method": "custom_class", "model": internals.SCHEMA_PROPOSER, "num_speculative_tokens": 6,
                      "x": 1}
    monkeypatch.setattr(internals, "SCHEMA_DRAFTS_READ_ON", ("0.1.",))
    with pytest.raises(EngineError, match='method = "schema" cannot run here .*not a version'):
        speculative_config(SpeculativeSpec(method="schema"))

"""`[speculative] method = "schema"` on the real CPU engine: batchjson's drafter (engine/vllm/drafts.py SchemaProposer,
vLLM's custom_class proposer, its drafts made in the scheduler) proposes what the grammar forces and what the prompt
holds, and greedy outputs stay token for token those of an engine without speculation; on a vLLM it has not read, the
method is refused clearly."""

from __future__ import annotations

import json
import types

import pytest

from batchjson.engine.vllm import versions
from batchjson.engine.vllm.drafts import SCHEMA_PROPOSER, SchedulerDrafts
from batchjson.engine.vllm_engine import speculative_config
from batchjson.errors import EngineError
from batchjson.records import Prompt
from batchjson.spec import DecodingSpec, SpeculativeSpec
from helpers import ANSWER_PROMPTS, TINY_SCHEMA, tiny_engine_model


@pytest.mark.engine
def test_schema_drafts_are_proposed_and_accepted_and_change_no_token(tiny_model, plain_run):
    from batchjson.engine import VllmEngine

    engine = VllmEngine(tiny_engine_model(tiny_model), DecodingSpec(max_tokens=40, seed=0), TINY_SCHEMA,
                        SpeculativeSpec(method="schema", num_speculative_tokens=4))
    try:
        drafted = {g.prompt.row_id: g.text for g in engine.stream(
            Prompt(str(i), "u", text) for i, text in enumerate(ANSWER_PROMPTS))}
        stats = engine.stats()
    finally:
        engine.close()
    assert drafted == plain_run.answers  # greedy, as without speculation: the drafts are verified, never trusted
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
    # the speculation audit (its default 32 rows): each row decoded again without drafts, beside it, the same
    assert stats["audit_rows"] == len(ANSWER_PROMPTS) and stats["audit_differ"] == 0, stats


def test_schema_drafts_name_batchjsons_proposer_and_are_refused_on_an_unread_vllm(monkeypatch):
    config = speculative_config(SpeculativeSpec(method="schema", num_speculative_tokens=6, options={"x": 1}))
    assert config == {"method": "custom_class", "model": SCHEMA_PROPOSER, "num_speculative_tokens": 6,
                      "x": 1}
    monkeypatch.setitem(versions.PATCHES, "scheduler_drafts", versions.Read(("0.1.",), "unread here"))
    with pytest.raises(EngineError, match='method = "schema" cannot run here .*not a version'):
        speculative_config(SpeculativeSpec(method="schema"))


class _Request:
    """The part of vLLM's scheduler Request that SchedulerDrafts reads."""

    def __init__(self, grammar, output, prefill=False):
        self.prompt_token_ids, self.output_token_ids, self.spec_token_ids = [1, 2, 3], list(output), [9]
        self.structured_output_request = types.SimpleNamespace(grammar=grammar)
        self.use_structured_output, self.is_prefill_chunk = True, prefill

    def is_finished(self) -> bool:
        return False


def test_scheduler_drafts_check_a_forced_string_once_and_never_draft_for_who_asked_none(tiny_model):
    """SchedulerDrafts (engine/vllm/drafts.py) drafts from the engine's own matcher; vLLM's check of a forced string's
    tokens is skipped only once they passed it whole, and a string whose tokens failed it is checked every time."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    tok = AutoTokenizer.from_pretrained(tiny_model)
    info = xgr.TokenizerInfo.from_huggingface(tok)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(TINY_SCHEMA), any_whitespace=False)
    opening = tok.encode("{", add_special_tokens=False)

    def grammar():
        g = XgrammarGrammar(vocab_size=info.vocab_size, matcher=xgr.GrammarMatcher(compiled), ctx=compiled)
        assert g.accept_tokens("r", opening)
        return g

    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    drafts = SchedulerDrafts(encode, k=4)
    scheduler = types.SimpleNamespace(requests={"a": _Request(grammar(), opening), "none": _Request(grammar(), opening),
                                                "chunk": _Request(grammar(), opening, prefill=True)},
                                      _batchjson_no_draft={"none"})

    def step(*ids):
        checked, forced_texts = drafts.place(scheduler, list(ids))
        for req_id, draft in zip(checked.req_ids, checked.draft_token_ids):  # vLLM's own check
            request = scheduler.requests[req_id]
            request.spec_token_ids = request.structured_output_request.grammar.validate_tokens(draft)
        drafts.learn(scheduler, checked, forced_texts)
        return checked.req_ids

    text = grammar().matcher.find_jump_forward_string()  # what the schema forces after "{": the first key
    assert text.startswith('"name"')
    forced = encode(text)[:4]
    assert step("a", "none", "chunk") == ["a"]  # the first time, vLLM checks it
    assert scheduler.requests["a"].spec_token_ids == forced
    assert scheduler.requests["none"].spec_token_ids == [] and scheduler.requests["chunk"].spec_token_ids == []
    scheduler.requests["b"] = _Request(grammar(), opening)
    assert step("b") == [] and scheduler.requests["b"].spec_token_ids == forced  # passed once: no check again

    wrong = SchedulerDrafts(lambda text: encode("[" + text), k=4)  # tokens that do not spell the string
    drafts = wrong
    for req_id in ("c", "d"):
        scheduler.requests[req_id] = _Request(grammar(), opening)
        assert step(req_id) == [req_id] and scheduler.requests[req_id].spec_token_ids == []

"""batchjson's grammar fills (engine/vllm/fills.py, BatchFills): the same masks and the same tokens as vLLM's own
fills, the drafted rows as vLLM 0.26 makes them with the grammars rolled back, and vLLM's own fills where batchjson
has not read the vLLM version or the spec asks for them; the masks placed on the logits' device (mask_rows,
apply_mask_rows) as vLLM's V1 model runner places them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchjson.engine.vllm import fills as fills_module
from batchjson.engine.vllm.ahead import AHEAD_ENV, ENGINE_GC_ENV, GrammarAhead, ahead_wanted, engine_gc, stale_field
from batchjson.engine.vllm.ahead_hooks import install_grammar_ahead
from batchjson.engine.vllm.fills import BatchFills
from batchjson.engine.vllm.masks import apply_mask_rows, install_mask_scatter, mask_rows
from batchjson.engine.vllm.patches import grammar_fills
from batchjson.engine.profiler import read_profile
from batchjson.records import Prompt
from batchjson.spec import DecodingSpec
from helpers import ANSWER_PROMPTS, TINY_SCHEMA, tiny_engine_model

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def grammar_kit(tiny_model):
    """(the tiny model's tokenizer, TINY_SCHEMA compiled as vLLM compiles it: no whitespace, its vocabulary size)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(TINY_SCHEMA), any_whitespace=False)
    return tokenizer, compiled, info.vocab_size


def answer_tokens(tokenizer, compiled, text: str) -> list[int]:
    """`text` as tokens the grammar takes (the tokenizer's own split, checked on a fresh matcher), then the end."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    probe = xgr.GrammarMatcher(compiled)
    assert all(probe.accept_token(t) for t in ids), text
    return ids + [tokenizer.eos_token_id]


def grammars(compiled, vocab: int, n: int, rollback: int = 8):
    """n of vLLM's XgrammarGrammar around fresh matchers, as its xgrammar backend makes them."""
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    return [XgrammarGrammar(vocab_size=vocab, matcher=xgr.GrammarMatcher(compiled, max_rollback_tokens=rollback),
                            ctx=compiled) for _ in range(n)]


def requests_of(gs) -> dict:
    return {str(i): SimpleNamespace(structured_output_request=SimpleNamespace(grammar=g)) for i, g in enumerate(gs)}


def vllm_rows(gs, tokens, mask) -> int:
    """vLLM 0.26's serial fill of StructuredOutputManager.grammar_bitmask without a reasoning parser (transcribed):
    each drafted position's row from the grammar advanced through the drafts before it, then the bonus row; -1 rows
    after a -1 draft and for a terminated grammar; rolled back at the end. Returns the rows written."""
    row = 0
    for grammar, drafts in zip(gs, tokens):
        apply, advanced = True, 0
        for token in drafts:
            if apply and not grammar.is_terminated():
                grammar.fill_bitmask(mask, row)
            else:
                mask[row].fill_(-1)
            advance = apply
            if token == -1:
                apply = advance = False
            if advance and not grammar.is_terminated():
                assert grammar.accept_tokens("r", [token])
                advanced += 1
            row += 1
        if not grammar.is_terminated():
            grammar.fill_bitmask(mask, row)
        else:
            mask[row].fill_(-1)
        row += 1
        if advanced:
            grammar.rollback(advanced)
    return row


def test_batch_fills_make_vllms_rows_at_every_step(grammar_kit):
    """Rows of requests at every point of their answers, a terminated one among them, step after step: the batch
    fill's rows are the rows of vLLM's call per row."""
    tokenizer, compiled, vocab = grammar_kit
    answers = [answer_tokens(tokenizer, compiled, f'{{"name": "w{i % 5}x", "n": {i % 10}}}') for i in range(12)]
    gs, mine = grammars(compiled, vocab, 12), grammars(compiled, vocab, 12)
    fills = BatchFills(rows=16, words=xgr.allocate_token_bitmask(1, vocab).shape[1], drafted=True)
    expected = xgr.allocate_token_bitmask(12, vocab)
    steps = max(map(len, answers)) + 2
    for step in range(steps):
        ids = list(requests_of(mine))
        got = fills.bitmask(requests_of(mine), ids, {})
        vllm_rows(gs, [()] * 12, expected)
        assert (got == expected.numpy()).all(), f"step {step}"
        for g, m, answer in zip(gs, mine, answers):
            if step < len(answer):
                assert g.accept_tokens("r", [answer[step]]) and m.accept_tokens("r", [answer[step]])
    assert all(g.is_terminated() for g in mine)  # the last steps filled terminated grammars' rows (-1)
    assert (got == -1).all()


@pytest.mark.parametrize("asks", [True, False], ids=["one call asks for refusals", "the answer read in full"])
def test_batch_accept_tells_each_refused_token(grammar_kit, asks):
    """BatchFills.accept: every token taken, then a refused one among taken ones; each matcher where xgrammar's own
    call leaves it. On this xgrammar one FFI call tells whether any was refused (finds_refusals); without that, the
    answer is read in full."""
    tokenizer, compiled, vocab = grammar_kit
    fills = BatchFills(rows=4, words=xgr.allocate_token_bitmask(1, vocab).shape[1], drafted=True)
    assert fills.finds_refusals
    fills.finds_refusals = asks
    first, second = answer_tokens(tokenizer, compiled, '{"name": "w", "n": 1}')[:2]
    ours, theirs = ([xgr.GrammarMatcher(compiled) for _ in range(3)] for _ in range(2))
    assert [bool(ok) for ok in fills.accept(ours, [first] * 3)] == [True] * 3
    xgr.BatchGrammarMatcher.batch_accept_token(theirs, [first] * 3)
    moves = [second, first, second]  # the answer's first token again is refused
    assert [bool(ok) for ok in fills.accept(ours, moves)] == [True, False, True]
    assert xgr.BatchGrammarMatcher.batch_accept_token(theirs, moves) == [True, False, True]
    assert [m.is_terminated() for m in ours] == [m.is_terminated() for m in theirs]
    assert [m.find_jump_forward_string() for m in ours] == [m.find_jump_forward_string() for m in theirs]


def test_drafted_rows_are_vllm_026s_and_the_grammars_come_back(grammar_kit):
    """Drafts of every kind in one step: none, a full draft, a -1 (rejected) draft in the middle, a draft that ends
    the answer (the grammar terminates inside the window), a -1 first, a grammar that had ended: the rows are those
    of vLLM 0.26's loop, and each grammar is back where it was."""
    tokenizer, compiled, vocab = grammar_kit
    answer = answer_tokens(tokenizer, compiled, '{"name": "abc", "n": 7}')
    gs, mine = grammars(compiled, vocab, 6), grammars(compiled, vocab, 6)
    for g, m in zip(gs[:5], mine[:5]):  # all three tokens in
        assert g.accept_tokens("r", answer[:3]) and m.accept_tokens("r", answer[:3])
    rest = answer[3:]
    drafts = [[], rest[:4], [rest[0], -1, -1, -1], rest[-3:], [-1, -1], [answer[0], answer[1]]]
    for g, m in zip(gs[3:4], mine[3:4]):  # the fourth request stands three tokens from its end
        assert g.accept_tokens("r", rest[:-3]) and m.accept_tokens("r", rest[:-3])
    assert gs[5].accept_tokens("r", answer) and mine[5].accept_tokens("r", answer)  # the last one ended
    assert mine[5].is_terminated()
    words = xgr.allocate_token_bitmask(1, vocab).shape[1]
    fills = BatchFills(rows=32, words=words, drafted=True)
    expected = xgr.allocate_token_bitmask(32, vocab)
    rows = vllm_rows(gs, drafts, expected)
    got = fills.bitmask(requests_of(mine), list(requests_of(mine)), {str(i): d for i, d in enumerate(drafts)})
    assert got.shape[0] == rows == 1 + 5 + 5 + 4 + 3 + 3
    assert (got == expected[:rows].numpy()).all()
    assert (got[-3:] == -1).all() and not (got[11] == -1).all()  # the ended grammar's rows; the first -1's row
    assert [m.num_processed_tokens for m in mine] == [g.num_processed_tokens for g in gs]
    assert [m.is_terminated() for m in mine] == [False] * 5 + [True]
    again, again_expected = fills.bitmask(requests_of(mine), list(requests_of(mine)), {}), expected.clone()
    vllm_rows(gs, [()] * 6, again_expected)
    assert (again == again_expected[:6].numpy()).all()


def test_masks_placed_in_one_scatter_mask_what_vllms_row_copies_mask():
    """A step of vLLM's V1 runner with drafts: requests in another order than the scheduler's, some drafted and some
    not, one without a grammar, one grammar request no longer in the batch. Both ways leave the same logits."""
    import torch
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    vocab, words = 300, 10
    batch = ["a", "free", "b", "c", "d"]  # "free" decodes without a grammar; "gone" left the batch
    drafts = {"a": [1, 2, 3], "free": [4], "c": [5, 6], "gone": [7]}
    grammar_ids = ["d", "gone", "c", "a", "b"]
    rows = sum(1 + len(drafts.get(r, ())) for r in grammar_ids)
    seeded = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=seeded)
    logits = torch.randn((sum(1 + len(drafts.get(r, ())) for r in batch), vocab), generator=seeded)
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens=drafts)
    grammar = SimpleNamespace(grammar_bitmask=bitmask.numpy(), structured_output_request_ids=grammar_ids)
    theirs, ours = logits.clone(), logits.clone()
    apply_grammar_bitmask(scheduled, grammar, SimpleNamespace(req_ids=batch), theirs)
    kept, targets = mask_rows(batch, grammar_ids, drafts)
    apply_mask_rows(grammar.grammar_bitmask, kept, targets, ours)
    assert torch.isinf(theirs).any() and not torch.isinf(theirs[4:6]).any()  # masked, but not "free"'s rows
    assert torch.equal(theirs, ours)
    assert len(targets) == rows - 2  # "gone"'s two rows have no place
    assert install_mask_scatter() == "ok"  # on this vLLM; the CPU runner's logits keep vLLM's own path


def test_an_unread_vllm_keeps_its_own_fills(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    said = grammar_fills("batch")
    assert said.startswith("vllm (vLLM 0.99.0 is not a version this patch was read on")
    assert grammar_fills("vllm") == 'vllm ([model] grammar_fills = "vllm")'


@pytest.mark.engine
def test_batch_fills_decode_what_vllms_fills_decode(tiny_model, plain_run, monkeypatch, tmp_path):
    """The same prompts on two engines, greedy in float32: batchjson's fills (the session's engine without
    speculation; they ran: the step profile timed them) and vLLM's own give the same outputs, and the report's
    grammar line says which ran. Both profiles time the grammars' advance, vLLM's call per request (a part of
    update_from_output)."""
    from batchjson.engine import VllmEngine

    profile = tmp_path / "profile-vllm.json"
    monkeypatch.setenv("BATCHJSON_PROFILE_STEPS", str(profile))
    engine = VllmEngine(tiny_engine_model(tiny_model, grammar_fills="vllm"), DecodingSpec(max_tokens=40, seed=0),
                        TINY_SCHEMA)
    try:
        own = {g.prompt.row_id: g.text for g in engine.stream(
            Prompt(str(i), "u", text) for i, text in enumerate(ANSWER_PROMPTS))}
        assert engine.fills.startswith("vllm")
    finally:
        engine.close()
    assert plain_run.fills.startswith("batch")
    assert len(own) == len(ANSWER_PROMPTS) and plain_run.answers == own
    profiles = {"batch": plain_run.profile, "vllm": read_profile(profile)}
    ran = {fills: got["parts"].get("batch_fills", {}).get("count", 0) for fills, got in profiles.items()}
    assert ran["batch"] > 0 and ran["vllm"] == 0
    for got in profiles.values():
        assert 0 < got["parts"]["advance"]["seconds"] < got["parts"]["update_from_output"]["seconds"]


class Request(SimpleNamespace):
    """What GrammarAhead reads of vLLM's Request: `finished` sets its status (vLLM's is_finished: above PREEMPTED)."""

    @property
    def status(self):
        from vllm.v1.request import RequestStatus

        return RequestStatus.FINISHED_ABORTED if self.finished else RequestStatus.RUNNING


def ahead_requests(gs) -> dict:
    return {str(i): Request(structured_output_request=SimpleNamespace(grammar=g), use_structured_output=True,
                            is_prefill_chunk=False, finished=False, **{stale_field(): 0})
            for i, g in enumerate(gs)}


def sampled(tokens: dict, order: list[str]):
    """Model Runner V2's AsyncOutput of a step: one token (or none: -1) per request, in the runner's `order`."""
    import numpy as np

    return SimpleNamespace(
        copy_event=SimpleNamespace(synchronize=lambda: None),
        model_runner_output=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(order)}),
        sampled_token_ids=np.array([[tokens.get(r, -1)] for r in order], dtype=np.int32),
        num_sampled_tokens_np=np.array([0 if tokens.get(r, -1) == -1 else 1 for r in order], dtype=np.int32))


def scheduled(ids) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens={r: 1 for r in ids}, pending_structured_output_tokens=True,
                           scheduled_spec_decode_tokens={}, total_num_scheduled_tokens=len(ids))


def vllm_update(requests, ids, tokens, skip=frozenset()) -> list[str]:
    """update_from_output's advance (vLLM 0.26, no reasoning parser), for the requests not in `skip`: the ids it
    advanced itself (refused ones included: vLLM ends those with an error)."""
    moved = []
    for req_id in ids:
        request = requests.get(req_id)
        if request is None or request.finished or req_id not in tokens or req_id in skip:
            continue
        if getattr(request, stale_field()):
            continue
        request.structured_output_request.grammar.accept_tokens(req_id, [tokens[req_id]])
        moved.append(req_id)
    return moved


@pytest.mark.parametrize("late", [False, True], ids=["from the launch", "from update_from_output"])
def test_grammar_work_ahead_of_the_step_is_vllms_step_after_step(grammar_kit, late):
    """Twelve requests through their answers, each step's tokens taken and the next step's masks made on the thread
    (GrammarAhead; `late`: the tokens taken when update_from_output asks, only the fill on the thread), requests
    finishing as their grammar ends: every mask and every grammar's count is what vLLM's update_from_output and its
    fill give, and update_from_output is left nothing to advance."""
    tokenizer, compiled, vocab = grammar_kit
    answers = [answer_tokens(tokenizer, compiled, f'{{"name": "w{i % 5}x{"y" * (i % 4)}", "n": {i % 10}}}') for i in range(12)]
    gs, mine = grammars(compiled, vocab, 12), grammars(compiled, vocab, 12)
    theirs, ours = ahead_requests(gs), ahead_requests(mine)
    words = xgr.allocate_token_bitmask(1, vocab).shape[1]
    ahead = GrammarAhead(BatchFills(rows=16, words=words, drafted=True), ours)
    ahead.min_requests, ahead.late = 1, late
    ids = list(ours)
    step = scheduled(ids)
    ahead.note(step, SimpleNamespace(structured_output_request_ids=ids))  # the first step's masks were vLLM's
    for position in range(max(map(len, answers))):
        tokens = {r: answers[int(r)][position] for r in ids}
        following = scheduled(ids)  # the runner's batch: every request the step scheduled, in its own order
        ahead.waiting = (SimpleNamespace(async_output=sampled(tokens, list(step.num_scheduled_tokens)[::-1])), step, None)
        ahead.start(following)
        advanced = ahead.advanced(step)
        assert advanced == set(ids)
        assert vllm_update(ours, ids, tokens, skip=advanced) == []
        vllm_update(theirs, ids, tokens)
        made = ahead.masks(following)
        expected = xgr.allocate_token_bitmask(len(ids), vocab)
        vllm_rows([theirs[r].structured_output_request.grammar for r in ids], [()] * len(ids), expected)
        assert made.structured_output_request_ids == ids
        assert (made.grammar_bitmask == expected.numpy()).all(), f"position {position}"
        assert [m.num_processed_tokens for m in mine] == [g.num_processed_tokens for g in gs]
        assert [m.is_terminated() for m in mine] == [g.is_terminated() for g in gs]
        for r in [r for r in ids if gs[int(r)].is_terminated()]:  # the end token stops the request
            del theirs[r], ours[r]
        ids, step = [r for r in ids if r in ours], following
    assert not ids and all(m.is_terminated() for m in mine)


def drafted_output(tokens: dict, order: list[str], k: int):
    """Model Runner V2's AsyncOutput of a drafted step: each request's tokens (its accepted drafts, then the bonus
    token) in a row of 1 + k, in the runner's `order`."""
    import numpy as np

    rows = np.zeros((len(order), 1 + k), dtype=np.int64)
    for row, req_id in enumerate(order):
        rows[row, :len(tokens[req_id])] = tokens[req_id]
    return SimpleNamespace(copy_event=SimpleNamespace(synchronize=lambda: None),
                           model_runner_output=SimpleNamespace(req_ids=order), sampled_token_ids=rows,
                           num_sampled_tokens_np=np.array([len(tokens[r]) for r in order], dtype=np.int32))


def test_drafted_grammar_work_ahead_takes_each_requests_tokens_and_fills_its_drafts_rows(grammar_kit):
    """A speculative engine that drafts ahead of time (vLLM 0.34: a block of k + 1 mask rows a request): step n gave
    each request several tokens, the next step's drafts come from the model runner. On the thread, each grammar takes
    its tokens up to its end token (what follows is not the grammar's), and the next step's blocks are filled through
    its drafts: the masks and counts are those of vLLM's update (the tokens cut after the end, as vLLM cuts them) and
    BatchFills' drafted rows. A refused token leaves its grammar untouched, and once vLLM itself took a request's
    tokens, or placed other drafts than those read, or where the fill fails, the step's masks are vLLM's."""
    tokenizer, compiled, vocab = grammar_kit
    k, eos = 3, tokenizer.eos_token_id
    answers = [answer_tokens(tokenizer, compiled, f'{{"name": "w{i}x", "n": {i}}}') for i in range(4)]
    gs, mine = grammars(compiled, vocab, 4), grammars(compiled, vocab, 4)
    theirs, ours = ahead_requests(gs), ahead_requests(mine)
    for g, m in zip(gs[2:3], mine[2:3]):  # request 2 is two tokens from its end
        assert g.accept_tokens("r", answers[2][:-2]) and m.accept_tokens("r", answers[2][:-2])
    words = xgr.allocate_token_bitmask(1, vocab).shape[1]
    ahead = GrammarAhead(BatchFills(rows=4 * (1 + k), words=words, drafted=True, stride=1 + k), ours)
    ahead.min_requests = 1
    ids = list(ours)
    tokens = {"0": answers[0][:3], "1": answers[1][:1], "2": answers[2][-2:] + [answers[0][0]], "3": answers[3][:2]}
    drafts = {"0": answers[0][3:6], "1": answers[1][1:3] + [-1], "2": [-1] * k,
              "3": [answers[3][2], tokenizer.encode("}", add_special_tokens=False)[0], answers[3][4]]}

    def step_of():
        return SimpleNamespace(num_scheduled_tokens={r: 1 + k for r in ids}, pending_structured_output_tokens=True,
                               scheduled_spec_decode_tokens={r: [-1] * k for r in ids}, total_num_scheduled_tokens=9)

    step, following = step_of(), step_of()
    ahead.read_drafts = lambda scheduled: {r: list(drafts[r]) for r in scheduled.scheduled_spec_decode_tokens}
    ahead.note(step, SimpleNamespace(structured_output_request_ids=ids))
    ahead.waiting = (SimpleNamespace(async_output=drafted_output(tokens, ids[::-1], k)), step, None)
    ahead.start(following)
    assert ahead.advanced(step) == set(ids)
    for r in ids:  # vLLM's update: the tokens up to the end token
        cut = tokens[r][:tokens[r].index(eos) + 1] if eos in tokens[r] else tokens[r]
        assert theirs[r].structured_output_request.grammar.accept_tokens(r, cut)
    following.scheduled_spec_decode_tokens = {r: list(drafts[r]) for r in ids}  # update_draft_token_ids_in_output
    made = ahead.masks(following)
    expected = BatchFills(rows=4 * (1 + k), words=words, drafted=True, stride=1 + k).bitmask(theirs, ids, drafts)
    assert made.structured_output_request_ids == ids and (made.grammar_bitmask == expected).all()
    assert [m.num_processed_tokens for m in mine] == [g.num_processed_tokens for g in gs]
    assert [m.is_terminated() for m in mine] == [g.is_terminated() for g in gs] == [False, False, True, False]

    del theirs["2"], ours["2"]  # ended
    ids, step = ["0", "1", "3"], following
    refused = tokenizer.encode("}", add_special_tokens=False)[0]
    before = mine[3].num_processed_tokens
    for case in ("refused", "other drafts"):
        at = 0 if case == "refused" else 2  # requests 0 and 1 took two tokens at the refused step
        tokens = {"0": answers[0][3 + at:5 + at], "1": answers[1][1 + at:3 + at],
                  "3": [answers[3][2], refused] if case == "refused" else answers[3][2:4]}
        following = step_of()
        ahead.last = (step, ids)
        ahead.waiting = (SimpleNamespace(async_output=drafted_output(tokens, ids, k)), step, None)
        ahead.start(following)
        advanced = ahead.advanced(step)
        if case == "refused":
            assert advanced == {"0", "1"} and mine[3].num_processed_tokens == before  # rolled back, left to vLLM
            ahead.moved.add("3")  # vLLM's accept_tokens refuses it (and ends the request)
        else:
            assert advanced == set(ids)
            following.scheduled_spec_decode_tokens = {r: [-1] * k for r in ids}  # vLLM placed none of those read
        assert ahead.masks(following) is None, case
        step = following

    def broken(*args):
        raise RuntimeError("a fill that fails")

    ahead.fills.bitmask = broken  # the grammars stay advanced, the step's masks are vLLM's: no engine death
    before = [m.num_processed_tokens for m in mine]
    tokens = {"0": answers[0][7:8], "1": answers[1][5:6], "3": answers[3][4:5]}
    following, ahead.last = step_of(), (step, ids)
    ahead.waiting = (SimpleNamespace(async_output=drafted_output(tokens, ids, k)), step, None)
    ahead.start(following)
    assert ahead.advanced(step) == set(ids) and ahead.masks(following) is None
    assert [m.num_processed_tokens for m in mine] == [before[0] + 1, before[1] + 1, before[2], before[3] + 1]


def test_the_drafts_are_read_as_vllm_places_them_in_the_step():
    """The next step's drafts read where Model Runner V2 left them (DraftTokensHandler, by request) as vLLM 0.34's
    update_draft_token_ids_in_output places them: cut to the slots scheduled, padded with -1; a handler that kept only
    the drafts' width gives -1s, a request without drafts keeps its slots; an executor without the runner in this
    process gives no reader."""
    import numpy as np

    from batchjson.engine.vllm.ahead import drafts_reader

    synced = []
    handler = SimpleNamespace(copy_event=SimpleNamespace(synchronize=lambda: synced.append(1)), _draft_tokens_by_req={
        "long": np.array([5, 6, 7, 8]), "short": np.array([5]), "width": 3, "unscheduled": np.array([9, 9])})
    executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(
        draft_tokens_handler=handler))))
    step = SimpleNamespace(scheduled_spec_decode_tokens={"long": [-1] * 3, "short": [-1] * 3, "width": [-1] * 2,
                                                         "none": [-1] * 3})
    assert drafts_reader(executor)(step) == {"long": [5, 6, 7], "short": [5, -1, -1], "width": [-1, -1],
                                             "none": [-1, -1, -1]}
    assert synced  # the drafts' copy to the host waited for
    assert drafts_reader(SimpleNamespace(workers=[])) is None


@pytest.mark.parametrize("gpu,given,expected", [(True, "", 10_000), (False, "", 0), (True, "700", 700),
                                                 (False, "5000", 5000)],
                         ids=["a GPU engine", "a CPU engine", "asked for the interpreter's own", "asked on a CPU"])
def test_an_engine_core_collects_its_first_generation_less_often_on_a_gpu(monkeypatch, gpu, given, expected):
    """The engine core's first-generation threshold: batchjson's on a GPU, the interpreter's on a CPU, and what
    BATCHJSON_ENGINE_GC says where it says it; the older generations' thresholds are left as they were."""
    import gc

    before = gc.get_threshold()
    monkeypatch.setenv(ENGINE_GC_ENV, given)
    try:
        gc.set_threshold(700, 11, 12)
        assert engine_gc(gpu) == expected
        assert gc.get_threshold() == (expected or 700, 11, 12)
    finally:
        gc.set_threshold(*before)


def test_grammar_work_ahead_skips_what_vllm_skips_and_refills_what_vllm_moved(grammar_kit):
    """One step with every case update_from_output treats apart: a request finished (aborted) and one gone, one whose
    tokens are dropped (its stale_field: 0.26's async_tokens_to_discard), one still in its prefill (no token), a
    terminated grammar, a token the grammar refuses. Only the plain requests are advanced ahead; vLLM's own update then advances the refused one
    (and ends it), whose row is filled again; the masks and counts are vLLM's. A step with two tokens for a request is
    left to vLLM whole."""
    tokenizer, compiled, vocab = grammar_kit
    answer = answer_tokens(tokenizer, compiled, '{"name": "abc", "n": 7}')
    gs, mine = grammars(compiled, vocab, 8), grammars(compiled, vocab, 8)
    for g, m in zip(gs[6:7], mine[6:7]):  # request 6 is at its end: terminated
        assert g.accept_tokens("r", answer) and m.accept_tokens("r", answer)
    theirs, ours = ahead_requests(gs), ahead_requests(mine)
    for requests in (theirs, ours):
        requests["1"].finished = True
        del requests["2"]
        setattr(requests["3"], stale_field(), 1)
    ids = [str(i) for i in range(8)]
    tokens = {r: answer[0] for r in ids if r != "4"}  # 4: a prefill chunk, no token
    refused = tokenizer.encode("}", add_special_tokens=False)[0]
    tokens["5"] = refused
    words = xgr.allocate_token_bitmask(1, vocab).shape[1]
    ahead = GrammarAhead(BatchFills(rows=16, words=words, drafted=True), ours)
    ahead.min_requests = 1
    step, following = scheduled(ids), scheduled(ids)
    ahead.note(step, SimpleNamespace(structured_output_request_ids=ids))
    ahead.waiting = (SimpleNamespace(async_output=sampled(tokens, ids)), step, None)
    ahead.start(following)
    advanced = ahead.advanced(step)
    assert advanced == {"0", "7"}
    ahead.moved |= set(vllm_update(ours, ids, tokens, skip=advanced))  # as should_advance notes them
    assert ahead.moved == {"5", "6"}  # vLLM's accept_tokens refuses both (and ends both requests)
    vllm_update(theirs, ids, tokens)
    made = ahead.masks(following)
    kept = [r for r in ids if r in ours]
    assert made.structured_output_request_ids == kept
    expected = xgr.allocate_token_bitmask(len(kept), vocab)
    vllm_rows([theirs[r].structured_output_request.grammar for r in kept], [()] * len(kept), expected)
    assert (made.grammar_bitmask == expected.numpy()).all()
    assert [m.num_processed_tokens for m in mine] == [g.num_processed_tokens for g in gs]

    output = sampled(tokens, ids)
    output.num_sampled_tokens_np[0] = 2  # drafts' tokens: not a step this reads
    before = [m.num_processed_tokens for m in mine]
    ahead.waiting = (SimpleNamespace(async_output=output), following, None)
    again = scheduled(ids)
    ahead.start(again)
    assert ahead.advanced(following) is None and ahead.masks(again) is None
    assert [m.num_processed_tokens for m in mine] == before


def test_grammar_work_ahead_starts_only_on_a_step_it_reads(grammar_kit):
    """No work without the masks of the step waiting in the queue, without tokens pending, with drafts, with an output
    that is not Model Runner V2's, or for a step of fewer than min_requests requests; work for a step it reads. On this
    vLLM (the CPU build schedules without async) it is not installed."""
    _, compiled, vocab = grammar_kit
    words = xgr.allocate_token_bitmask(1, vocab).shape[1]
    ahead = GrammarAhead(BatchFills(rows=4, words=words, drafted=True), {})
    ahead.min_requests = 1
    step, ids = scheduled(["0"]), ["0"]
    output = SimpleNamespace(async_output=sampled({"0": 1}, ids))
    for last, waiting, following, why in (
            (None, (output, step, None), scheduled(ids), "no masks noted"),
            ((scheduled(ids), ids), (output, step, None), scheduled(ids), "another step's masks"),
            ((step, ids), (output, step, None), SimpleNamespace(**{**vars(scheduled(ids)),
                                                                  "pending_structured_output_tokens": False}), "none pending"),
            ((step, ids), (output, step, None), SimpleNamespace(**{**vars(scheduled(ids)),
                                                                  "scheduled_spec_decode_tokens": {"0": [1]}}), "drafts"),
            ((step, ids), (SimpleNamespace(), step, None), scheduled(ids), "not an AsyncOutput")):
        ahead.last, ahead.waiting, ahead.job = last, waiting, None
        ahead.start(following)
        assert ahead.job is None, why
    ahead.min_requests = 2  # a step of fewer requests stays vLLM's
    ahead.last, ahead.waiting = (step, ids), (output, step, None)
    ahead.start(scheduled(ids))
    assert ahead.job is None
    ahead.min_requests = 1  # the same step, read: its work starts
    ahead.last, ahead.waiting = (step, ids), (output, step, None)
    ahead.start(scheduled(ids))
    assert ahead.job is not None and ahead.job[0] is step
    ahead.job[2].result()
    assert install_grammar_ahead().startswith("vLLM 0.32")
    assert "beside the forward" not in grammar_fills("batch")


def test_grammar_work_goes_ahead_by_default(monkeypatch):
    """GrammarAhead's switch: on by default, where vLLM schedules ahead and one step at a time (drafts), off with
    AHEAD_ENV "0". The report says so on a vLLM it was read on."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.26.0")
    monkeypatch.setattr(fills_module, "batch_fills_unready", lambda: "")
    for setting, on in ((None, True), ("0", False), ("1", True)):
        if setting is None:
            monkeypatch.delenv(AHEAD_ENV, raising=False)
        else:
            monkeypatch.setenv(AHEAD_ENV, setting)
        assert ahead_wanted() == on, setting
        assert ("beside the forward" in grammar_fills("batch")) == on, setting


MODES = {"ahead": [], "one at a time, drafted": ["--sync", "--drafts", "4"],
         "ahead of time, drafted": ["--drafts", "4"]}


# 40 rows, 16 at a time: requests start as others end (three waves), in ~140 steps without drafts.
ROWS, SEQS = 40, 16


def on_vllms_scheduler(src: Path, tiny_model: str, out: Path, *args: str) -> list[dict]:
    """`python -m bench ahead ARGS` on the Python files of a vLLM in `src` over the CPU build (ROWS rows, SEQS in
    flight): its runs."""
    proc = subprocess.run([sys.executable, "-m", "bench", "ahead", "--vllm-src", str(src), "--model", tiny_model,
                           "--rows", str(ROWS), "--seqs", str(SEQS), "--min-requests", "1", *args, "--out", str(out)],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "ahead.json").read_text())


@pytest.mark.parametrize("version,steps", [("0.26", "ahead"), ("0.26", "one at a time, drafted"), ("0.34", "ahead"),
                                           ("0.34", "one at a time, drafted"), ("0.34", "ahead of time, drafted")])
def test_grammar_work_ahead_on_vllms_own_scheduler(tiny_model, tmp_path, vllm_sources, version, steps):
    """vLLM 0.26's or 0.34's own scheduler, StructuredOutputManager (xgrammar) and engine step (step_with_batch_queue
    under async scheduling; step and post_step one step at a time, with n-gram-style drafts of 4 tokens that vLLM cuts
    and verifies; 0.34 also drafts ahead of time, its drafts unchecked), their Python on this CPU, with a model runner
    that answers every request with its ground truth and checks each mask row it is given, drafted positions
    included (0.34: in blocks of k + 1 rows), against a matcher of its own (bench/ahead.py): with GrammarAhead the
    thread serves every step after the first few and vLLM advances no grammar itself (drafted ahead of time too: each
    request's accepted drafts taken, the next drafts read where the runner left them); with the masks made when vLLM
    asks, the same answers and rows."""
    mode = MODES[steps]
    ahead, batch = on_vllms_scheduler(vllm_sources(version), tiny_model, tmp_path, "--configs", "ahead,batch", *mode)
    assert ahead["installed"]["fills"] == ahead["installed"]["ahead"] == "ok" and batch["installed"]["ahead"] == "off"
    for run in (ahead, batch):
        assert run["right"] == ROWS and run["checked_rows"] > ROWS * 10
    assert ahead["checked_rows"] == batch["checked_rows"]  # each request its own steps (when it starts varies)
    assert ahead["served"] == ahead["work"] >= ahead["steps"] - 4 and ahead["moved"] == 0
    assert batch["work"] == 0
    if mode:  # the drafts were verified and taken: 46 steps where the same answers take 137 without them
        assert ahead["steps"] < 80


@pytest.mark.parametrize("version", ["0.26", "0.34"])
def test_requests_without_drafts_get_none_on_vllms_own_scheduler(tiny_model, tmp_path, vllm_sources, version):
    """A speculative engine on vLLM's own scheduler (0.26 one step at a time, 0.34 ahead of time) with every third
    request asking for no drafts (NO_DRAFT) and the loop guard on every token: those requests are scheduled no
    drafted token, every answer comes back whole, and on 0.34 the scheduler counts their drafts as unused (the
    idle drafter: a step of them alone proposes nothing) and the others' as used."""
    run, = on_vllms_scheduler(vllm_sources(version), tiny_model, tmp_path, "--configs", "batch", "--drafts", "4",
                              "--no-draft-every", "3", *(["--sync"] if version == "0.26" else []))
    assert run["installed"]["no_draft"] == run["installed"]["guard"] == "ok"
    assert run["right"] == ROWS and run["no_draft_drafted"] == 0
    if version == "0.34":
        assert run["installed"]["idle_drafter"] == "ok" and run["drafts_unused"] == [True, False]

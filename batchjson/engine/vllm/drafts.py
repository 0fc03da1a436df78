"""The schema drafts made where the grammar already is (vLLM 0.26 and 0.32; on 0.34, schema_speculator/).

`[speculative] method = "schema"` drafts what each request's grammar forces next, else a copy from its prompt
(schema/drafts.py). vLLM asks a custom drafter in the model runner, before the scheduler has advanced the grammars
through the step's tokens: a drafter there must keep and advance matchers of its own (33 ms of a 162 ms step at
1,024 requests on the H200 host), and vLLM then checks each draft by advancing the grammar once more.
`install_scheduler_drafts` makes the drafts in the scheduler instead, from vLLM's own matchers just after
update_from_output, and skips the check for forced strings whose tokens passed it once (SchedulerDrafts);
SchemaProposer, the runner's half, proposes nothing. Where it is off, the method is refused at the engine's start
(schema_drafts_unready), unless this vLLM takes schema_speculator/'s registered method.
"""

from __future__ import annotations

import functools

from batchjson.engine.vllm.schema_speculator.steps import NO_GRAMMAR
from batchjson.engine.vllm.versions import installs_once, unread_here
from batchjson.schema.drafts import COPY_MAX, Drafter, PromptIndex

# Read on (scheduler_drafts, 0.26 and 0.32): vllm/v1/spec_decode/custom_class_proposer.py, the V1 model runner,
# vllm/v1/engine/core.py and vllm/v1/core/sched/scheduler.py. speculative_config {"method": "custom_class", "model":
# "<module>.<Class>"} makes the runner build Class(vllm_config) and call its propose(sampled_token_ids, ...) once a
# step; the runner hands the lists it returns, with the batch's request ids, to the scheduler. A custom drafter runs
# without async scheduling, where EngineCore.post_step passes them (DraftTokenIds(req_ids, draft_token_ids)) to
# Scheduler.update_draft_token_ids after update_from_output has advanced each request's grammar through the step's
# tokens; that method skips finished requests, clears a prefill chunk's drafts, keeps each draft's grammar-valid prefix
# (0.26: grammar.validate_tokens where structured_output_manager.should_advance; 0.32:
# structured_output_manager.validate_tokens: an accept per token, then a rollback) and stores it as
# request.spec_token_ids, which the next step schedules. Request: prompt_token_ids, output_token_ids,
# structured_output_request.grammar (XgrammarGrammar: `matcher`, `is_terminated()`).
SCHEMA_PROPOSER = "batchjson.engine.vllm.drafts.SchemaProposer"


def schema_drafts_unready() -> str:
    """Why the schema drafter cannot run on this vLLM ("" where it can)."""
    import importlib.util
    import inspect

    if why := unread_here("scheduler_drafts"):
        return why
    if importlib.util.find_spec("vllm.v1.spec_decode.custom_class_proposer") is None:
        return "this vLLM has no custom_class proposer"
    from vllm.v1.core.sched.scheduler import Scheduler

    if list(inspect.signature(Scheduler.update_draft_token_ids).parameters) != ["self", "draft_token_ids"]:
        return "Scheduler.update_draft_token_ids changed"
    return ""


class SchemaProposer:
    """vLLM's custom_class drafter for `[speculative] method = "schema"`, in the model runner, where it proposes
    nothing: the drafts are made in the scheduler (SchedulerDrafts), where each request's grammar has just taken
    the step's tokens. A drafter here kept a matcher of its own per request and advanced it through every output
    token again: a third of a drafted step's CPU (33 ms of 162 at 1,024 requests on the H200 host, BENCHMARKS.md)."""

    def __init__(self, vllm_config):
        pass

    def load_model(self, *args, **kwargs) -> None:  # no weights (the runner asks every drafter)
        pass

    def dummy_run(self, *args, **kwargs) -> None:  # no forward to warm up
        pass

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


@installs_once
def install_scheduler_drafts() -> str:
    """Patch Scheduler.update_draft_token_ids (in this process) so that an engine whose drafter is SchemaProposer
    gets its drafts from SchedulerDrafts; every other engine keeps vLLM's own. "ok" or why not (then the schema
    method is refused at the engine's start: schema_drafts_unready)."""
    if why := schema_drafts_unready():
        return why
    from vllm.v1.core.sched.scheduler import Scheduler

    own = Scheduler.update_draft_token_ids

    @functools.wraps(own)
    def update_draft_token_ids(self, draft_token_ids):
        drafts = self.__dict__.get("_batchjson_drafts")
        if drafts is None:
            drafts = self.__dict__["_batchjson_drafts"] = SchedulerDrafts.for_scheduler(self) or False
        if not drafts:
            return own(self, draft_token_ids)
        unchecked, forced = drafts.place(self, draft_token_ids.req_ids)
        if unchecked.req_ids:
            own(self, unchecked)  # vLLM keeps each draft's grammar-valid prefix
            drafts.learn(self, unchecked, forced)
        return None

    Scheduler.update_draft_token_ids = update_draft_token_ids
    return "ok"


class SchedulerDrafts:
    """The schema drafter's drafts, made in the scheduler right after each step (schema/drafts.py, Drafter): what
    a request's grammar forces next, read from vLLM's own matcher, which update_from_output has just advanced
    through the step's tokens; else a copy from its prompt. Nothing is advanced twice.

    vLLM checks a draft against the grammar before scheduling it (an accept per token and a rollback). A forced
    string's tokens need no such check once they passed it: the grammar must produce those bytes from any state
    where it forces them, so tokens that spell them pass wherever the same string is forced. So each forced string's
    canonical tokens are checked the first time they are proposed and, if they pass whole, never again; copies and
    strings whose tokens failed are checked every time. Requests that ask for no draft (NO_DRAFT) get none."""

    def __init__(self, encode, k: int):
        self.drafter = Drafter(encode, k)
        self.prompts: dict[str, PromptIndex] = {}  # request id -> its prompt's index for copies
        self.forced_ok: dict[str, bool] = {}  # forced string -> its tokens passed vLLM's check whole

    @classmethod
    def for_scheduler(cls, scheduler) -> "SchedulerDrafts | None":
        """For a scheduler whose engine drafts with SchemaProposer and fills masks from xgrammar without a reasoning
        parser; None for every other."""
        config = scheduler.vllm_config.speculative_config
        if config is None or config.method != "custom_class":
            return None
        proposer = getattr(config, "model", None) or ""
        manager = scheduler.structured_output_manager
        if proposer != SCHEMA_PROPOSER or getattr(manager, "reasoner_cls", None) is not None:
            return None
        from vllm.tokenizers import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(model_config=scheduler.vllm_config.model_config)
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False), config.num_speculative_tokens)

    def place(self, scheduler, req_ids):
        """Set request.spec_token_ids for the step's requests whose drafts need no check; the rest, as a
        DraftTokenIds for vLLM's own update_draft_token_ids, with the forced string of each ("" for a copy)."""
        from vllm.v1.outputs import DraftTokenIds
        from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

        no_draft = scheduler.__dict__.get("_batchjson_no_draft") or ()
        ids, lists, forced_texts = [], [], []
        for req_id in req_ids:
            request = scheduler.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.is_prefill_chunk or req_id in no_draft or not request.output_token_ids:
                if request.spec_token_ids:
                    request.spec_token_ids = []
                continue
            grammar = request.structured_output_request.grammar if request.use_structured_output else None
            if grammar is not None and grammar.is_terminated():
                request.spec_token_ids = []
                continue
            matcher = grammar.matcher if isinstance(grammar, XgrammarGrammar) else None
            prompt = self.prompts.get(req_id)
            if prompt is None:
                prompt = self.prompts[req_id] = PromptIndex(request.prompt_token_ids or [])
            draft, forced = self.drafter.draft(matcher or NO_GRAMMAR, prompt, request.output_token_ids[-COPY_MAX:])
            if not draft or (forced and self.forced_ok.get(forced)):
                request.spec_token_ids = draft
            else:
                ids.append(req_id)
                lists.append(draft)
                forced_texts.append(forced)
        if len(self.prompts) > 2 * len(scheduler.requests) + 64:  # requests that finished since
            self.prompts = {r: p for r, p in self.prompts.items() if r in scheduler.requests}
        return DraftTokenIds(ids, lists), forced_texts

    def learn(self, scheduler, checked, forced_texts: list[str]) -> None:
        """After vLLM's check of `checked` (place's answer): which forced strings' tokens passed it whole."""
        for req_id, draft, forced in zip(checked.req_ids, checked.draft_token_ids, forced_texts):
            request = scheduler.requests.get(req_id)
            if forced and request is not None and forced not in self.forced_ok:
                self.forced_ok[forced] = len(request.spec_token_ids) == len(draft)

"""Where vLLM's engine core hands GrammarAhead (ahead.py) its steps: the patch of EngineCore.step_with_batch_queue,
Scheduler.schedule, update_from_output and get_grammar_bitmask, and StructuredOutputManager's advance. Installed with
BatchFills unless AHEAD_ENV is "0" (`ahead_wanted`); elsewhere the masks are made when vLLM asks for them.
"""

from __future__ import annotations

import functools

from batchjson.engine.vllm.ahead import GrammarAhead, drafts_reader, stale_field
from batchjson.engine.vllm.fills import batch_fills_unready
from batchjson.engine.vllm.versions import installs_once, layout, unread_here

# Read on (grammar_ahead, 0.26 and 0.34): vllm/v1/engine/core.py, v1/core/sched/scheduler.py and async_scheduler.py,
# v1/structured_output/__init__.py, v1/executor/uniproc_executor.py, v1/worker/gpu/async_utils.py and
# structured_outputs.py of 0.26. Under async scheduling EngineCore.step_with_batch_queue begins with at most one step in
# its batch_queue, the oldest ([-1]): (the future of step n's sampled tokens, n's SchedulerOutput, ...). It schedules
# step n+1 and launches n+1's forward (execute_model); where n+1 holds structured requests still waiting for tokens
# (SchedulerOutput.pending_structured_output_tokens, set inside schedule()), it then takes n's output (future.result()),
# runs Scheduler.update_from_output(n), and only then Scheduler.get_grammar_bitmask(n+1) and sample_tokens(n+1).
# update_from_output advances the grammar of each request n scheduled that is still in self.requests and not finished,
# whose tokens AsyncScheduler._update_request_with_output keeps (it drops them while async_tokens_to_discard > 0) and
# that got a token (one token is never trimmed at a stop), where StructuredOutputManager.should_advance(request) says so
# (always without a reasoning parser); XgrammarGrammar. accept_tokens refuses a terminated grammar untouched, else
# matcher.accept_token, num_processed_tokens += 1 and _is_terminated (is_terminated() returns it; the matcher, made
# without terminate_without_stop_token, ends only by accepting one of its stop_token_ids); a refused token ends the
# request with an error. Request.is_finished() is RequestStatus.is_finished(status): status > PREEMPTED. Nothing else
# touches a grammar between n+1's schedule and its mask without drafts (preemption leaves grammars as they are).
# get_grammar_bitmask(n+1)'s ids: the requests n+1 scheduled, in order, still in self.requests, structured and not a
# prefill chunk. Model Runner V2 masks one logits row per id (StructuredOutputsWorker.apply_grammar_bitmask), and n+1's
# forward holds every request n+1 scheduled. With one process (UniProcExecutor) n's future is an AsyncOutputFuture whose
# async_output (Model Runner V2's AsyncOutput) holds pinned copies of the sampled tokens (sampled_token_ids: rows x 1
# without drafts, num_sampled_tokens_np), complete once its copy_event is, and model_runner_output.req_id_to_index.
#
# One step at a time (async scheduling off: every n-gram, suffix and draft-model engine of 0.26) EngineCore.step runs
# schedule(), execute_model (the forward's launch), get_grammar_bitmask, sample_tokens, update_from_output; drafts come
# after (post_step: update_draft_token_ids, where vLLM cuts them with validate_tokens). Between schedule() and
# get_grammar_bitmask nothing touches a grammar or the scheduler's requests, so the step's masks (its drafted positions'
# too) can be filled on a thread from the moment it is scheduled.
#
# 0.34: the same step_with_batch_queue, EngineCore.step and get_grammar_bitmask; the advance in update_from_output is
# StructuredOutputManager.accept_tokens(request, new_token_ids) (should_advance is gone; without a reasoning parser it
# is grammar.accept_tokens of them all, which returns True untouched on a terminated grammar), called for every request
# that got tokens unless its output is stale and dropped: Request.num_stale_output_tokens (0.26's
# async_tokens_to_discard) is read before update_from_output counts it down, so a request with any is left to vLLM (and
# refilled if vLLM advanced it). ModelRunnerOutput has no req_id_to_index: the rows are req_ids' order. Async scheduling
# is on with drafts too (Model Runner V2 everywhere). Step n's output then holds each request's tokens in a row of
# 1 + k (num_sampled_tokens_np of them), and n+1's drafts reach its SchedulerOutput only after update_from_output(n)
# (take_draft_token_ids, update_draft_token_ids_in_output: each cut to the slots scheduled, padded with -1). They are on
# the host before: sample_tokens(n) ran the drafter and DraftTokensHandler.set_draft_tokens copied them, by request,
# into _draft_tokens_by_req (an async copy, complete with its copy_event), which nothing changes until sample_tokens(n+1),
# after n+1's masks. With one process (UniProcExecutor) the handler is model_executor.driver_worker.worker.model_runner
# .draft_tokens_handler (ahead.py drafts_reader).


@installs_once
def install_grammar_ahead() -> str:
    """Patch EngineCore.step_with_batch_queue (to note the step waiting in its queue), Scheduler.schedule (to start
    GrammarAhead's work), Scheduler.update_from_output and StructuredOutputManager.should_advance (0.26) or
    accept_tokens (0.34) (to skip the grammars advanced there) and Scheduler.get_grammar_bitmask (to hand over its
    masks). "ok" or why not (then the masks are made when vLLM asks for them). Installed with BatchFills unless
    AHEAD_ENV is "0" (`ahead_wanted`)."""
    import inspect

    if why := unread_here("grammar_ahead") or batch_fills_unready():
        return why
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    step, schedule = EngineCore.step_with_batch_queue, Scheduler.schedule
    update, masks = Scheduler.update_from_output, Scheduler.get_grammar_bitmask
    hook = "should_advance" if layout("should_advance") else "accept_tokens"  # where vLLM advances a grammar
    advance = getattr(StructuredOutputManager, hook, None)
    if (advance is None or list(inspect.signature(update).parameters) != ["self", "scheduler_output",
                                                                          "model_runner_output"]
            or list(inspect.signature(masks).parameters) != ["self", "scheduler_output"]
            or list(inspect.signature(advance).parameters) != ["self", "request"] + ["new_token_ids"] * (
                hook == "accept_tokens")
            or list(inspect.signature(step).parameters) != ["self"]
            or f"self.{stale_field()} =" not in inspect.getsource(Request.__init__)):
        return (f"EngineCore.step_with_batch_queue, Scheduler.update_from_output/get_grammar_bitmask, {hook} or "
                f"Request.{stale_field()} changed")

    @functools.wraps(step)
    def step_with_batch_queue(self):
        ahead = self.scheduler.__dict__.get("_batchjson_ahead")
        if ahead:
            ahead.waiting = self.batch_queue[-1] if self.batch_queue else None
            if ahead.read_drafts is None and ahead.fills.stride:  # drafted ahead of time: where the drafts are
                ahead.read_drafts = drafts_reader(self.model_executor) or False
        return step(self)

    @functools.wraps(schedule)
    def schedule_ahead(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        ahead = GrammarAhead.for_scheduler(self)
        if ahead is not None:
            ahead.start(out)
        return out

    @functools.wraps(update)
    def update_from_output(self, scheduler_output, model_runner_output):
        ahead = self.__dict__.get("_batchjson_ahead")
        advanced = ahead.advanced(scheduler_output) if ahead else None
        if advanced is None:
            return update(self, scheduler_output, model_runner_output)
        manager = self.structured_output_manager
        manager.__dict__["_batchjson_advanced"] = (advanced, ahead.moved)
        try:
            return update(self, scheduler_output, model_runner_output)
        finally:
            manager.__dict__["_batchjson_advanced"] = None

    @functools.wraps(advance)
    def should_advance(self, request, *tokens):  # 0.26: whether to advance; 0.34: the advance (accept_tokens)
        skip = self.__dict__.get("_batchjson_advanced")
        if skip is None:
            return advance(self, request, *tokens)
        if request.request_id in skip[0]:
            return bool(tokens)  # advanced already, beside the forward's launch (0.34: "accepted")
        answer = advance(self, request, *tokens)
        if answer:
            skip[1].add(request.request_id)
        return answer

    @functools.wraps(masks)
    def get_grammar_bitmask(self, scheduler_output):
        ahead = self.__dict__.get("_batchjson_ahead")
        if ahead:
            made = ahead.masks(scheduler_output)
            if made is not None:
                return made
        out = masks(self, scheduler_output)
        if ahead:
            ahead.note(scheduler_output, out)
        return out

    EngineCore.step_with_batch_queue, Scheduler.schedule = step_with_batch_queue, schedule_ahead
    Scheduler.update_from_output, Scheduler.get_grammar_bitmask = update_from_output, get_grammar_bitmask
    setattr(StructuredOutputManager, hook, should_advance)
    return "ok"

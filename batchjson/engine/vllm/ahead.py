"""The grammars' work beside the forward's launch: GrammarAhead, one engine core's grammar work for a step, done on a
thread of its own; ahead_hooks.py hands it the steps.

Under async scheduling vLLM launches step n+1's forward, then waits for step n's tokens, advances every grammar by
its token (a few Python calls per request in update_from_output) and fills n+1's masks, all on the engine core's one
thread while the GPU waits for the masks. GrammarAhead moves both onto a thread that starts as soon as n+1 is
scheduled: n's tokens are on the host by then, xgrammar's batch accept and batch fill run in C++ without the GIL, and
the engine core's thread only skips the grammars already advanced and takes the masks. Where the engine drafts ahead
of time (vLLM 0.34), the same with each request's accepted drafts taken and n+1's drafted positions filled from the
drafts Model Runner V2 left on the host. One step at a time (vLLM 0.26 with drafts) the thread fills the step's masks,
every drafted position's, while the forward launches. On by default
(an H100: the 1.5B's step x0.77-0.89 of the batch fills at the step, its drafted step x0.91-0.98, 0 rows differing;
AHEAD_ENV "0" turns it off; BENCHMARKS.md, "The grammars' work beside the forward's launch").
"""

from __future__ import annotations

import os

from batchjson.engine.vllm.fills import BatchFills, fills_for
from batchjson.engine.vllm.versions import cuda_platform, layout

# Read on (grammar_ahead, 0.26 and 0.34; the flow it runs beside: ahead_hooks.py): Model Runner V2's AsyncOutput
# (vllm/v1/worker/gpu/async_utils.py: copy_event, model_runner_output, sampled_token_ids, num_sampled_tokens_np;
# 0.26's ModelRunnerOutput.req_id_to_index, 0.34's req_ids order), vllm/v1/request.py (RequestStatus.PREEMPTED,
# Request.status, structured_output_request, is_prefill_chunk; the stale tokens' count: async_tokens_to_discard in
# 0.26, num_stale_output_tokens in 0.34), backend_xgrammar.XgrammarGrammar (matcher, num_processed_tokens,
# _is_terminated) and vllm/v1/core/sched/output.py (GrammarOutput(ids, mask)).
AHEAD_ENV = "BATCHJSON_GRAMMAR_AHEAD"  # "0": GrammarAhead off (on by default, with drafts too)
# Where vLLM schedules ahead, when the grammars take step n's tokens: "launch" (the default, on the thread beside n+1's
# launch) or "update" (when update_from_output(n) asks, on the engine core's thread, as one batch call; n+1's fill
# then goes on the thread beside the rest of update_from_output): the benchmarks' comparison of the two.
AHEAD_FROM_ENV = "BATCHJSON_GRAMMAR_AHEAD_FROM"
# Python's cyclic collector in a GPU engine core: its first generation collected after ENGINE_GC_FIRST allocations
# instead of the interpreter's 700 (ENGINE_GC_ENV gives another count: "700" is the interpreter's own). An H100, the
# 1.5B at 1,024 in flight with GrammarAhead: 41.9-45.5 ms a step against 44.3-54.2, the same tokens (run29,
# BENCHMARKS.md, "What the JSON constraint costs a step"); on a faster H100 no change (33.2-34.0 against 32.9-35.0),
# SmolLM2 x0.94 (run30); a CPU engine keeps the interpreter's (not measured there).
ENGINE_GC_ENV = "BATCHJSON_ENGINE_GC"
ENGINE_GC_FIRST = 10_000


def ahead_wanted() -> bool:
    """Whether GrammarAhead does a step's grammar work beside the forward's launch: unless AHEAD_ENV is "0". Where
    vLLM schedules ahead (no drafts): on an H100, the 1.5B's step at 1,024 in flight 44.9-48.3 ms against 53.0-55.7
    with the batch fills at the step (run24), 60.5-69.5 against 78.3 (run26), 0 of 6,000 rows differing; SmolLM2's
    27.0-29.1 against 29.4-32.2. One step at a time (vLLM 0.26 turns async scheduling off for drafts), the drafted
    fills beside the launch: the 1.5B with schema drafts 118.7-146.7 ms a step against 129.1-150.2 at the step,
    0 rows differing (run26; BENCHMARKS.md)."""
    return os.environ.get(AHEAD_ENV, "") != "0"


class GrammarAhead:
    """One engine core's grammar work for a step moved beside the launch of the step's forward. Under async scheduling
    with no drafts: on a thread, as soon as step n's tokens reach the host, every structured request's grammar takes its
    token (xgrammar's batch accept) and n+1's masks are filled (BatchFills), while the engine core's own thread
    launches the forward. vLLM does both on that one thread, after the launch and after waiting for n's tokens. One
    step at a time (`sync`, as with drafts in vLLM 0.26), the grammars are ready when the step is scheduled: the
    thread fills its masks, drafted positions included, during the launch.
    update_from_output(n) then skips the requests advanced here (should_advance), and get_grammar_bitmask(n+1) gets
    the masks. The rows are those vLLM would make plus any request that finishes at step n (still in n+1's forward;
    its next token is dropped, so its row changes nothing); a request vLLM advances itself after the masks were made
    (none is expected: the conditions are vLLM's own) gets its row filled again. A step of fewer than `min_requests`
    requests stays vLLM's: there the grammar's work is under a millisecond and the thread's hand-off costs about as
    much (bench/ahead.py on vLLM 0.26's scheduler, CPU: no gain at 16 and 64 in flight; 2-13 ms of the engine
    core thread's CPU a step at 256-1,024)."""

    min_requests = 128

    def __init__(self, fills: BatchFills, requests: dict, sync: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        import torch

        self.fills, self.requests, self.sync = fills, requests, sync
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="batchjson-grammar",  # waits on the engine's GPU
                                         initializer=None if device is None else torch.cuda.set_device,
                                         initargs=() if device is None else (device,))
        self.waiting = None  # the batch queue's oldest step (n) as a step begins
        self.last = None  # (SchedulerOutput, ids) of the latest step whose masks were made
        self.job = None  # (SchedulerOutput n, SchedulerOutput n+1, future of work())
        self.grammars: dict = {}  # request id -> its grammar, for the requests of the latest masks
        self.moved: set = set()  # requests vLLM advanced itself while a job's masks stood
        self.late = os.environ.get(AHEAD_FROM_ENV, "launch") == "update"  # the advance when update_from_output asks
        self.stops = None  # the matchers' stop tokens (one tokenizer an engine)
        from vllm.v1.request import RequestStatus

        self.preempted = RequestStatus.PREEMPTED  # a status above it is a finished request's
        self.stale = stale_field()
        # Where the engine drafts ahead of time (vLLM 0.34): the next step's drafts as vLLM will place them
        # (drafts_reader; set by the hooks where the model runner is in this process), and those a job's masks used.
        self.read_drafts = None
        self.drafts_used: dict = {}

    @classmethod
    def for_scheduler(cls, scheduler) -> "GrammarAhead | None":
        """The scheduler's GrammarAhead, made once its grammars are known to be ours (BatchFills: xgrammar, no
        reasoning parser) on an engine without a KV connector or pipeline stages (one step in flight), and without
        drafts where it schedules ahead; None until then, or for good."""
        ahead = scheduler.__dict__.get("_batchjson_ahead")
        if ahead is None:
            manager = scheduler.structured_output_manager
            if manager.backend is None:
                return None  # no grammar yet: asked again at the next step
            engine_gc(cuda_platform())
            fills = fills_for(manager)
            config = manager.vllm_config
            sync = not config.scheduler_config.async_scheduling
            usable = (fills and scheduler.connector is None and config.parallel_config.pipeline_parallel_size == 1
                      and (sync or not scheduler.num_spec_tokens or fills.stride))
            ahead = cls(fills, scheduler.requests, sync) if usable else False
            scheduler.__dict__["_batchjson_ahead"] = ahead
        return ahead or None

    def start(self, scheduled) -> None:
        """After step n+1 (`scheduled`) is scheduled: start its grammar work on the thread, where this step is one
        read (n's masks were made by this object or noted, n's tokens come as Model Runner V2's AsyncOutput). Where
        vLLM schedules one step at a time, the grammars are already where n+1's masks need them: only the fill (with
        its drafted positions) goes on the thread."""
        if self.sync:
            return self._start_fill(scheduled)
        waiting, self.waiting = self.waiting, None
        if (waiting is None or self.last is None or waiting[1] is not self.last[0]
                or not scheduled.pending_structured_output_tokens
                or (scheduled.scheduled_spec_decode_tokens and not self.read_drafts)
                or len(scheduled.num_scheduled_tokens) < self.min_requests):
            return
        output = getattr(waiting[0], "async_output", None)
        if output is None or not hasattr(output, "num_sampled_tokens_np"):
            return
        if self.late:  # advanced() does the advance, then starts the fill
            self.job = (waiting[1], scheduled, (output, self.last[1]))
        else:
            self.job = (waiting[1], scheduled, self.thread.submit(self.work, output, self.last[1], scheduled))

    def _start_fill(self, scheduled) -> None:
        if not scheduled.has_structured_output_requests or len(scheduled.num_scheduled_tokens) < self.min_requests:
            return
        requests = self.requests
        ids = [req_id for req_id in scheduled.num_scheduled_tokens
               if (request := requests.get(req_id)) and request.use_structured_output and not request.is_prefill_chunk]
        if ids:  # get_grammar_bitmask's ids: nothing between here and there changes them one step at a time
            drafts = scheduled.scheduled_spec_decode_tokens
            self.job = (None, scheduled, self.thread.submit(self.fill_beside, ids, drafts))

    def fill_beside(self, ids: list[str], drafts: dict):
        """On the thread, one step at a time: the step's masks, drafted positions included, as BatchFills makes them
        when vLLM asks. (no ids advanced, the ids, mask), or None where this step is vLLM's own."""
        mask = self.fills.bitmask(self.requests, ids, drafts)
        return None if mask is None else (set(), ids, mask)

    def work(self, output, ids: list[str], scheduled):
        """On the thread: advance the grammars of `ids` (step n's masked requests) by n's tokens in `output`, as
        update_from_output would, then fill the masks of `scheduled` (n+1). (advanced ids, n+1's ids, mask), or None
        where the step is not one this reads (nothing advanced: vLLM does all of it)."""
        advanced = self.advance(output, ids)
        return None if advanced is None else self.fill_or_not(scheduled, advanced)

    def fill_or_not(self, scheduled, advanced: set):
        """fill_next, or (`advanced`, None, None) where it failed: the grammars stay advanced, and vLLM makes the step's
        masks (masks() answers None), instead of the engine dying at get_grammar_bitmask."""
        try:
            return self.fill_next(scheduled, advanced)
        except Exception:  # noqa: BLE001
            return advanced, None, None

    def advance(self, output, ids: list[str]) -> set | None:
        """Advance the grammars of `ids` by their tokens in `output` with one batch call: the ids advanced, or None
        where the step is not one this reads (nothing advanced). Its Python is what shares the interpreter's lock
        with the forward's launch: one pass over the requests, vLLM's checks read as fields (RequestStatus.
        is_finished: status > PREEMPTED; XgrammarGrammar.is_terminated: _is_terminated), and a matcher asked
        whether it ended only after a stop token (vLLM's matchers end only by accepting one)."""
        requests, known, preempted, stale = self.requests, self.grammars, self.preempted, self.stale
        try:
            output.copy_event.synchronize()
            ran = output.model_runner_output
            index = getattr(ran, "req_id_to_index", None) or {r: i for i, r in enumerate(ran.req_ids)}
            rows = [index[r] for r in ids]
            counts = output.num_sampled_tokens_np[rows]
            if len(rows) and counts.max() > 1 and not self.fills.stride:  # drafted tokens one step at a time: vLLM's
                return None
            tokens = output.sampled_token_ids[rows, :int(counts.max(initial=0))].tolist()
            movers = [(req_id, grammar, row[:count]) for req_id, count, row in zip(ids, counts.tolist(), tokens)
                      if count and (request := requests.get(req_id)) is not None and request.status <= preempted
                      and not getattr(request, stale)
                      and not (grammar := known.get(req_id)
                               or request.structured_output_request.grammar)._is_terminated]
        except Exception:  # noqa: BLE001 - nothing advanced yet: this step is vLLM's own
            return None
        if not movers:
            return set()
        if self.stops is None:
            self.stops = frozenset(movers[0][1].matcher.stop_token_ids)
        stops, taken, refused = self.stops, [0] * len(movers), set()
        position, live = 0, list(range(len(movers)))
        while live:  # a position at a time: each request's next token, one batch call for all
            accepted = self.fills.accept([movers[i][1].matcher for i in live], [movers[i][2][position] for i in live])
            for i, ok in zip(live, accepted):
                grammar, token = movers[i][1], movers[i][2][position]
                if not ok:  # a refused token is left to vLLM, which refuses it too and ends the request
                    refused.add(i)
                    continue
                taken[i] += 1
                grammar.num_processed_tokens += 1
                if token in stops:  # tokens after the grammar's end are not its (vLLM's accept_tokens)
                    grammar._is_terminated = grammar.matcher.is_terminated()
            position += 1
            live = [i for i in live if i not in refused and len(movers[i][2]) > position
                    and not movers[i][1]._is_terminated]
        for i in refused:  # as vLLM's accept_tokens leaves a grammar that refused one of its tokens: untouched
            grammar = movers[i][1]
            if taken[i]:
                grammar.matcher.rollback(taken[i])
                grammar.num_processed_tokens -= taken[i]
        return {movers[i][0] for i in range(len(movers)) if i not in refused}

    def fill_next(self, scheduled, advanced: set):
        """The masks of `scheduled` (n+1), its grammars advanced: (`advanced`, n+1's ids, mask), in one pass over its
        requests (BatchFills.fill's rows: -1 for an ended grammar)."""
        requests, known = self.requests, self.grammars
        upcoming, grammars, matchers, at, ended = [], {}, [], [], []
        for req_id in scheduled.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is not None and request.structured_output_request is not None and not request.is_prefill_chunk:
                grammar = known.get(req_id) or request.structured_output_request.grammar
                grammars[req_id] = grammar
                if grammar._is_terminated:
                    ended.append(len(upcoming))
                else:
                    at.append(len(upcoming))
                    matchers.append(grammar.matcher)
                upcoming.append(req_id)
        self.grammars = grammars
        if self.fills.stride:  # a block of k + 1 rows a request (vLLM 0.34 drafting): its drafts as vLLM places them
            self.drafts_used = self.read_drafts(scheduled) if scheduled.scheduled_spec_decode_tokens else {}
            return advanced, upcoming, self.fills.bitmask(self.requests, upcoming, self.drafts_used)
        mask = self.fills.fill_rows(matchers, at, ended)
        return advanced, upcoming, mask[:len(upcoming)].numpy()

    def advanced(self, updated):
        """In update_from_output(n): the ids advanced for it (waiting for the thread, or advancing them here when
        `late`, then starting n+1's fill on the thread), or None."""
        if self.job is None or self.job[0] is not updated:
            return None
        pending = self.job[2]
        if isinstance(pending, tuple):
            done = self.advance(*pending)
            if done is not None:
                self.job = (updated, self.job[1], self.thread.submit(self.fill_or_not, self.job[1], done))
        else:
            done = pending.result()
            done = None if done is None else done[0]
        if done is None:
            self.job = None
            return None
        self.moved = set()
        return done

    def masks(self, scheduled):
        """In get_grammar_bitmask(n+1): its GrammarOutput from the thread's work, or None (vLLM's own)."""
        job, self.job = self.job, None
        if job is None or job[1] is not scheduled or isinstance(job[2], tuple):
            return None
        done = job[2].result()
        if done is None:
            return None
        from vllm.v1.core.sched.output import GrammarOutput

        _, ids, mask = done
        if mask is None or (self.fills.stride and (self.moved or not self.drafts_as_placed(scheduled, ids))):
            self.moved = set()  # a request's block is its drafts' rows: vLLM's fills make them all again
            return None
        if self.moved:
            import torch

            again = [row for row, req_id in enumerate(ids) if req_id in self.moved]
            if again:
                self.fills.fill([self.grammars[ids[row]] for row in again], torch.from_numpy(mask), again)
            self.moved = set()
        self.last = (scheduled, ids)
        return GrammarOutput(ids, mask)

    def drafts_as_placed(self, scheduled, ids) -> bool:
        """Whether the drafts the masks were made for are those vLLM placed in the step (update_draft_token_ids_in_
        output), for every request still running (one that ended at the step before takes no token from it)."""
        placed, used = scheduled.scheduled_spec_decode_tokens, self.drafts_used
        return all(list(placed.get(r, ())) == used.get(r, []) for r in ids
                   if (request := self.requests.get(r)) is not None and request.status <= self.preempted)

    def note(self, scheduled, out) -> None:
        """In get_grammar_bitmask when vLLM made the masks: the step and its ids, for the next step's work."""
        self.last = (scheduled, out.structured_output_request_ids) if out is not None else None
        self.grammars = {}


def drafts_reader(executor):
    """Model Runner V2's drafts for the step being launched, read on the host as update_draft_token_ids_in_output will
    place them in its SchedulerOutput: a function (SchedulerOutput) -> {request id: drafts}, or None where the model
    runner is not in this process (its DraftTokensHandler unreachable: the drafted steps stay vLLM's). Each request
    scheduled drafts gets its latest drafts cut to the slots scheduled and padded with -1, or the slots as they are
    (-1s) where it has none; a handler that kept only the drafts' width (no structured request in its batch) gives
    -1s."""
    runner = getattr(getattr(getattr(executor, "driver_worker", None), "worker", None), "model_runner", None)
    handler = getattr(runner, "draft_tokens_handler", None)
    if handler is None or not all(hasattr(handler, f) for f in ("_draft_tokens_by_req", "copy_event")):
        return None

    def read(scheduled) -> dict:
        handler.copy_event.synchronize()  # the drafts' copy to the host (a finished event returns at once)
        latest, placed = handler._draft_tokens_by_req, {}
        for req_id, slots in scheduled.scheduled_spec_decode_tokens.items():
            drafts = latest.get(req_id)
            if drafts is None:
                placed[req_id] = list(slots)
                continue
            drafts = ([-1] * drafts if isinstance(drafts, int) else drafts.tolist())[:len(slots)]
            placed[req_id] = drafts + [-1] * (len(slots) - len(drafts))
        return placed

    return read


def stale_field() -> str:
    """The Request field that counts the output tokens vLLM will not take from the steps in flight (0.26's name, or
    0.34's)."""
    return "async_tokens_to_discard" if layout("should_advance") else "num_stale_output_tokens"


def engine_gc(gpu: bool) -> int:
    """Set this engine core's first-generation collection threshold (ENGINE_GC_ENV, else ENGINE_GC_FIRST on a GPU, else
    the interpreter's own): the threshold set, or 0 where none was. Each step of a full batch makes and drops thousands
    of the requests' and grammars' objects; the collections they start stop every thread of the engine core."""
    import gc

    given = os.environ.get(ENGINE_GC_ENV, "")
    first = int(given) if given.isdigit() and int(given) > 0 else ENGINE_GC_FIRST if gpu else 0
    if first:
        gc.set_threshold(first, *gc.get_threshold()[1:])
    return first

"""The scheduler's patches: pass 2 without drafts on pass 1's speculative engine, no draft-model forwards in a step of
such requests, and a loop guard at the cost of a few list operations.

**No draft for a request that asks for none.** A speculative engine drafts for every request; batchjson's pass 2
(rows that failed under speculation + grammar) must be decoded by the target alone, and should not need an engine of
its own. vLLM has no per-request switch, so `install_no_draft` wraps `Scheduler.add_request` (to note requests whose
`SamplingParams.extra_args` carry NO_DRAFT) and `Scheduler.schedule` (to clear their draft tokens before each step is
scheduled: the scheduler then schedules one token for them, as for a request whose draft the grammar cut to
nothing). Where it is off, `no_draft_ready()` is False and batchjson gives pass 2 an engine without speculation.
The drafter still proposes for these requests (it drafts for the whole batch in one pass, and vLLM gives it no
per-request mask): their drafts are computed and dropped; docs/gpu.md, "What a request without a draft still costs".

**No draft-model forward in a step of no-draft requests alone.** When pass 1 is done and pass 2 decodes alone on
pass 1's engine, a draft model's forwards were wasted whole (pass 2 at x2.29 its time, on an H200).
`install_idle_drafter` makes the V1 model runner's `_input_fits_in_drafter` answer False for such a step, which takes
vLLM's own path for a step it cannot draft for (no drafter forward, zeroed drafts). vLLM 0.34 has no V1 runner: there
the scheduler counts a no-draft request's drafts as unused (`_drafts_unused`), so Model Runner V2 proposes with K = 0
in a step of such requests alone (its own skip_drafts: the draft model's one prefill forward stays, its k - 1 decode
forwards go).

**A loop guard at the cost of a few list operations.** vLLM checks `repetition_detection` after every output token,
in the engine-core process that also schedules every step: `check_sequence_repetition` compares the output's tail
token by token, one Python call per token compared, for each pattern size (57 sizes with the default guard).
`install_fast_loop_guard` replaces it with an equal function (same answer on every input: it looks only at the
pattern sizes where the last token recurs, and compares whole slices in C): 16.75 -> 2.42 us per output token
(`bench/guard_cost.py`); the tests compare both answers.
"""

from __future__ import annotations

import functools

from batchjson.engine.vllm.versions import PATCHES, installs_once, layout, unread_here, vllm_version

NO_DRAFT = "batchjson_no_draft"  # the SamplingParams.extra_args key
AUDIT_TWIN = "batchjson_audit_twin"  # ... beside NO_DRAFT: a speculation audit's twin of a drafted row

# Read on (no_draft, fast_loop_guard: 0.26, 0.32, 0.33, 0.34): vllm/v1/core/sched/ and vllm/v1/engine/core.py.
# Scheduler.schedule(self, throttle_prefills=False) schedules a running request's drafts from Request.spec_token_ids
# alone (and empties them); Scheduler.add_request(self, request); SamplingParams.extra_args. Drafts reach spec_token_ids
# after a step (update_draft_token_ids), or under async scheduling as placeholders that
# AsyncScheduler._update_after_schedule sets after schedule(), sized by the drafts schedule() scheduled;
# update_draft_token_ids_in_output fills only requests that were scheduled placeholders, and the GPU model runners (V1,
# and V2 in 0.33) verify per request the drafts in scheduled_spec_decode_tokens. In 0.33 the skip_drafts step flag
# (Scheduler._drafts_unused) is new and changes none of this. Not reached by the patch, in every version read:
# schedule() pads a request it admits with one token left to compute (a resumed one, a fully cached prompt) with
# placeholder drafts (-1, not the drafter's) for one step, to keep a uniform CUDA graph.
# check_sequence_repetition(token_ids, params) in vllm/v1/core/sched/utils.py, called by check_stop through the module's
# name (the same file in 0.32 and 0.33). 0.34: the same names and signatures; every model runs on Model Runner V2, which
# takes each request's drafts to verify from scheduled_spec_decode_tokens (its _prepare_inputs: num_draft_tokens_np),
# and utils.py is 0.32's, unchanged.


def no_draft_ready() -> bool:
    """Whether requests can opt out of drafts in this vLLM (installs the patch in this process if not yet)."""
    return install_no_draft() == "ok"


@installs_once
def install_no_draft() -> str:
    """Patch the scheduler class (in this process) so that NO_DRAFT requests are never given draft tokens; "ok" or
    why not (then pass 2 gets an engine of its own). Installed by the plugin in every vLLM process of a run, the
    runner included (where an in-process engine core would use it)."""
    import inspect

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    if why := unread_here("no_draft"):
        return why
    if "extra_args" not in inspect.signature(SamplingParams).parameters or \
            list(inspect.signature(Scheduler.add_request).parameters) != ["self", "request"] or \
            "throttle_prefills" not in inspect.signature(Scheduler.schedule).parameters:
        return "Scheduler.schedule/add_request or SamplingParams.extra_args changed"
    add_request, schedule = Scheduler.add_request, Scheduler.schedule

    @functools.wraps(add_request)
    def add_request_noting(self, request):
        extra = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
        if extra and extra.get(NO_DRAFT):
            self.__dict__.setdefault("_batchjson_no_draft", set()).add(request.request_id)
        return add_request(self, request)

    @functools.wraps(schedule)
    def schedule_without_drafts(self, *args, **kwargs):
        flagged = self.__dict__.get("_batchjson_no_draft")
        if flagged:
            for request_id in list(flagged):
                request = self.requests.get(request_id)
                if request is None or request.is_finished():
                    flagged.discard(request_id)
                elif request.spec_token_ids:
                    request.spec_token_ids = []
        return schedule(self, *args, **kwargs)

    Scheduler.add_request, Scheduler.schedule = add_request_noting, schedule_without_drafts
    return "ok"


# Read on (idle_drafter, 0.26, 0.32, 0.33): vllm/v1/worker/gpu_model_runner.py (the V1 model runner, which the CPU
# runner subclasses, and which runs draft_model in 0.26). GPUModelRunner.sample_tokens asks _input_fits_in_drafter(self,
# common_attn_metadata) once per step whether the drafter runs; on False it runs no drafter forward, keeps the padded
# bookkeeping (prepare_next_token_ids_padded) and hands the scheduler zeroed drafts (its own path for requests near
# max_model_len). self.requests[req_id].sampling_params, self.input_batch.req_ids. 0.33 keeps all of this in the V1
# runner. Its Model Runner V2 (the default where it supports the model) drafts with StandaloneARSpeculator, whose
# propose() runs the draft model whatever the step's skip_drafts or K says: nothing to answer there from outside, so on
# V2 a pass-2 step still pays the draft forward (docs/gpu.md, "What a request without a draft still costs").
#
# Read on (idle_drafter, 0.34: LAYOUTS["idle_drafter_skip_drafts"]): vllm/v1/core/sched/scheduler.py and
# vllm/v1/worker/gpu/model_runner.py (no V1 runner). Scheduler.schedule sets SchedulerOutput.skip_drafts when
# _drafts_unused(self, request, num_computed_tokens, num_new_tokens) is True for every request it schedules (running and
# new alike), and only where the drafter has a forward of its own (can_skip_drafts: num_lookahead_tokens > 0; not ngram
# or suffix). Model Runner V2 then proposes with K = 0: StandaloneARSpeculator.propose still runs its one prefill
# forward (the draft model's KV cache must take the step's tokens) and skips its k - 1 decode forwards, handing -1
# drafts that the next step does not schedule. A request that gets no drafts (NO_DRAFT) can use none: that is all the
# patch tells vLLM. A step of drafted requests too keeps its drafts (vLLM has no way to skip them for some:
# few_drafted's rule is V1's only).


def few_drafted(requests: dict, req_ids: list[str]) -> bool:
    """Whether at most half of a step's requests want drafts (the others asked for none: NO_DRAFT in their
    SamplingParams.extra_args). A draft model's forwards cost every request of the step; they pay only where most of
    it is drafted for: with k drafts accepted at rate a, a step whose share f of requests is drafted for gains
    (1 + f*a*k) / (1 + a*k) of what an all-drafted step gains, so at f = 1/2 (a*k ~ 4) a draft model must gain
    more than x1.66 at a full step to break even (the 0.5B draft on the 1.5B: x0.54-0.76 at 64 in flight and at a
    full batch, BENCHMARKS.md). A speculation audit's twins (AUDIT_TWIN) do not count: they stand beside drafted rows
    of the same pass for a while, and must not stop the drafts they are compared with."""
    drafted = counted = 0
    for req_id in req_ids:
        state = requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        if extra.get(AUDIT_TWIN):
            continue
        counted += 1
        drafted += not extra.get(NO_DRAFT)
    return bool(counted) and 2 * drafted <= counted


@installs_once
def install_idle_drafter() -> str:
    """Patch the V1 model runner (in this process) so that a draft model runs no forward in a step where at most
    half of the requests want drafts (few_drafted): pass 2 on pass 1's draft-model engine. Pass 2 took x2.29 the
    time of pass 2 without speculation before; x1.46 when only steps of pass-2 requests alone skipped the drafter
    (H200, BENCHMARKS.md run12), x1.41 with this rule (run13: the rest is the engine's own, docs/gpu.md, "What a
    request without a draft still costs"). A skipped step's drafted requests decode one token as without speculation
    (vLLM's own path for a step it cannot draft for), so outputs stay the same. "ok" or why not (then the drafter
    runs as vLLM has it). Only draft-model methods: ngram and suffix drafting cost no forward pass, and suffix
    decoding keeps per-request state that every step must see."""
    import inspect

    if why := unread_here("idle_drafter"):
        return why
    if layout("idle_drafter_skip_drafts"):
        return _install_skip_drafts()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fits = GPUModelRunner._input_fits_in_drafter
    if list(inspect.signature(fits).parameters) != ["self", "common_attn_metadata"]:
        return "GPUModelRunner._input_fits_in_drafter changed"

    @functools.wraps(fits)
    def fits_unless_few_drafted(self, common_attn_metadata):
        if self.speculative_config.uses_draft_model() and few_drafted(self.requests, self.input_batch.req_ids):
            return False
        return fits(self, common_attn_metadata)

    GPUModelRunner._input_fits_in_drafter = fits_unless_few_drafted
    return "ok"


def _install_skip_drafts() -> str:
    """Model Runner V2's idle drafter (LAYOUTS["idle_drafter_skip_drafts"]): the scheduler counts a NO_DRAFT
    request's drafts as unused, so a step of such requests alone (pass 2 on pass 1's engine) is proposed for with
    K = 0."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    unused = getattr(Scheduler, "_drafts_unused", None)
    if unused is None or list(inspect.signature(unused).parameters) != [
            "self", "request", "num_computed_tokens", "num_new_tokens"]:
        return "Scheduler._drafts_unused changed"

    @functools.wraps(unused)
    def drafts_unused(self, request, num_computed_tokens, num_new_tokens):
        return (request.request_id in (self.__dict__.get("_batchjson_no_draft") or ())
                or unused(self, request, num_computed_tokens, num_new_tokens))

    Scheduler._drafts_unused = drafts_unused
    return "ok"


VLLM_CHECK = None  # vLLM's own check (the tests compare it with `repeats`)


def repeats(token_ids, params) -> bool:
    """vLLM's `check_sequence_repetition`, the same answer: does the tail of `token_ids` consist of `min_count` copies
    of a pattern of `min_pattern_size`..`max_pattern_size` tokens?"""
    largest, smallest, count = params.max_pattern_size, max(params.min_pattern_size, 1), params.min_count
    if largest <= 0 or count < 2 or smallest > largest:
        return False
    n = len(token_ids)
    largest = min(largest, n // count)
    if largest < smallest:
        return False
    tail = list(token_ids[n - largest * count:])  # one slice (vLLM's ConstantList) instead of a call per token
    m, last = len(tail), tail[-1]
    # A pattern of size L ends each copy with the last token: the sizes to check are those where it recurs L back.
    window, start = tail[m - 1 - largest:m - smallest], m - 1 - largest
    i = 0
    while True:
        try:
            i = window.index(last, i)
        except ValueError:
            return False
        size = m - 1 - (start + i)
        i += 1
        if count > 2 and tail[m - 1 - 2 * size] != last:  # most candidates end here, before any slice
            continue
        pattern = tail[m - size:]
        if all(tail[m - (k + 1) * size:m - k * size] == pattern for k in range(1, count)):
            return True


@installs_once
def install_fast_loop_guard() -> str:
    """Replace vLLM's per-token repetition check with `repeats` (in this process); "ok" or why not (then vLLM's own
    check stays)."""
    import inspect

    from vllm.v1.core.sched import utils

    global VLLM_CHECK
    VLLM_CHECK = utils.check_sequence_repetition
    if not vllm_version().startswith(PATCHES["fast_loop_guard"].on) or \
            list(inspect.signature(VLLM_CHECK).parameters) != ["token_ids", "params"]:
        return f"vLLM {vllm_version()}: check_sequence_repetition is not the one this was read on"
    utils.check_sequence_repetition = repeats
    return "ok"


"""Everything that touches vLLM's internals: three scheduler patches, two model-runner patches, the grammar's batch
fills, the KV cache's size report, the step profiler's timers, the engine-process watcher, the engine's shutdown and
the plugin flag of a forked engine process, each with its check. It is long on purpose: every line that reads or
changes vLLM's internals is here, so that this one file says what a vLLM upgrade must read again (each part's READ_ON
names the versions it was read on).

The scheduler patches are installed by the plugin (plugin.py) in each vLLM process of a run, and in the runner by
VllmEngine (no_draft_ready).

**No draft for a request that asks for none.** A speculative engine drafts for every request; batchjson's pass 2
(rows that failed under speculation + grammar) must be decoded by the target alone, and should not need an engine of
its own. vLLM has no per-request switch, so `install_no_draft` wraps `Scheduler.add_request` (to note requests whose
`SamplingParams.extra_args` carry NO_DRAFT) and `Scheduler.schedule` (to clear their draft tokens before each step is
scheduled: the scheduler then schedules one token for them, as for a request whose draft the grammar cut to
nothing). Checked against the vLLM versions it was read on (READ_ON); on another version, or if the check
fails, `no_draft_ready()` is False and batchjson gives pass 2 an engine without speculation, as before.
The drafter still proposes for these requests (it drafts for the whole batch in one pass, and vLLM gives it no
per-request mask): their drafts are computed and dropped; README.md, "What a request without a draft still costs".

**No draft-model forward in a step of no-draft requests alone.** When pass 1 is done and pass 2 decodes alone on
pass 1's engine, a draft model's forwards were wasted whole (pass 2 at x2.29 its time, on an H200).
`install_idle_drafter` makes the V1 model runner's `_input_fits_in_drafter` answer False for such a step, which takes
vLLM's own path for a step it cannot draft for (no drafter forward, zeroed drafts). Checked against RUNNER_READ_ON.
vLLM 0.34 has no V1 runner: there the scheduler counts a no-draft request's drafts as unused (`_drafts_unused`), so
Model Runner V2 proposes with K = 0 in a step of such requests alone (its own skip_drafts: the draft model's one
prefill forward stays, its k - 1 decode forwards go). Checked against SKIP_DRAFTS_READ_ON.

**A loop guard at the cost of a few list operations.** vLLM checks `repetition_detection` after every output token,
in the engine-core process that also schedules every step: `check_sequence_repetition` compares the output's tail
token by token, one Python call per token compared, for each pattern size (57 sizes with the default guard).
`install_fast_loop_guard` replaces it with an equal function (same answer on every input: it looks only at the
pattern sizes where the last token recurs, and compares whole slices in C): 16.75 -> 2.42 us per output token
(`bench/guard_cost.py`). Checked against the versions it was read on (READ_ON); the tests compare both answers.

**The grammar's masks in one call a step.** vLLM fills a step's grammar masks with a Python call per row (on a pool
of threads that take turns at the GIL between rows; serially with drafts). `install_batch_fills` replaces
StructuredOutputManager.grammar_bitmask with BatchFills: the same rows from one call to xgrammar's batch matcher (C++
threads), into pinned buffers the GPU runner copies as they are (H200, the 1.5B at 1,024 in flight: 62.4-71.2 ms a
step against vLLM's 81.4-98.8; BENCHMARKS.md, "What the JSON constraint costs a step"); on vLLM 0.34, in its layout
of k + 1 rows a request where the engine drafts k. Checked against FILLS_READ_ON; `[model] grammar_fills = "vllm"`
(GRAMMAR_FILLS_ENV) keeps vLLM's fills.

**The grammars' work beside the forward's launch.** Under async scheduling vLLM launches step n+1's forward, then
waits for step n's tokens, advances every grammar by its token (a few Python calls per request in
update_from_output) and fills n+1's masks, all on the engine core's one thread while the GPU waits for the masks.
`install_grammar_ahead` moves both onto a thread that starts as soon as n+1 is scheduled (GrammarAhead): n's tokens
are on the host by then, xgrammar's batch accept and batch fill run in C++ without the GIL, and the engine core's
thread only skips the grammars already advanced and takes the masks. One step at a time (vLLM 0.26 with drafts) the
thread fills the step's masks, every drafted position's, while the forward launches. Checked against AHEAD_READ_ON
(vLLM 0.26 and 0.34; Model Runner V2 without drafts, or one step at a time); elsewhere the masks are made when vLLM
asks for them. On by default (an H100: the 1.5B's step x0.77-0.89 of the batch fills at the step, its drafted step
x0.91-0.98, 0 rows differing; AHEAD_ENV "0" turns it off; BENCHMARKS.md, "The grammars' work beside the forward's
launch").

**The schema drafts made where the grammar already is.** `[speculative] method = "schema"` drafts what each
request's grammar forces next, else a copy from its prompt (schema/drafts.py). vLLM asks a custom drafter in the model
runner, before the scheduler has advanced the grammars through the step's tokens: a drafter there must keep and
advance matchers of its own (33 ms of a 162 ms step at 1,024 requests on the H200 host), and vLLM then checks each
draft by advancing the grammar once more. `install_scheduler_drafts` makes the drafts in the scheduler instead, from
vLLM's own matchers just after update_from_output, and skips the check for forced strings whose tokens passed it
once (SchedulerDrafts); SchemaProposer, the runner's half, proposes nothing. Checked against SCHEMA_DRAFTS_READ_ON:
elsewhere the method is refused at the engine's start.

**The masks placed on the GPU with drafts.** Once speculation is on, vLLM 0.26 decodes with its V1 model runner,
whose apply_grammar_bitmask copies the step's mask into a fresh pinned tensor one row at a time in Python (9,216
rows at 1,024 requests with k = 8: 37 ms of CPU a step on the H200 host). `install_mask_scatter` copies the compact
mask once and scatters its rows on the GPU (mask_rows, apply_mask_rows: 0.6 ms), as Model Runner V2 does without
drafts; the CPU runner keeps vLLM's own. Checked against MASKS_READ_ON.

**The KV cache's size, reported.** vLLM sizes an engine's KV cache by measuring the GPU's memory, which is why
replicas sharing a GPU start one at a time (executors/base.py, Turns). `install_kv_size_report` makes the engine core
write the bytes it gave the cache to the file KV_SIZE_ENV names; kv_sizes.py keeps them, and the next start of the same
settings passes them as kv_cache_memory_bytes, measures nothing and starts beside the other replicas. Checked against
KV_SIZE_READ_ON: elsewhere nothing is written, and every start measures, as before.

**The step profiler's timers.** When a run asks for it (BATCHJSON_PROFILE_STEPS), profiler.py times each part of
an engine step: `time_engine_steps` wraps the methods of TIMED with its timer, each on its own (a part this vLLM
lacks is skipped and recorded). Checked against PROFILER_READ_ON: on another version every part is skipped.

**Read, not changed: the engine processes, its shutdown and the plugin flag.** `watch_engine_processes` reads the
sync client's processes and output queue, `shut_down` calls the client's shutdown, and
`let_forked_child_load_plugins` resets vLLM's once-per-process plugin flag. They change nothing in vLLM's behaviour,
and without them a killed engine hangs the runner, or a forked engine process outlives it: so they check the names
they use instead of READ_ON, and step aside where a name is missing.

`notice()` is the line the run's report gives when a patch is off in this vLLM (a version not in READ_ON).
BATCHJSON_PATCHES_OFF (PATCHES_OFF_ENV) names patches to leave off in a run, for side-by-side measurements.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import sys
import threading
from collections.abc import Callable

from batchjson.schema.drafts import COPY_MAX, Drafter, PromptIndex

NO_DRAFT = "batchjson_no_draft"  # the SamplingParams.extra_args key
AUDIT_TWIN = "batchjson_audit_twin"  # ... beside NO_DRAFT: a speculation audit's twin of a drafted row
# Read on: vllm/v1/core/sched/ and vllm/v1/engine/core.py of these versions. Scheduler.schedule(self,
# throttle_prefills=False) schedules a running request's drafts from Request.spec_token_ids alone (and empties them);
# Scheduler.add_request(self, request); SamplingParams.extra_args. Drafts reach spec_token_ids after a step
# (update_draft_token_ids), or under async scheduling as placeholders that AsyncScheduler._update_after_schedule sets
# after schedule(), sized by the drafts schedule() scheduled; update_draft_token_ids_in_output fills only requests
# that were scheduled placeholders, and the GPU model runners (V1, and V2 in 0.33) verify per request the drafts in
# scheduled_spec_decode_tokens. In 0.33 the skip_drafts step flag (Scheduler._drafts_unused) is new and changes
# none of this. Not reached by the patch, in every version read: schedule() pads a request it admits with one token
# left to compute (a resumed one, a fully cached prompt) with placeholder drafts (-1, not the drafter's) for one step,
# to keep a uniform CUDA graph. check_sequence_repetition(token_ids, params) in
# vllm/v1/core/sched/utils.py, called by check_stop through the module's name (the same file in 0.32 and 0.33).
# 0.34: the same names and signatures; every model runs on Model Runner V2, which takes each request's drafts to verify
# from scheduled_spec_decode_tokens (its _prepare_inputs: num_draft_tokens_np), and utils.py is 0.32's, unchanged.
READ_ON = ("0.26.", "0.32.", "0.33.", "0.34.")  # the vLLM versions both patches were read on
_ANSWERS: dict[str, str] = {}  # a patch's name -> "ok", or why it is not installed in this process
# Patches to leave off in every process of a run, by name (install_<name>, comma-separated: "no_draft,idle_drafter"),
# for side-by-side measurements; each answers "off: BATCHJSON_PATCHES_OFF" and vLLM's own code runs.
PATCHES_OFF_ENV = "BATCHJSON_PATCHES_OFF"


def unread_here(read_on: tuple[str, ...], off: dict[str, str] | None = None) -> str:
    """Why a patch read on the versions `read_on` stays off in this process's vLLM ("" where it was read); `off`
    gives, for versions that were read and where the patch has nothing to do, why."""
    import vllm

    version = vllm.__version__
    if version.startswith(read_on):
        return ""
    for prefix, why in (off or {}).items():
        if version.startswith(prefix):
            return f"off on vLLM {version}: {why}"
    return f"vLLM {version} is not a version this patch was read on ({'x, '.join(read_on)}x)"


def installs_once(install: Callable[[], str]) -> Callable[[], str]:
    """A patch's install, run once per process: its answer ("ok", or why the patch is not installed) is kept and
    returned by every later call, and an exception becomes the answer ("TypeName: message"): a patch never breaks
    the engine, vLLM's own behaviour stays. A patch named in PATCHES_OFF_ENV is not installed."""
    name = install.__name__.removeprefix("install_")

    @functools.wraps(install)
    def once() -> str:
        if name not in _ANSWERS and name in os.environ.get(PATCHES_OFF_ENV, "").split(","):
            _ANSWERS[name] = f"off: {PATCHES_OFF_ENV}"
        if name not in _ANSWERS:
            try:
                _ANSWERS[name] = install()
            except Exception as e:  # noqa: BLE001
                _ANSWERS[name] = f"{type(e).__name__}: {e}"
        return _ANSWERS[name]

    return once


def reset(answers: dict[str, str] | None = None) -> dict[str, str]:
    """Forget the answers kept so far (tests: as in a fresh process, though the patches made stay made) and keep
    `answers` instead; returns the forgotten ones, so a test can put them back."""
    forgotten = dict(_ANSWERS)
    _ANSWERS.clear()
    _ANSWERS.update(answers or {})
    return forgotten


def install() -> None:
    """The patches, in this process (the plugin calls it in each vLLM process of a run)."""
    install_no_draft()
    install_fast_loop_guard()
    install_scheduler_drafts()
    install_idle_drafter()
    install_mask_scatter()
    install_kv_size_report()
    install_fills()


def install_fills() -> None:
    """The grammar fills' patches as the run asks for them: batchjson's batch fills unless grammar_fills = "vllm",
    with GrammarAhead unless turned off."""
    if fills_wanted():
        install_batch_fills()
        if ahead_wanted():
            install_grammar_ahead()


def install_in_runner() -> None:
    """The patches the runner's own process needs: the scheduler's (whether pass 2 can go without drafts is
    decided here, and they serve an engine core in this process). The model runner's only where the engine core runs
    in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): elsewhere the plugin patches it in the engine process, and
    importing the GPU model runner here would only add its import to the start (bare vLLM's runner never imports it)."""
    install_no_draft()
    install_fast_loop_guard()
    install_scheduler_drafts()
    import vllm.envs

    if not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        install_idle_drafter()
        install_mask_scatter()
        install_kv_size_report()
        install_fills()


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

    if why := unread_here(READ_ON):
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


# Read on: vllm/v1/worker/gpu_model_runner.py of these versions (the V1 model runner, which the CPU runner
# subclasses, and which runs draft_model in 0.26). GPUModelRunner.sample_tokens asks
# _input_fits_in_drafter(self, common_attn_metadata) once per step whether the drafter runs; on False it runs no
# drafter forward, keeps the padded bookkeeping (prepare_next_token_ids_padded) and hands the scheduler zeroed drafts
# (its own path for requests near max_model_len). self.requests[req_id].sampling_params, self.input_batch.req_ids.
# 0.33 keeps all of this in the V1 runner. Its Model Runner V2 (the default where it supports the model) drafts with
# StandaloneARSpeculator, whose propose() runs the draft model whatever the step's skip_drafts or K says: nothing to
# answer there from outside, so on V2 a pass-2 step still pays the draft forward (README, "What a request without a
# draft still costs").
RUNNER_READ_ON = ("0.26.", "0.32.", "0.33.")
# Read on: vllm/v1/core/sched/scheduler.py and vllm/v1/worker/gpu/model_runner.py of these versions (no V1 runner).
# Scheduler.schedule sets SchedulerOutput.skip_drafts when _drafts_unused(self, request, num_computed_tokens,
# num_new_tokens) is True for every request it schedules (running and new alike), and only where the drafter has a
# forward of its own (can_skip_drafts: num_lookahead_tokens > 0; not ngram or suffix). Model Runner V2 then proposes
# with K = 0: StandaloneARSpeculator.propose still runs its one prefill forward (the draft model's KV cache must
# take the step's tokens) and skips its k - 1 decode forwards, handing -1 drafts that the next step does not schedule.
# A request that gets no drafts (NO_DRAFT) can use none: that is all the patch tells vLLM. A step of drafted
# requests too keeps its drafts (vLLM has no way to skip them for some: few_drafted's rule is V1's only).
SKIP_DRAFTS_READ_ON = ("0.34.",)


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
    (H200, BENCHMARKS.md run12), x1.41 with this rule (run13: the rest is the engine's own, README, "What a request
    without a draft still costs"). A skipped step's drafted requests decode one token as without speculation
    (vLLM's own path for a step it cannot draft for), so outputs stay the same. "ok" or why not (then the drafter
    runs as vLLM has it). Only draft-model methods: ngram and suffix drafting cost no forward pass, and suffix
    decoding keeps per-request state that every step must see."""
    import inspect

    if not unread_here(SKIP_DRAFTS_READ_ON):
        return _install_skip_drafts()
    if why := unread_here(RUNNER_READ_ON):
        return why
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
    """Model Runner V2's idle drafter (SKIP_DRAFTS_READ_ON): the scheduler counts a NO_DRAFT request's drafts as
    unused, so a step of such requests alone (pass 2 on pass 1's engine) is proposed for with K = 0."""
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


# ---------------------------------------------------------------- the grammar's masks at a full batch
# Read on: vllm/v1/structured_output/__init__.py of these versions. StructuredOutputManager.grammar_bitmask(self,
# requests, structured_output_request_ids, scheduled_spec_decode_tokens) returns one int32 row (vocab/32 words) per
# request and position, in the order of the ids (a request's k drafted positions, then its bonus position), as a numpy
# view of a tensor it keeps; a request whose grammar is terminated, or a position it does not constrain, gets -1 (every
# token allowed). Without a reasoning parser every row of a request is constrained. Its grammars are
# backend_xgrammar.XgrammarGrammar (`matcher`, an xgrammar GrammarMatcher; `is_terminated()`), advanced and rolled
# back around the drafted positions. 0.26 and 0.32 differ only with drafts: after a -1 draft (padding), 0.26 fills
# the bonus row from the grammar and 0.32 leaves it -1; a draft the grammar rejects raises in 0.26 and makes 0.32 copy
# the last row into the rest. So the drafted path here is 0.26's, and on 0.32 a step with drafts takes vLLM's own.
# 0.34 (its __init__.py, backend_xgrammar.py, and Model Runner V2's structured_outputs.py): where the engine drafts
# (vllm_config.num_speculative_tokens = k > 0), each request owns a block of mask_stride = k + 1 rows, from
# i * (k + 1), whether or not it has drafts this step; rows past its own are left as they were (the runner's kernel
# masks only the positions a request has logits for). Without k, one row per request, as before. In a block: each
# drafted position's row, then the bonus row, from the grammar advanced through the drafts before it; once a draft
# is -1 (padding), refused by the grammar, or the grammar has ended, every later row of the block is -1, and the
# grammar is rolled back at the end. Under async scheduling the drafts are the drafter's unchecked ones
# (update_draft_token_ids_in_output pads them with -1), so refusals happen there and are not errors.
FILLS_READ_ON = ("0.26.", "0.32.", "0.34.")
DRAFTED_FILLS_READ_ON = ("0.26.", "0.34.")
STRIDED_FILLS_READ_ON = ("0.34.",)  # the versions whose rows are blocks of k + 1 (the rest: a row per position)
GRAMMAR_FILLS_ENV = "BATCHJSON_GRAMMAR_FILLS"  # "batch" (the default) or "vllm": set by VllmEngine from the spec
MASK_BUFFERS = 3  # a buffer is filled again 3 steps later: vLLM keeps at most 2 steps in flight (its batch queue)


FILL_THREADS_ENV = "BATCHJSON_FILL_THREADS"  # a count of xgrammar's fill threads (the benchmarks' comparisons)


def fill_threads() -> int:
    """xgrammar's threads for one engine's fills: vLLM's own count, min(cores/2, 8), of the cores this process may
    use (an engine replica's share of the host), unless FILL_THREADS_ENV gives one."""
    given = os.environ.get(FILL_THREADS_ENV, "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, min(len(os.sched_getaffinity(0)) // 2, 8))


class BatchFills:
    """One step's grammar masks through xgrammar's BatchGrammarMatcher: one call fills every row of a position in
    C++ threads, where vLLM makes a Python call per row (in 16-row tasks on a thread pool without drafts, serially
    with them), then advances each matcher through its drafts with one call per position and rolls them back with
    one. Rows and values are vLLM's own (see FILLS_READ_ON). The mask is written into one of MASK_BUFFERS buffers
    in pinned memory where this process runs the GPU model runner, so the runner copies it to the GPU as it is,
    without first copying it into pinned memory of its own (19.4 MB a step at 1,024 rows of a 151,936-token
    vocabulary)."""

    def __init__(self, rows: int, words: int, drafted: bool, pinned: bool = False, stride: int = 0):
        import torch
        import xgrammar as xgr

        self.buffers = [torch.empty((rows, words), dtype=torch.int32, pin_memory=pinned) for _ in range(MASK_BUFFERS)]
        self.turn = 0
        self.drafted = drafted  # this vLLM's drafted path is the one read (DRAFTED_FILLS_READ_ON)
        self.stride = stride  # rows a request owns (vLLM 0.34: k + 1), or 0: a row per position, packed (0.26)
        self.batch = xgr.BatchGrammarMatcher(fill_threads())
        self.xgr = xgr
        core = getattr(getattr(xgr, "base", None), "_core", None)  # xgrammar's FFI module (0.2.8, 0.2.9)
        self.core = core if hasattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token") else None
        self.finds_refusals = self.core is not None and self._finds_refusals()

    @classmethod
    def for_manager(cls, manager, drafted: bool) -> "BatchFills":
        """For a StructuredOutputManager: rows for its batch and drafts, in pinned memory where this process runs the
        GPU model runner (the one-GPU engine core does)."""
        import torch

        config = manager.vllm_config
        k = (config.speculative_config.num_speculative_tokens if config.speculative_config else 0) or 0
        words = manager.backend.allocate_token_bitmask(1).shape[1]
        pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
        stride = 1 + k if k and not unread_here(STRIDED_FILLS_READ_ON) else 0
        return cls(config.scheduler_config.max_num_seqs * (1 + k), words, drafted, pinned, stride)

    def bitmask(self, requests, ids, drafts):
        """vLLM's grammar_bitmask for these requests, or None where this step is vLLM's own (drafts on an unread
        vLLM)."""
        if drafts and any(drafts.get(r) for r in ids):
            return self._drafted(requests, ids, drafts) if self.drafted else None
        grammars = [requests[r].structured_output_request.grammar for r in ids]
        if self.stride:  # the first row of each request's block
            return self.fill(grammars, self._next(), range(0, len(ids) * self.stride, self.stride))[
                :len(ids) * self.stride].numpy()
        return self.fill(grammars)[:len(ids)].numpy()

    def accept(self, matchers, tokens):
        """xgrammar's batch accept of one token each: truthy where accepted, in order. Its wrapper reads the answer
        (an FFI array) an element at a time in Python, each read an FFI call that lets the interpreter's lock go and
        waits to take it back beside the forward's launch; here one FFI call asks whether any was refused (0 in
        the answer) and the answer is read only then, where xgrammar's FFI module is there and answers as read."""
        if self.core is None or not all(hasattr(m, "_handle") for m in matchers[:1]):
            return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        answer = self.core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
        if self.finds_refusals and 0 not in answer:
            return itertools.repeat(True, len(matchers))
        return answer[:]

    def _finds_refusals(self) -> bool:
        """Whether `0 in answer` finds the refused tokens of this xgrammar's batch accept, tried once on a grammar of
        a two-token vocabulary: "}" refused and "{" taken at a JSON value's start."""
        xgr, core = self.xgr, self.core
        try:
            compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["{", "}"])).compile_builtin_json_grammar()
            matchers = [xgr.GrammarMatcher(compiled) for _ in range(2)]
            both = core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], [0, 1], False)
            taken = core.BatchGrammarMatcher.batch_accept_token([matchers[1]._handle], [0], False)
            return [bool(ok) for ok in both[:]] == [True, False] and 0 in both and 0 not in taken
        except Exception:  # noqa: BLE001 - an xgrammar that answers otherwise: its answers are read in full
            return False

    def fill_rows(self, matchers, rows, ended, mask=None):
        """`mask` (default the next buffer) with `matchers`' masks at `rows` and -1 at `ended` (rows of ended grammars;
        through numpy: torch's indexed write runs its own threads on a CPU)."""
        if mask is None:
            mask = self._next()
        if ended:
            mask.numpy()[ended] = -1
        if matchers:
            self.batch.batch_fill_next_token_bitmask(matchers, mask, rows)
        return mask

    def fill(self, grammars, mask=None, rows=None):
        """The masks of `grammars` (vLLM's XgrammarGrammar) in the next buffer, a row each in order, or into `mask`
        at `rows`: -1 for a terminated grammar, as vLLM fills. Returns the buffer."""
        if mask is None:
            mask, rows = self._next(), range(len(grammars))
        matchers, at, ended = [], [], []
        for row, grammar in zip(rows, grammars):
            if grammar.is_terminated():
                ended.append(row)
            else:
                matchers.append(grammar.matcher)
                at.append(row)
        return self.fill_rows(matchers, at, ended, mask)

    def _next(self):
        mask = self.buffers[self.turn]
        self.turn = (self.turn + 1) % MASK_BUFFERS
        return mask

    def _drafted(self, requests, ids, drafts):
        """vLLM's rows with drafts: for each request, a row per drafted position filled from the grammar
        advanced through the drafts before it, then the bonus row; a terminated grammar's rows are -1; the grammar is
        rolled back at the end. After a -1 draft the grammar stays and the drafted rows are -1; vLLM 0.26 fills the
        bonus row (and raises at a refused draft), 0.34 (`stride`) makes the rest of the block -1 after a -1 draft
        or a refused one, and places each request's rows at its block of `stride`."""
        mask = self._next()
        grammars = [requests[r].structured_output_request.grammar for r in ids]
        tokens = [drafts.get(r, ()) for r in ids]
        first, row = [], 0
        for t in tokens:
            first.append(row)
            row += self.stride or len(t) + 1
        total = row
        ended = [g.is_terminated() for g in grammars]
        applying = [True] * len(ids)
        advanced = [0] * len(ids)
        unconstrained: list[int] = []
        live = list(range(len(ids)))
        position = 0
        while live:
            matchers, rows, movers, moves = [], [], [], []
            for i in live:
                t, at = tokens[i], first[i] + position
                bonus = position == len(t)
                if ((bonus and not self.stride) or applying[i]) and not ended[i]:
                    matchers.append(grammars[i].matcher)
                    rows.append(at)
                else:
                    unconstrained.append(at)
                if bonus:
                    continue
                if t[position] == -1:
                    applying[i] = False
                elif applying[i] and not ended[i]:
                    movers.append(i)
                    moves.append(t[position])
            if matchers:
                self.batch.batch_fill_next_token_bitmask(matchers, mask, rows)
            if movers:
                moved = [grammars[i].matcher for i in movers]
                accepted = self.accept(moved, moves)
                for i, token, ok in zip(movers, moves, accepted):
                    if not ok and self.stride:  # 0.34: the rest of the block is -1
                        applying[i] = False
                        continue
                    if not ok:  # vLLM 0.26 raises the same (the scheduler validated every draft before)
                        raise AssertionError((token, ids[i], drafts))
                    advanced[i] += 1
                    ended[i] = grammars[i].matcher.is_terminated()
            position += 1
            live = [i for i in live if len(tokens[i]) >= position]
        if unconstrained:
            mask.numpy()[unconstrained] = -1
        back = [i for i in range(len(ids)) if advanced[i]]
        if back:
            self.xgr.BatchGrammarMatcher.batch_rollback([grammars[i].matcher for i in back],
                                                        [advanced[i] for i in back])
        return mask[:total].numpy()


def grammar_fills(setting: str) -> str:
    """The grammar fill path an engine started with `setting` ([model] grammar_fills) runs, for the run's report:
    "batch (...)", or "vllm (why)". Reads this vLLM and xgrammar; installs nothing."""
    if setting == "vllm":
        return 'vllm ([model] grammar_fills = "vllm")'
    why = _batch_fills_unready()
    if why:
        return f"vllm ({why})"
    threads = fill_threads()
    ahead = "" if unread_here(AHEAD_READ_ON) or not ahead_wanted() else "; beside the forward's launch"
    return f"batch (xgrammar's batch matcher, {threads} thread{'s' if threads > 1 else ''}{ahead})"


def fills_wanted() -> bool:
    """Whether this process's engines fill through BatchFills: unless the run set grammar_fills = "vllm"."""
    return os.environ.get(GRAMMAR_FILLS_ENV, "batch") != "vllm"


def _batch_fills_unready() -> str:
    """Why BatchFills cannot serve this vLLM and xgrammar ("" where it can)."""
    import inspect

    if why := unread_here(FILLS_READ_ON):
        return why
    import xgrammar as xgr
    from vllm.v1.structured_output import StructuredOutputManager

    if list(inspect.signature(StructuredOutputManager.grammar_bitmask).parameters) != [
            "self", "requests", "structured_output_request_ids", "scheduled_spec_decode_tokens"]:
        return "StructuredOutputManager.grammar_bitmask changed"
    if not all(hasattr(xgr.BatchGrammarMatcher, name) for name in (
            "batch_fill_next_token_bitmask", "batch_accept_token", "batch_rollback")):
        return "this xgrammar has no BatchGrammarMatcher with batch fills, accepts and rollbacks"
    return ""


def fills_for(manager):
    """A StructuredOutputManager's BatchFills, made at its first fill; False where its grammars are not ours to fill
    (another backend, a reasoning parser, a diffusion model)."""
    fills = manager.__dict__.get("_batchjson_fills")
    if fills is None:
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

        ours = (isinstance(manager.backend, XgrammarBackend) and manager.reasoner_cls is None
                and not getattr(manager.vllm_config.model_config, "is_diffusion", False))
        fills = BatchFills.for_manager(manager, not unread_here(DRAFTED_FILLS_READ_ON)) if ours else False
        manager.__dict__["_batchjson_fills"] = fills
    return fills


@installs_once
def install_batch_fills() -> str:
    """Patch StructuredOutputManager.grammar_bitmask (in this process) to fill through BatchFills where the grammars
    are xgrammar's and no reasoning parser gates them; vLLM's own fill everywhere else. "ok" or why not (then
    vLLM's fills run). Installed unless the run set grammar_fills = "vllm" (fills_wanted)."""
    if why := _batch_fills_unready():
        return why
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

    own = StructuredOutputManager.grammar_bitmask

    @functools.wraps(own)
    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        fills = fills_for(self) if structured_output_request_ids else False
        if fills:
            grammar = requests[structured_output_request_ids[0]].structured_output_request.grammar
            if isinstance(grammar, XgrammarGrammar):
                mask = fills.bitmask(requests, structured_output_request_ids, scheduled_spec_decode_tokens)
                if mask is not None:
                    return mask
        return own(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)

    StructuredOutputManager.grammar_bitmask = grammar_bitmask
    return "ok"


# ---------------------------------------------------------------- the grammars' work beside the forward's launch
# Read on: vllm/v1/engine/core.py, v1/core/sched/scheduler.py and async_scheduler.py, v1/structured_output/__init__.py,
# v1/executor/uniproc_executor.py, v1/worker/gpu/async_utils.py and structured_outputs.py of 0.26. Under async
# scheduling EngineCore.step_with_batch_queue begins with at most one step in its batch_queue, the oldest ([-1]):
# (the future of step n's sampled tokens, n's SchedulerOutput, ...). It schedules step n+1 and launches n+1's forward
# (execute_model); where n+1 holds structured requests still waiting for tokens (SchedulerOutput.
# pending_structured_output_tokens, set inside schedule()), it then takes n's output (future.result()), runs
# Scheduler.update_from_output(n), and only then Scheduler.get_grammar_bitmask(n+1) and sample_tokens(n+1).
# update_from_output advances the grammar of each request n scheduled that is still in self.requests and not
# finished, whose tokens AsyncScheduler._update_request_with_output keeps (it drops them while
# async_tokens_to_discard > 0) and that got a token (one token is never trimmed at a stop), where
# StructuredOutputManager.should_advance(request) says so (always without a reasoning parser); XgrammarGrammar.
# accept_tokens refuses a terminated grammar untouched, else matcher.accept_token, num_processed_tokens += 1 and
# _is_terminated (is_terminated() returns it; the matcher, made without terminate_without_stop_token, ends only by
# accepting one of its stop_token_ids); a refused token ends the request with an error. Request.is_finished() is
# RequestStatus.is_finished(status): status > PREEMPTED. Nothing else touches a grammar between n+1's schedule
# and its mask without drafts (preemption leaves grammars as they are). get_grammar_bitmask(n+1)'s ids: the requests
# n+1 scheduled, in order, still in self.requests, structured and not a prefill chunk. Model Runner V2 masks one logits
# row per id (StructuredOutputsWorker.apply_grammar_bitmask), and n+1's forward holds every request n+1 scheduled.
# With one process (UniProcExecutor) n's future is an AsyncOutputFuture whose async_output (Model Runner V2's
# AsyncOutput) holds pinned copies of the sampled tokens (sampled_token_ids: rows x 1 without drafts,
# num_sampled_tokens_np), complete once its copy_event is, and model_runner_output.req_id_to_index.
# One step at a time (async scheduling off: every n-gram, suffix and draft-model engine of 0.26) EngineCore.step runs
# schedule(), execute_model (the forward's launch), get_grammar_bitmask, sample_tokens, update_from_output; drafts come
# after (post_step: update_draft_token_ids, where vLLM cuts them with validate_tokens). Between schedule() and
# get_grammar_bitmask nothing touches a grammar or the scheduler's requests, so the step's masks (its drafted
# positions' too) can be filled on a thread from the moment it is scheduled.
# 0.34: the same step_with_batch_queue, EngineCore.step and get_grammar_bitmask; the advance in update_from_output is
# StructuredOutputManager.accept_tokens(request, new_token_ids) (should_advance is gone; without a reasoning parser it
# is grammar.accept_tokens of them all, which returns True untouched on a terminated grammar), called for every
# request that got tokens unless its output is stale and dropped: Request.num_stale_output_tokens (0.26's
# async_tokens_to_discard) is read before update_from_output counts it down, so a request with any is left to vLLM
# (and refilled if vLLM advanced it). ModelRunnerOutput has no req_id_to_index: the rows are req_ids' order. Async
# scheduling is on with drafts too (Model Runner V2 everywhere), and their drafts reach the step's output only after
# update_from_output (update_draft_token_ids_in_output): a drafted engine that schedules ahead is vLLM's own here.
AHEAD_READ_ON = ("0.26.", "0.34.")
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
            engine_gc(_cuda_platform())
            fills = fills_for(manager)
            config = manager.vllm_config
            sync = not config.scheduler_config.async_scheduling
            usable = (fills and scheduler.connector is None and config.parallel_config.pipeline_parallel_size == 1
                      and (sync or not scheduler.num_spec_tokens))
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
                or not scheduled.pending_structured_output_tokens or scheduled.scheduled_spec_decode_tokens
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
        return None if advanced is None else self.fill_next(scheduled, advanced)

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
            if len(rows) and counts.max() > 1:  # drafted tokens: not a step this reads
                return None
            tokens = output.sampled_token_ids[rows, 0].tolist()
            movers = [(req_id, grammar, token) for req_id, count, token in zip(ids, counts.tolist(), tokens)
                      if count and (request := requests.get(req_id)) is not None and request.status <= preempted
                      and not getattr(request, stale)
                      and not (grammar := known.get(req_id)
                               or request.structured_output_request.grammar)._is_terminated]
        except Exception:  # noqa: BLE001 - nothing advanced yet: this step is vLLM's own
            return None
        if not movers:
            return set()
        accepted = self.fills.accept([m[1].matcher for m in movers], [m[2] for m in movers])
        if self.stops is None:
            self.stops = frozenset(movers[0][1].matcher.stop_token_ids)
        stops, advanced = self.stops, set()
        for (req_id, grammar, token), ok in zip(movers, accepted):
            if ok:  # a refused token is left to vLLM, which refuses it too and ends the request
                grammar.num_processed_tokens += 1
                if token in stops:
                    grammar._is_terminated = grammar.matcher.is_terminated()
                advanced.add(req_id)
        return advanced

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
                self.job = (updated, self.job[1], self.thread.submit(self.fill_next, self.job[1], done))
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
        if self.moved:
            import torch

            again = [row for row, req_id in enumerate(ids) if req_id in self.moved]
            if again:
                self.fills.fill([self.grammars[ids[row]] for row in again], torch.from_numpy(mask), again)
            self.moved = set()
        self.last = (scheduled, ids)
        return GrammarOutput(ids, mask)

    def note(self, scheduled, out) -> None:
        """In get_grammar_bitmask when vLLM made the masks: the step and its ids, for the next step's work."""
        self.last = (scheduled, out.structured_output_request_ids) if out is not None else None
        self.grammars = {}


def stale_field() -> str:
    """The Request field that counts the output tokens vLLM will not take from the steps in flight (0.26's name, or
    0.34's)."""
    return "async_tokens_to_discard" if not unread_here(("0.26.",)) else "num_stale_output_tokens"


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


@installs_once
def install_grammar_ahead() -> str:
    """Patch EngineCore.step_with_batch_queue (to note the step waiting in its queue), Scheduler.schedule (to start
    GrammarAhead's work), Scheduler.update_from_output and StructuredOutputManager.should_advance (0.26) or
    accept_tokens (0.34) (to skip the grammars advanced there) and Scheduler.get_grammar_bitmask (to hand over its
    masks). "ok" or why not (then the masks are made when vLLM asks for them). Installed with BatchFills unless
    AHEAD_ENV is "0" (`ahead_wanted`)."""
    import inspect

    if why := unread_here(AHEAD_READ_ON) or _batch_fills_unready():
        return why
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    step, schedule = EngineCore.step_with_batch_queue, Scheduler.schedule
    update, masks = Scheduler.update_from_output, Scheduler.get_grammar_bitmask
    hook = "should_advance" if not unread_here(("0.26.",)) else "accept_tokens"  # where vLLM advances a grammar
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


# ---------------------------------------------------------------- the masks' way to the GPU with drafts
# Read on: vllm/v1/structured_output/utils.py of these versions. apply_grammar_bitmask(scheduler_output,
# grammar_output, input_batch, logits), imported by name into vllm/v1/worker/gpu_model_runner.py, masks the logits
# before sampling in the V1 GPU model runner, which vLLM 0.26 decodes with once speculation is on (Model Runner V2
# without it copies the compact mask once and scatters it on the GPU). Its rows: grammar_output.grammar_bitmask holds
# each request of structured_output_request_ids in turn, 1 + its scheduled drafts rows; a request's first logit row
# is its index in input_batch.req_ids plus the drafts of the requests before it; requests not in the batch are
# skipped. It builds a (logit rows x words) pinned tensor of -1 every step, copies the rows into it one at a time in
# Python and copies it all to the GPU: at 1,024 requests with k = 8, 9,216 rows and 175 MB a step.
MASKS_READ_ON = ("0.26.", "0.32.")
MASKS_OFF = {"0.34.": "no V1 GPU model runner (vllm/v1/worker/gpu_model_runner.py is gone); Model Runner V2, which "
                      "runs every engine, copies the mask once and applies it on the GPU by its own kernel"}


def mask_rows(req_ids, grammar_ids, spec_tokens):
    """Where apply_grammar_bitmask puts the compact mask's rows: (the rows kept, None for all of them; the logit row
    of each kept row), as int32 arrays. One Python step per request, not per row."""
    import numpy as np

    first, offset = {}, 0
    for index, req_id in enumerate(req_ids):
        first[req_id] = index + offset
        offset += len(spec_tokens.get(req_id, ()))
    n = len(grammar_ids)
    counts = np.fromiter((1 + len(spec_tokens.get(r, ())) for r in grammar_ids), np.int64, n)
    starts = np.fromiter((first.get(r, -1) for r in grammar_ids), np.int64, n)
    ends = np.cumsum(counts)
    position = np.arange(int(ends[-1]) if n else 0) - np.repeat(ends - counts, counts)
    logit_rows = (np.repeat(starts, counts) + position).astype(np.int32)
    if (starts >= 0).all():
        return None, logit_rows
    kept = np.repeat(starts >= 0, counts)
    return np.flatnonzero(kept).astype(np.int32), logit_rows[kept]


def apply_mask_rows(grammar_bitmask, kept, logit_rows, logits) -> None:
    """Mask `logits` in place with the compact mask's rows (mask_rows' answer): one copy of the mask to the logits'
    device (from pinned memory where the fills left it there: BatchFills), its rows scattered to their logit rows
    there, xgrammar's kernel on those rows alone. Any device; the engine uses it where the logits are on a GPU."""
    import torch
    import xgrammar as xgr

    if not len(logit_rows):
        return
    device = logits.device
    on_gpu = device.type != "cpu"

    def to_device(array):
        tensor = torch.from_numpy(array)
        if on_gpu and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    rows, targets = to_device(grammar_bitmask), to_device(logit_rows)
    if kept is not None:
        rows = rows[to_device(kept).long()]
    placed = torch.empty((logits.shape[0], rows.shape[1]), dtype=rows.dtype, device=device)
    placed.index_copy_(0, targets.long(), rows)
    xgr.apply_token_bitmask_inplace(logits, placed, indices=targets if on_gpu else logit_rows.tolist())


@installs_once
def install_mask_scatter() -> str:
    """Patch the V1 GPU model runner's apply_grammar_bitmask (in this process) to place the rows on the GPU
    (mask_rows, apply_mask_rows) where the logits are there; vLLM's own where they are not (the CPU runner). "ok" or
    why not (then vLLM's own runs)."""
    import inspect

    if why := unread_here(MASKS_READ_ON, MASKS_OFF):
        return why
    from vllm.v1.structured_output import utils
    from vllm.v1.worker import gpu_model_runner

    own = utils.apply_grammar_bitmask
    if gpu_model_runner.apply_grammar_bitmask is not own or list(inspect.signature(own).parameters) != [
            "scheduler_output", "grammar_output", "input_batch", "logits"]:
        return "apply_grammar_bitmask changed"

    @functools.wraps(own)
    def apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits):
        if logits.is_cpu:
            return own(scheduler_output, grammar_output, input_batch, logits)
        kept, logit_rows = mask_rows(input_batch.req_ids, grammar_output.structured_output_request_ids,
                                     scheduler_output.scheduled_spec_decode_tokens)
        apply_mask_rows(grammar_output.grammar_bitmask, kept, logit_rows, logits)

    gpu_model_runner.apply_grammar_bitmask = apply_grammar_bitmask
    return "ok"


# ---------------------------------------------------------------- the schema drafter
# Read on: vllm/v1/spec_decode/custom_class_proposer.py, the V1 model runner, vllm/v1/engine/core.py and
# vllm/v1/core/sched/scheduler.py of these versions. speculative_config {"method": "custom_class", "model":
# "<module>.<Class>"} makes the runner build Class(vllm_config) and call its propose(sampled_token_ids, ...) once a
# step; the runner hands the lists it returns, with the batch's request ids, to the scheduler. A custom drafter runs
# without async scheduling, where EngineCore.post_step passes them (DraftTokenIds(req_ids, draft_token_ids)) to
# Scheduler.update_draft_token_ids after update_from_output has advanced each request's grammar through the step's
# tokens; that method skips finished requests, clears a prefill chunk's drafts, keeps each draft's grammar-valid prefix
# (0.26: grammar.validate_tokens where structured_output_manager.should_advance; 0.32:
# structured_output_manager.validate_tokens: an accept per token, then a rollback) and stores it as
# request.spec_token_ids, which the next step schedules. Request: prompt_token_ids, output_token_ids,
# structured_output_request.grammar (XgrammarGrammar: `matcher`, `is_terminated()`).
SCHEMA_DRAFTS_READ_ON = ("0.26.", "0.32.")
SCHEMA_DRAFTS_OFF = {"0.34.": "method custom_class is gone (Model Runner V2 drafts only with the speculators of "
                              "vllm/v1/worker/gpu/spec_decode/, on the GPU side); the schema drafts need a speculator "
                              "registered with register_speculative_method"}
SCHEMA_PROPOSER = "batchjson.engine.internals.SchemaProposer"


def schema_drafts_unready() -> str:
    """Why the schema drafter cannot run on this vLLM ("" where it can)."""
    import importlib.util
    import inspect

    if why := unread_here(SCHEMA_DRAFTS_READ_ON, SCHEMA_DRAFTS_OFF):
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
            draft, forced = self.drafter.draft(matcher or _NO_GRAMMAR, prompt, request.output_token_ids[-COPY_MAX:])
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


class _Unconstrained:
    """A matcher that forces nothing: the drafter then proposes copies only."""

    @staticmethod
    def find_jump_forward_string() -> str:
        return ""


_NO_GRAMMAR = _Unconstrained()


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

    import vllm
    from vllm.v1.core.sched import utils

    global VLLM_CHECK
    VLLM_CHECK = utils.check_sequence_repetition
    if not vllm.__version__.startswith(READ_ON) or \
            list(inspect.signature(VLLM_CHECK).parameters) != ["token_ids", "params"]:
        return f"vLLM {vllm.__version__}: check_sequence_repetition is not the one this was read on"
    utils.check_sequence_repetition = repeats
    return "ok"


# Read on: vllm/v1/engine/core.py and vllm/v1/worker/gpu_worker.py of these versions. EngineCore.__init__ loads the
# general plugins, then builds the executor (the workers' init_device takes the memory snapshot) and calls
# self._initialize_kv_caches(vllm_config), which sets self.available_gpu_memory_for_kv_cache to the bytes the first
# worker's determine_available_memory found for the KV cache (by profiling, or kv_cache_memory_bytes as given: then
# it skips the profiling's memory measurement), allocates the cache and captures the CUDA graphs. 0.34: the same.
KV_SIZE_READ_ON = ("0.26.", "0.32.", "0.34.")
KV_SIZE_ENV = "BATCHJSON_KV_SIZE_FILE"  # where the engine core writes its KV cache's bytes (set by VllmEngine)


@installs_once
def install_kv_size_report() -> str:
    """Make EngineCore write the bytes its KV cache was given to the file KV_SIZE_ENV names, once the cache is
    allocated (engine/kv_sizes.py keeps them for the next start of the same settings); "ok" or why not. Reads
    vLLM's number, changes nothing of its start."""
    if why := unread_here(KV_SIZE_READ_ON):
        return why
    from vllm.v1.engine.core import EngineCore

    own = EngineCore._initialize_kv_caches

    @functools.wraps(own)
    def initialize_kv_caches(self, *args, **kwargs):
        config = own(self, *args, **kwargs)
        path, size = os.environ.get(KV_SIZE_ENV), getattr(self, "available_gpu_memory_for_kv_cache", -1)
        if path and isinstance(size, int) and size > 0:
            with open(path, "w") as f:
                f.write(str(size))
        return config

    EngineCore._initialize_kv_caches = initialize_kv_caches
    return "ok"


# Read on: the parts the step profiler (profiler.py) times, in vLLM 0.26 on a GPU and 0.32 on CPU: what is timed, part
# by part: (module, class, method, part, wait for the GPU around it). Each is patched on its own: a module that does
# not import or a class or method that this vLLM lacks skips that entry (recorded in the profile file's "patches"),
# never the others. vLLM 0.26 on a GPU runs a dense model without speculation on the V2 model runner
# (vllm/v1/worker/gpu/, VllmConfig.use_v2_model_runner: default for non-MoE models) and with ngram, suffix or
# draft_model speculation on the V1 one (vllm/v1/worker/gpu_model_runner.py); 0.32 on CPU uses V1's subclass
# CPUModelRunner. Parts nest: sample_tokens holds sample, rejection_sampler and propose; V2's sample holds the logits,
# the grammar bitmask's application, and the (rejection) sampler. update_from_output holds the grammars' advance:
# XgrammarGrammar.accept_tokens, one call per request with new tokens (0.26 calls it from the scheduler, 0.32 through
# StructuredOutputManager.accept_tokens; vLLM's own fills with drafts call it too, batchjson's BatchFills do not), so
# "advance" is timed call by call, under 1 us of the timer's own a call (< 1 ms a step at 1,024 requests, inside
# "update_from_output"). Scheduler.schedule returns a SchedulerOutput with total_num_scheduled_tokens;
# EngineCore.shutdown(self) ends the engine core. 0.34: no V1 runner (its entries are skipped), every engine on V2,
# whose speculators (standalone_ar for draft_model, ngram, suffix, target_dependent_ar, dflash) override propose;
# StructuredOutputManager.accept_tokens calls XgrammarGrammar.accept_tokens from update_from_output.
PROFILER_READ_ON = ("0.26.", "0.32.", "0.34.")
V1 = "vllm.v1.worker.gpu_model_runner"
V2 = "vllm.v1.worker.gpu.model_runner"
TIMED = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule", False),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output", False),
    ("vllm.v1.structured_output", "StructuredOutputManager", "grammar_bitmask", "grammar_bitmask", False),
    ("batchjson.engine.internals", "BatchFills", "bitmask", "batch_fills", False),
    ("batchjson.engine.internals", "GrammarAhead", "work", "ahead", False),
    ("batchjson.engine.internals", "GrammarAhead", "fill_beside", "ahead", False),
    ("batchjson.engine.internals", "GrammarAhead", "advance", "ahead_advance", False),
    ("batchjson.engine.internals", "GrammarAhead", "fill_next", "ahead_fill", False),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "get_grammar_bitmask", "get_grammar_bitmask", False),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_draft_token_ids", "drafts", False),
    ("vllm.v1.structured_output.backend_xgrammar", "XgrammarGrammar", "accept_tokens", "advance", False),
    ("vllm.v1.engine.core", "EngineCore", "step", "engine_step", False),
    ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue", "engine_step", False),
    (V1, "GPUModelRunner", "execute_model", "forward", True),
    (V1, "GPUModelRunner", "sample_tokens", "sample_tokens", True),
    (V1, "GPUModelRunner", "propose_draft_token_ids", "propose", True),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward", "rejection_sampler", True),
    (V2, "GPUModelRunner", "execute_model", "forward", True),
    (V2, "GPUModelRunner", "sample_tokens", "sample_tokens", True),
    (V2, "GPUModelRunner", "sample", "sample", True),
    ("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler", "__call__", "rejection_sampler", True),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "BaseSpeculator", "propose", "propose", True),
)
# V2's speculators override BaseSpeculator.propose in these modules: imported (when they import) so that every
# subclass that defines propose is timed.
V2_SPECULATORS = tuple(f"vllm.v1.worker.gpu.spec_decode.{name}.speculator" for name in (
    "autoregressive", "dflash", "eagle", "standalone_ar", "ngram", "suffix", "target_dependent_ar"))
Timer = Callable[[Callable, str, bool], Callable]  # (method, part, runs on the GPU) -> the timed method


def time_engine_steps(timer: Timer, on_step: Callable[[int, int, int], None],
                      on_shutdown: Callable[[], None]) -> tuple[dict[str, str], list[str]]:
    """Replace each method of TIMED (in this process) with `timer(method, part, gpu)`; call `on_step()` after each
    schedule that schedules a token, and `on_shutdown()` before the engine core shuts down (an error there never
    stops the shutdown). Returns what happened to each entry ("ok", "ok: <classes>", "skipped: ...", "error: ..."),
    keyed by module.Class.method without "vllm.", and the errors; never raises for one entry. On a vLLM not in
    PROFILER_READ_ON every entry is skipped, with why."""
    unread_why = unread_here(PROFILER_READ_ON)
    patches: dict[str, str] = {}
    errors: list[str] = []
    for module, cls_name, name, part, gpu in TIMED:
        key = f"{module.removeprefix('vllm.')}.{cls_name}.{name}"
        if unread_why:
            patches[key] = f"skipped: {unread_why}"
            continue
        try:
            patches[key] = _time_method(module, cls_name, name, part, gpu, timer, on_step)
        except Exception as e:  # noqa: BLE001
            patches[key] = f"error: {type(e).__name__}: {e}"
            errors.append(f"patching {key}: {type(e).__name__}: {e}")
    if unread_why:
        return patches, errors
    try:
        from vllm.v1.engine.core import EngineCore

        shutdown = EngineCore.shutdown

        @functools.wraps(shutdown)
        def call_then_shutdown(self, *args, **kwargs):
            try:
                on_shutdown()
            except Exception:  # noqa: BLE001 - never stop a shutdown over a profile
                pass
            return shutdown(self, *args, **kwargs)

        EngineCore.shutdown = call_then_shutdown
    except Exception as e:  # noqa: BLE001
        errors.append(f"patching EngineCore.shutdown: {type(e).__name__}: {e}")
    return patches, errors


def _cuda_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def _subclasses(cls) -> list:
    out = []
    for sub in cls.__subclasses__():
        out += [sub] + _subclasses(sub)
    return out


def _time_method(module: str, cls_name: str, name: str, part: str, gpu: bool, timer: Timer,
                 on_step: Callable[[int, int, int], None]) -> str:
    """Time one method of TIMED; returns what happened ("ok", "skipped: ...")."""
    import importlib

    if module.startswith("vllm.v1.worker.gpu.") and not _cuda_platform():  # V2: GPU only (the CPU runner is V1's)
        return "skipped: not a CUDA platform"
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a module this vLLM lacks or cannot import here
        return f"skipped: import {module}: {type(e).__name__}: {e}"
    cls = getattr(mod, cls_name, None)
    if cls is None:
        return f"skipped: no {module}.{cls_name}"
    classes = [cls]
    if name == "propose" and cls_name == "BaseSpeculator":
        for extra in V2_SPECULATORS:
            try:
                importlib.import_module(extra)
            except Exception:  # noqa: BLE001
                pass
        classes += _subclasses(cls)
    patched = []
    for c in classes:
        fn = c.__dict__.get(name)
        if fn is None or getattr(fn, "_batchjson_timed", False) or getattr(fn, "__isabstractmethod__", False):
            continue
        if name == "schedule" and c is cls:
            fn = _counting(fn, on_step)
        timed = timer(fn, part, gpu)
        timed._batchjson_timed = True
        setattr(c, name, timed)
        patched.append(c.__name__)
    if not patched:
        return f"skipped: {cls_name}.{name} not found"
    return "ok" if patched == [cls_name] else "ok: " + ", ".join(patched)


def _counting(schedule, on_step: Callable[[int, int, int], None]):
    """The scheduler's schedule, calling `on_step(requests, tokens, drafted)` after each step that schedules any
    token: the requests it scheduled, their tokens, and how many of those are drafted tokens to verify."""

    @functools.wraps(schedule)
    def counted(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        if out.total_num_scheduled_tokens > 0:
            drafts = getattr(out, "scheduled_spec_decode_tokens", None) or {}
            on_step(len(out.num_scheduled_tokens), out.total_num_scheduled_tokens,
                    sum(len(d) for d in drafts.values()))
        return out

    return counted


def notice() -> str:
    """The line the run's report gives about this vLLM: "" when both scheduler patches are on; else which are off and
    why, as `unread` words it for a version not in READ_ON."""
    no_draft, guard = install_no_draft(), install_fast_loop_guard()
    if no_draft == guard == "ok":
        return ""
    import vllm

    return unread(vllm.__version__) or (f"batchjson's engine patches are off in vLLM {vllm.__version__} ("
                                        + "; ".join(why for why in (no_draft, guard) if why != "ok") + ")")


def notice_code() -> str:
    """The report's code for notice(): "" (no notice), "unread-vllm" (a version not in READ_ON) or "patches-off"."""
    if not notice():
        return ""
    import vllm

    return "unread-vllm" if unread(vllm.__version__) else "patches-off"


def unread(version: str) -> str:
    """The report's line for a vLLM version that READ_ON does not cover ("" for one it does)."""
    if version.startswith(READ_ON):
        return ""

    def minor(v: str) -> tuple[int, int] | None:
        found = re.match(r"(\d+)\.(\d+)", v)
        return (int(found[1]), int(found[2])) if found else None

    mine, newest = minor(version), max(minor(v) for v in READ_ON)
    how = "newer than" if mine is not None and mine > newest else "not one of"
    return (f"vLLM {version} is {how} the versions batchjson's engine patches were read on "
            f"({', '.join(v.rstrip('.') for v in READ_ON)}): both are off (pass 2 cannot share a speculative engine, "
            "and vLLM's own loop guard runs)")


def watch_engine_processes(llm, closed: threading.Event, dead_exc: type[Exception],
                           hung: Callable[[], str] | None = None) -> bool:
    """Turn a killed engine process of `llm` (a vllm.LLM) into `dead_exc` for whoever waits on its outputs; False
    where there is nothing to watch (the engine runs in this process, or the client lacks the names used here).

    vLLM's sync client (SyncMPClient) notices the death but only shuts its output thread down, so a caller waiting in
    LLMEngine.step() waits forever. A watcher thread checks the engine processes (BackgroundResources.engine_manager,
    CoreEngineProcManager.processes, and BackgroundResources.engine_dead) every half second until `closed` is set,
    and puts `dead_exc()` on the client's outputs_queue, which step() raises. An engine that lives but makes no
    progress is vLLM's blind spot: when `hung()` returns a reason, the watcher kills the engine processes (and
    theirs) and puts `dead_exc(reason)` there, so a hang is handled as a death.
    """
    client = llm.llm_engine.engine_core
    resources, outputs = getattr(client, "resources", None), getattr(client, "outputs_queue", None)
    processes = list(getattr(getattr(resources, "engine_manager", None), "processes", None) or ())
    if outputs is None or not processes:
        return False

    def watch():
        while not closed.wait(0.5):
            reason = hung() if hung else ""
            if reason:
                _kill_tree(processes)
            if reason or resources.engine_dead or not all(p.is_alive() for p in processes):
                if not closed.is_set():
                    outputs.put_nowait(dead_exc(reason) if reason else dead_exc())
                return

    threading.Thread(target=watch, name="batchjson-engine-watch", daemon=True).start()
    return True


def shut_down(llm) -> None:
    """Shut the engine core of `llm` (a vllm.LLM) down now: its processes end and free their memory. vLLM's LLM has no
    shutdown of its own; its LLMEngine's client (engine_core) has. Never raises: a dead engine may fail its own
    shutdown, and its processes are gone either way."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def _kill_tree(processes) -> None:
    """SIGKILL the engine processes and their children (a stopped process dies of SIGKILL too)."""
    import psutil  # a dependency of vLLM

    for process in processes:
        try:
            tree = psutil.Process(process.pid)
            for p in [*tree.children(recursive=True), tree]:
                p.kill()
        except psutil.Error:
            pass


def let_forked_child_load_plugins() -> None:
    """In a process just forked from one where vLLM has loaded its general plugins: let vLLM load them again.

    vLLM loads general plugins once per process (vllm.plugins.load_general_plugins, behind the module's
    `plugins_loaded` flag). On CUDA it starts the engine-core process by fork (VLLM_WORKER_MULTIPROC_METHOD defaults
    to "fork" in vllm.envs; vllm.utils.system_utils._maybe_force_spawn turns it into spawn only when CUDA is already
    initialized; the CPU platform always spawns): the child inherits `plugins_loaded = True` from the runner (set in
    EngineArgs.__post_init__), so EngineCore.__init__'s load_general_plugins() returns at once and batchjson's plugin
    never runs in the engine process. Read in 0.26, 0.32 and 0.33; a vLLM without the flag is left alone.
    """
    plugins = sys.modules.get("vllm.plugins")
    if plugins is not None and hasattr(plugins, "plugins_loaded"):
        plugins.plugins_loaded = False


def skip_msa_warmup_without_cute() -> str:
    """vLLM 0.34's kernel warmup imports the MiniMax-M3 MSA kernels for every model on CUDA, and they import the CuTe
    DSL (nvidia-cutlass-dsl): where its `cutlass.cute` is missing, every engine start fails. The warmup applies to
    MiniMax-M3 alone, so there it is replaced by one that does nothing. Read on: vLLM 0.34.0,
    model_executor/warmup/kernel_warmup.py (`from vllm.model_executor.warmup.minimax_m3_msa_warmup import
    minimax_m3_msa_warmup` under `current_platform.is_cuda()`)."""
    import importlib.util
    import types

    name = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
    try:
        if importlib.util.find_spec(name) is None or importlib.util.find_spec("cutlass.cute") is not None:
            return "not needed"
    except (ImportError, ValueError):  # `cutlass` itself missing
        pass
    stub = types.ModuleType(name)
    stub.minimax_m3_msa_warmup = lambda worker: None
    sys.modules[name] = stub
    return "ok"

"""The no-draft scheduler patch: the only module that changes vLLM's engine-core internals, with its version check.

Installed by the plugin (plugin.py) in each vLLM process of a run, and in the runner by VllmEngine (no_draft_ready).

**No draft for a request that asks for none.** A speculative engine drafts for every request; batchjson's pass 2
(rows that failed under speculation + grammar) must be decoded by the target alone, and should not need an engine of
its own. vLLM has no per-request switch, so `install_no_draft` wraps `Scheduler.add_request` (to note requests whose
`SamplingParams.extra_args` carry NO_DRAFT) and `Scheduler.schedule` (to clear their draft tokens before each step is
scheduled: the scheduler then schedules one token for them, as for a request whose draft the grammar cut to
nothing). Checked against the vLLM versions it was read on (NO_DRAFT_VERSIONS); on another version, or if the check
fails, `no_draft_ready()` is False and batchjson gives pass 2 an engine without speculation, as before.

The step profiler (profiler.py) patches vLLM's internals too, only when a run asks for it, for measurement.
"""

from __future__ import annotations

import functools


NO_DRAFT = "batchjson_no_draft"  # the SamplingParams.extra_args key
# Read on: vllm/v1/core/sched/scheduler.py of these versions (Scheduler.schedule(self, throttle_prefills=False),
# Scheduler.add_request(self, request), Request.spec_token_ids, SamplingParams.extra_args; the async scheduler sets
# its draft placeholders after schedule() and counts only the drafts that schedule() scheduled).
NO_DRAFT_VERSIONS = ("0.26.", "0.32.")
_NO_DRAFT: str | None = None  # "ok", or why the patch is not installed in this process


def no_draft_ready() -> bool:
    """Whether requests can opt out of drafts in this vLLM (installs the patch in this process if not yet)."""
    return install_no_draft() == "ok"


def install_no_draft() -> str:
    """Patch the scheduler class (in this process) so that NO_DRAFT requests are never given draft tokens; "ok" or
    why not. Idempotent; installed by the plugin in every vLLM process of a run, the runner included (where an
    in-process engine core would use it)."""
    global _NO_DRAFT
    if _NO_DRAFT is not None:
        return _NO_DRAFT
    try:
        import inspect

        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler

        if not vllm.__version__.startswith(NO_DRAFT_VERSIONS):
            _NO_DRAFT = f"vLLM {vllm.__version__} is not a version this patch was read on ({', '.join(NO_DRAFT_VERSIONS)}x)"
            return _NO_DRAFT
        if "extra_args" not in inspect.signature(SamplingParams).parameters or \
                list(inspect.signature(Scheduler.add_request).parameters) != ["self", "request"] or \
                "throttle_prefills" not in inspect.signature(Scheduler.schedule).parameters:
            _NO_DRAFT = "Scheduler.schedule/add_request or SamplingParams.extra_args changed"
            return _NO_DRAFT
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
        _NO_DRAFT = "ok"
    except Exception as e:  # noqa: BLE001 - never break the engine: pass 2 gets an engine of its own instead
        _NO_DRAFT = f"{type(e).__name__}: {e}"
    return _NO_DRAFT


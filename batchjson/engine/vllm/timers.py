"""The step profiler's timers. When a run asks for it (BATCHJSON_PROFILE_STEPS), engine/profiler.py times each part of
an engine step: `time_engine_steps` wraps the methods of TIMED with its timer, each on its own (a part this vLLM
lacks is skipped and recorded). On a vLLM not in PATCHES["timers"] every part is skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from batchjson.engine.vllm.versions import cuda_platform, unread_here

# Read on (timers): the parts the step profiler (engine/profiler.py) times, in vLLM 0.26 on a GPU and 0.32 on CPU: what
# is timed, part by part: (module, class, method, part, wait for the GPU around it). Each is patched on its own: a
# module that does not import or a class or method that this vLLM lacks skips that entry (recorded in the profile file's
# "patches"), never the others. vLLM 0.26 on a GPU runs a dense model without speculation on the V2 model runner
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
V1 = "vllm.v1.worker.gpu_model_runner"
V2 = "vllm.v1.worker.gpu.model_runner"
TIMED = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule", False),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output", False),
    ("vllm.v1.structured_output", "StructuredOutputManager", "grammar_bitmask", "grammar_bitmask", False),
    ("batchjson.engine.vllm.fills", "BatchFills", "bitmask", "batch_fills", False),
    ("batchjson.engine.vllm.ahead", "GrammarAhead", "work", "ahead", False),
    ("batchjson.engine.vllm.ahead", "GrammarAhead", "fill_beside", "ahead", False),
    ("batchjson.engine.vllm.ahead", "GrammarAhead", "advance", "ahead_advance", False),
    ("batchjson.engine.vllm.ahead", "GrammarAhead", "fill_next", "ahead_fill", False),
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
    PATCHES["timers"] every entry is skipped, with why."""
    unread_why = unread_here("timers")
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


def _subclasses(cls) -> list:
    out = []
    for sub in cls.__subclasses__():
        out += [sub] + _subclasses(sub)
    return out


def _time_method(module: str, cls_name: str, name: str, part: str, gpu: bool, timer: Timer,
                 on_step: Callable[[int, int, int], None]) -> str:
    """Time one method of TIMED; returns what happened ("ok", "skipped: ...")."""
    import importlib

    if module.startswith("vllm.v1.worker.gpu.") and not cuda_platform():  # V2: GPU only (the CPU runner is V1's)
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

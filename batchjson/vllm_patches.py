"""Changes to vLLM's engine-core internals, made by the plugin (vllm_plugin.py) inside vLLM's own processes: a
parallel grammar bitmask for speculative steps, and step profiling timers. The only module that touches vLLM
internals; engine.py asks it, in the runner, whether the installed vLLM is one it knows.

Parallel bitmask. With speculative tokens, vLLM's `StructuredOutputManager.grammar_bitmask` fills the k+1 rows of
every request one after the other in the engine-core process (its thread-pool path runs only without speculation).
Each request's rows need accept/rollback on that request's own grammar matcher, in order, so the work is split
ACROSS requests: contiguous groups of requests go to threads (xgrammar's fill_next_token_bitmask releases the GIL),
each group keeps its requests' positions in order. Anything off the plain path (a draft token the grammar rejects, a
terminated grammar, a reasoning parser, a backend other than xgrammar) runs vLLM's own function for the whole step,
so the bitmask is the one vLLM would have built.

Profiling. `BATCHJSON_PROFILE_STEPS=<file>` times each part of an engine step (count and seconds per part) and
writes them, per process, to the JSON file every few seconds and at shutdown.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import inspect
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ENV_PARALLEL = "BATCHJSON_PARALLEL_BITMASK"
ENV_PROFILE = "BATCHJSON_PROFILE_STEPS"
ENV_PROFILE_SYNC = "BATCHJSON_PROFILE_SYNC"
# The vLLM releases whose grammar_bitmask this module reproduces, by minor version, with the sha256 (first 16 hex
# digits) of that function's source: a patch release that changes its body is not "known". The two differ in one
# place the parallel fill must copy: the bonus row after a padded (-1) draft is constrained in 0.26, free in 0.32.
KNOWN = {
    "0.26": {"source": "5e402d077ad11ad4", "bonus_after_padding": True},
    "0.32": {"source": "46f2867ad31aea09", "bonus_after_padding": False},
}
SIGNATURE = ("self", "requests", "structured_output_request_ids", "scheduled_spec_decode_tokens")
GRAMMAR_METHODS = ("accept_tokens", "rollback", "fill_bitmask", "is_terminated")
PARALLEL_BACKENDS = ("XgrammarBackend",)  # per-request matchers, fill releases the GIL
MIN_PARALLEL = 4  # requests in a step below which threads cost more than they save
DUMP_EVERY_S = 2.0


def source_hash(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def unsupported() -> str | None:
    """Why the parallel bitmask cannot be installed in this vLLM; None when it can."""
    import vllm

    version = vllm.__version__
    try:
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.structured_output.backend_types import StructuredOutputGrammar
    except ImportError as e:  # a vLLM that moved them: say so, never stop the engine process over a speed-up
        return f"vLLM {version} has no {e.name or 'vllm.v1.structured_output'}"
    known = KNOWN.get(".".join(version.split(".")[:2]))
    if known is None:
        return f"vLLM {version} is not a version it was written for ({', '.join(k + '.x' for k in KNOWN)})"
    fn = StructuredOutputManager.grammar_bitmask
    if tuple(inspect.signature(fn).parameters) != SIGNATURE:
        return f"vLLM {version}'s StructuredOutputManager.grammar_bitmask has another signature"
    missing = [f"StructuredOutputGrammar.{m}" for m in GRAMMAR_METHODS if not hasattr(StructuredOutputGrammar, m)]
    missing += [] if hasattr(StructuredOutputManager, "_fill_bitmasks") else ["StructuredOutputManager._fill_bitmasks"]
    if missing:
        return f"vLLM {version} lacks {', '.join(missing)}"
    if source_hash(fn) != known["source"]:
        return f"vLLM {version}'s StructuredOutputManager.grammar_bitmask is not the {version[:4]}.0 one it reproduces"
    return None


# ---------------------------------------------------------------- the parallel bitmask

class BitmaskCounts:
    """How often the parallel path ran, and how often it handed a step back to vLLM's serial one."""

    def __init__(self, state: str):
        self.state = state
        self.parallel = self.serial = self.fallback = self.checked = self.mismatches = 0

    def to_dict(self) -> dict:
        return {"state": self.state, "parallel_steps": self.parallel, "serial_steps": self.serial,
                "fallback_steps": self.fallback, "checked_steps": self.checked, "mismatched_steps": self.mismatches}


COUNTS = BitmaskCounts("off")


def _fill_requests(manager, plan: list[tuple], bonus_after_padding: bool) -> bool:
    """Fill the rows of some requests, each in order, as vLLM's serial loop does; False when one leaves the plain
    path (its grammar rejects a draft token or has terminated): its state is rolled back first."""
    for grammar, request_id, tokens, row in plan:
        advanced, padded, ok = 0, False, True
        for token in tokens:
            manager._fill_bitmasks(((grammar, row, not padded),))
            row += 1
            if padded:
                continue
            if token == -1:  # a padded draft: later rows are free
                padded = True
            elif grammar.is_terminated() or not grammar.accept_tokens(request_id, [token]):
                ok = False
                break
            else:
                advanced += 1
        if ok:
            manager._fill_bitmasks(((grammar, row, bonus_after_padding or not padded),))
        if advanced:
            grammar.rollback(advanced)
        if not ok:
            return False
    return True


def _split(plan: list[tuple], parts: int) -> list[list[tuple]]:
    """Contiguous groups of requests with about the same number of rows each."""
    total = sum(len(p[2]) + 1 for p in plan)
    groups, group, rows = [], [], 0
    for p in plan:
        group.append(p)
        rows += len(p[2]) + 1
        if rows >= total * (len(groups) + 1) / parts and len(groups) < parts - 1:
            groups.append(group)
            group = []
    return groups + ([group] if group else [])


def _pool(manager) -> tuple[ThreadPoolExecutor, int]:
    """vLLM's own fill pool when it made one (more than 128 sequences), else one of the same size."""
    pool = getattr(manager, "executor_for_fillmask", None) or getattr(manager, "_batchjson_fill_pool", None)
    if pool is None:
        pool = manager._batchjson_fill_pool = ThreadPoolExecutor(
            max_workers=max(1, min((os.cpu_count() or 2) // 2, 8)), thread_name_prefix="batchjson-bitmask")
    return pool, pool._max_workers


def install_parallel_bitmask(bonus_after_padding: bool, check: bool = False) -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    original = StructuredOutputManager.grammar_bitmask

    @functools.wraps(original)
    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        ids = structured_output_request_ids
        if (len(ids) < MIN_PARALLEL or self._grammar_bitmask is None or self.reasoner_cls is not None
                or not self.vllm_config.num_speculative_tokens
                or getattr(self.vllm_config.model_config, "is_diffusion", False)
                or type(self.backend).__name__ not in PARALLEL_BACKENDS):
            COUNTS.serial += 1
            return original(self, requests, ids, scheduled_spec_decode_tokens)
        plan, rows = [], 0
        for request_id in ids:
            tokens = scheduled_spec_decode_tokens.get(request_id, ())
            plan.append((requests[request_id].structured_output_request.grammar, request_id, tokens, rows))
            rows += len(tokens) + 1
        bitmask = self._grammar_bitmask
        if rows > bitmask.shape[0]:
            COUNTS.serial += 1
            return original(self, requests, ids, scheduled_spec_decode_tokens)
        pool, workers = _pool(self)
        *groups, last = _split(plan, workers + 1)  # this thread fills one group itself
        futures = [pool.submit(_fill_requests, self, g, bonus_after_padding) for g in groups]
        ok = _fill_requests(self, last, bonus_after_padding)
        ok = all([f.result() for f in futures]) and ok  # wait for every thread before deciding
        if not ok:  # vLLM's own loop rewrites every row, and logs or raises as it does
            COUNTS.fallback += 1
            return original(self, requests, ids, scheduled_spec_decode_tokens)
        COUNTS.parallel += 1
        out = (bitmask[:rows] if rows < bitmask.shape[0] else bitmask).numpy()
        if check:  # a test mode: vLLM's own function on the same state must give the same rows
            mine = out.copy()
            out = original(self, requests, ids, scheduled_spec_decode_tokens)
            COUNTS.checked += 1
            COUNTS.mismatches += not (out.shape == mine.shape and (out == mine).all())
        return out

    StructuredOutputManager.grammar_bitmask = grammar_bitmask


# ---------------------------------------------------------------- step profiling

class StepProfile:
    """Count and seconds per part of an engine step, written to a JSON file shared by vLLM's processes (one
    entry per process id, merged under a file lock), with what was patched (or skipped, and why) and any error."""

    def __init__(self, path: Path, sync: bool):
        self.path, self.sync = path, sync
        self.parts: dict[str, list[float]] = {}
        self.patches: dict[str, str] = {}
        self.errors: list[str] = []
        self.steps = 0
        self.lock = threading.Lock()
        self.last_dump = time.monotonic()
        self.started = time.time()

    def add(self, part: str, seconds: float) -> None:
        with self.lock:
            entry = self.parts.setdefault(part, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
        if time.monotonic() - self.last_dump > DUMP_EVERY_S:
            self.dump()

    def dump(self) -> None:
        self.last_dump = time.monotonic()
        with self.lock:
            mine = {"steps": self.steps, "cuda_synchronized": self.sync, "started": self.started,
                    "parts": {k: {"count": int(c), "seconds": s} for k, (c, s) in sorted(self.parts.items())},
                    "parallel_bitmask": COUNTS.to_dict(), "patches": dict(self.patches)}
            if self.errors:
                mine["error"] = "; ".join(self.errors)
        _write_entry(self.path, mine)


def _write_entry(path: Path, mine: dict) -> None:
    """Merge this process's entry into the shared file, under a file lock; a top-level "error" says that some
    process recorded one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data.setdefault("processes", {})[str(os.getpid())] = mine
        errors = [f"pid {pid}: {p['error']}" for pid, p in data["processes"].items() if p.get("error")]
        if errors:
            data["error"] = "; ".join(errors)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


def read_profile(path: Path) -> dict:
    """The profile file summed over vLLM's processes (the engine core schedules; a worker process, where there is
    one, runs the model): steps, count and seconds per part, the parallel bitmask's counts and state(s), and what
    each process patched or skipped ("patches") and any error it recorded ("errors")."""
    processes = list(json.loads(Path(path).read_text())["processes"].items())
    parts: dict[str, dict] = {}
    counts: dict[str, Any] = {}
    patches: dict[str, set] = {}
    errors = [f"pid {pid}: {p['error']}" for pid, p in processes if p.get("error")]
    for _, p in processes:
        for name, v in p.get("parts", {}).items():
            entry = parts.setdefault(name, {"count": 0, "seconds": 0.0})
            entry["count"] += v["count"]
            entry["seconds"] += v["seconds"]
        for k, v in p.get("parallel_bitmask", {}).items():
            counts[k] = counts.get(k, 0) + v if k != "state" else counts.get(k, set()) | {v}
        for k, v in p.get("patches", {}).items():
            patches.setdefault(k, set()).add(v)
    counts["state"] = " / ".join(sorted(counts.get("state", ())))
    return {"steps": sum(p.get("steps", 0) for _, p in processes), "processes": len(processes), "parts": parts,
            "parallel_bitmask": counts, "patches": {k: " / ".join(sorted(v)) for k, v in sorted(patches.items())},
            "errors": errors}


def _cuda_sync():
    """A wall-clock timer around a CUDA call measures the launch, not the work: when profiling, wait for the GPU
    before and after each model-runner part. That also removes the overlap of the CPU-side grammar bitmask with the
    forward pass, so compare profiled walls only with profiled walls (BATCHJSON_PROFILE_SYNC=0 keeps the overlap)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# What the profiler times, part by part: (module, class, method, part, wait for the GPU around it). Each is patched on
# its own: a module that does not import or a class or method that this vLLM lacks skips that entry (recorded in
# the profile file's "patches"), never the others. vLLM 0.26 on a GPU runs a dense model without speculation on the
# V2 model runner (vllm/v1/worker/gpu/, VllmConfig.use_v2_model_runner: default for non-MoE models) and with ngram,
# suffix or draft_model speculation on the V1 one (vllm/v1/worker/gpu_model_runner.py); 0.32 on CPU uses V1's
# subclass CPUModelRunner. Parts nest: sample_tokens holds sample, rejection_sampler and propose; V2's sample holds
# the logits, the grammar bitmask's application, and the (rejection) sampler.
V1 = "vllm.v1.worker.gpu_model_runner"
V2 = "vllm.v1.worker.gpu.model_runner"
TIMED = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule", False),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output", False),
    ("vllm.v1.structured_output", "StructuredOutputManager", "grammar_bitmask", "grammar_bitmask", False),
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
V2_SPECULATORS = ("vllm.v1.worker.gpu.spec_decode.autoregressive.speculator",
                  "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
                  "vllm.v1.worker.gpu.spec_decode.eagle.speculator")


def _cuda_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def _timed(fn, part: str, profile: StepProfile, gpu: bool):
    sync = _cuda_sync if gpu and profile.sync else None

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if sync:
            sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if sync:
                sync()
            profile.add(part, time.perf_counter() - start)

    timed._batchjson_timed = True
    return timed


def _subclasses(cls) -> list:
    out = []
    for sub in cls.__subclasses__():
        out += [sub] + _subclasses(sub)
    return out


def _patch(module: str, cls_name: str, name: str, part: str, gpu: bool, profile: StepProfile) -> str:
    """Time one method; returns what happened ("ok", "skipped: ...")."""
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
            fn = _counting(fn, profile)
        setattr(c, name, _timed(fn, part, profile, gpu))
        patched.append(c.__name__)
    if not patched:
        return f"skipped: {cls_name}.{name} not found"
    return "ok" if patched == [cls_name] else "ok: " + ", ".join(patched)


def _counting(schedule, profile: StepProfile):
    """The scheduler's schedule, counting the steps that schedule any token."""

    @functools.wraps(schedule)
    def counted(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        if out.total_num_scheduled_tokens > 0:
            profile.steps += 1
        return out

    return counted


def install_profiler(path: Path, sync: bool) -> StepProfile:
    """Time, in this process: the scheduler's schedule and update_from_output, the grammar bitmask, the model
    runner's forward (execute_model) and sampling (sample_tokens, which holds the rejection sampler and the drafter's
    propose), the rejection sampler, the drafter (ngram, suffix, draft model, eagle), and the whole engine step
    (see TIMED), on whichever model runner(s) this vLLM has. A part that cannot be patched is skipped and recorded;
    an error in one is recorded (the file's "error") and logged, and never stops the engine."""
    profile = StepProfile(path, sync)
    for module, cls_name, name, part, gpu in TIMED:
        key = f"{module.removeprefix('vllm.')}.{cls_name}.{name}"
        try:
            profile.patches[key] = _patch(module, cls_name, name, part, gpu, profile)
        except Exception as e:  # noqa: BLE001
            profile.patches[key] = f"error: {type(e).__name__}: {e}"
            profile.errors.append(f"patching {key}: {type(e).__name__}: {e}")
    try:
        from vllm.v1.engine.core import EngineCore

        shutdown = EngineCore.shutdown

        @functools.wraps(shutdown)
        def dump_then_shutdown(self, *args, **kwargs):
            try:
                profile.dump()
            except Exception:  # noqa: BLE001 - never stop a shutdown over a profile
                pass
            return shutdown(self, *args, **kwargs)

        EngineCore.shutdown = dump_then_shutdown
    except Exception as e:  # noqa: BLE001
        profile.errors.append(f"patching EngineCore.shutdown: {type(e).__name__}: {e}")
    for error in profile.errors:
        _warn(f"step profiler: {error}")
    atexit.register(profile.dump)
    profile.dump()  # the file exists (with the bitmask state and the patches) as soon as the engine does
    return profile


def _warn(message: str) -> None:
    import logging

    logging.getLogger("vllm.batchjson").warning("batchjson: %s", message)  # vLLM's handler prints it


INSTALLED = False  # in this process's memory (a process forked from one that installed inherits the patches)


def install() -> None:
    """Called by the plugin in each vLLM process of a batchjson run (not in the runner itself). Never raises: a
    failure is logged and, when profiling, recorded in the profile file as {"error": ...}."""
    global COUNTS, INSTALLED
    if INSTALLED:
        return
    INSTALLED = True
    profile = os.environ.get(ENV_PROFILE)
    try:
        mode = os.environ.get(ENV_PARALLEL, "0")  # 0, 1, or "check": compare each step with vLLM's own bitmask
        if mode in ("1", "check"):
            try:
                why = unsupported()
                if why is None:
                    import vllm

                    install_parallel_bitmask(KNOWN[".".join(vllm.__version__.split(".")[:2])]["bonus_after_padding"],
                                             check=mode == "check")
                    COUNTS = BitmaskCounts("on")
                else:
                    COUNTS = BitmaskCounts(f"unsupported: {why}")
            except Exception as e:  # noqa: BLE001
                COUNTS = BitmaskCounts(f"error: {type(e).__name__}: {e}")
                _warn(f"parallel grammar bitmask not installed: {type(e).__name__}: {e}")
        if profile:
            install_profiler(Path(profile), os.environ.get(ENV_PROFILE_SYNC, "1") != "0")
    except Exception as e:  # noqa: BLE001
        import traceback

        error = f"install failed: {type(e).__name__}: {e}"
        _warn(error + "\n" + traceback.format_exc())
        if profile:
            try:
                _write_entry(Path(profile), {"steps": 0, "parts": {}, "parallel_bitmask": COUNTS.to_dict(),
                                              "error": error})
            except Exception:  # noqa: BLE001
                pass

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
    entry per process id, merged under a file lock)."""

    def __init__(self, path: Path, sync: bool):
        self.path, self.sync = path, sync
        self.parts: dict[str, list[float]] = {}
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
                    "parallel_bitmask": COUNTS.to_dict()}
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = {}
            data.setdefault("processes", {})[str(os.getpid())] = mine
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.path)


def read_profile(path: Path) -> dict:
    """The profile file summed over vLLM's processes (the engine core schedules; a worker process, where there is
    one, runs the model): steps, count and seconds per part, and the parallel bitmask's counts and state(s)."""
    processes = json.loads(Path(path).read_text())["processes"].values()
    parts: dict[str, dict] = {}
    counts: dict[str, Any] = {}
    for p in processes:
        for name, v in p["parts"].items():
            entry = parts.setdefault(name, {"count": 0, "seconds": 0.0})
            entry["count"] += v["count"]
            entry["seconds"] += v["seconds"]
        for k, v in p["parallel_bitmask"].items():
            counts[k] = counts.get(k, 0) + v if k != "state" else counts.get(k, set()) | {v}
    counts["state"] = " / ".join(sorted(counts.get("state", ())))
    return {"steps": sum(p["steps"] for p in processes), "processes": len(processes), "parts": parts,
            "parallel_bitmask": counts}


def _cuda_sync():
    """A wall-clock timer around a CUDA call measures the launch, not the work: when profiling, wait for the GPU
    before and after each model-runner part. That also removes the overlap of the CPU-side grammar bitmask with the
    forward pass, so compare profiled walls only with profiled walls (BATCHJSON_PROFILE_SYNC=0 keeps the overlap)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(cls, name: str, part: str, profile: StepProfile, gpu: bool = False) -> None:
    fn = cls.__dict__.get(name)
    if fn is None:
        return
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

    setattr(cls, name, timed)


def install_profiler(path: Path, sync: bool) -> StepProfile:
    """Time, in this process: the scheduler's schedule and update_from_output, the grammar bitmask, the model
    runner's forward (execute_model) and sampling (sample_tokens, which holds the rejection sampler and the drafter's
    propose), the rejection sampler, the drafter (ngram, suffix, draft model, eagle: propose_draft_token_ids), and
    the whole engine step. Parts nest: sample_tokens includes rejection_sampler and propose."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    profile = StepProfile(path, sync)
    schedule = Scheduler.schedule

    @functools.wraps(schedule)
    def counted(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        if out.total_num_scheduled_tokens > 0:
            profile.steps += 1
        return out

    Scheduler.schedule = counted
    for cls, name, part, gpu in ((Scheduler, "schedule", "schedule", False),
                                 (Scheduler, "update_from_output", "update_from_output", False),
                                 (StructuredOutputManager, "grammar_bitmask", "grammar_bitmask", False),
                                 (GPUModelRunner, "execute_model", "forward", True),
                                 (GPUModelRunner, "sample_tokens", "sample_tokens", True),
                                 (GPUModelRunner, "propose_draft_token_ids", "propose", True),
                                 (RejectionSampler, "forward", "rejection_sampler", True),
                                 (EngineCore, "step", "engine_step", False),
                                 (EngineCore, "step_with_batch_queue", "engine_step", False)):
        _time(cls, name, part, profile, gpu)
    shutdown = EngineCore.shutdown

    @functools.wraps(shutdown)
    def dump_then_shutdown(self, *args, **kwargs):
        profile.dump()
        return shutdown(self, *args, **kwargs)

    EngineCore.shutdown = dump_then_shutdown
    atexit.register(profile.dump)
    profile.dump()  # the file exists (with the bitmask state) as soon as the engine does
    return profile


def install() -> None:
    """Called by the plugin in each vLLM process of a batchjson run (not in the runner itself)."""
    global COUNTS
    mode = os.environ.get(ENV_PARALLEL, "0")  # 0, 1, or "check": compare each step with vLLM's own bitmask
    if mode in ("1", "check"):
        why = unsupported()
        if why is None:
            import vllm

            install_parallel_bitmask(KNOWN[".".join(vllm.__version__.split(".")[:2])]["bonus_after_padding"],
                                     check=mode == "check")
            COUNTS = BitmaskCounts("on")
        else:
            COUNTS = BitmaskCounts(f"unsupported: {why}")
    if os.environ.get(ENV_PROFILE):
        install_profiler(Path(os.environ[ENV_PROFILE]), os.environ.get(ENV_PROFILE_SYNC, "1") != "0")

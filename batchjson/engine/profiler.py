"""The step profiler, run inside vLLM's processes: time each part of an engine step and write it to a JSON file.

`BATCHJSON_PROFILE_STEPS=<file>` times each part of an engine step (count and seconds per part) and writes them, per
process, to the JSON file every few seconds and at shutdown; read it with `read_profile`.
`BATCHJSON_PROFILE_SYNC=0` leaves out the GPU waits around the model runner's parts (see _cuda_sync). Installed by
the plugin (plugin.py); like internals.py it patches vLLM's internals, but only when asked for, and a part this vLLM
lacks is skipped, never an error.

Over 250 lines because it is one piece: the table of what is timed (TIMED), the timers it patches in, and the file
they write and its reader change together (a new part is a row of TIMED and a key of the file).
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import threading
import time
from pathlib import Path

ENV_PROFILE = "BATCHJSON_PROFILE_STEPS"
ENV_PROFILE_SYNC = "BATCHJSON_PROFILE_SYNC"
DUMP_EVERY_S = 2.0


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
                    "patches": dict(self.patches)}
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
    one, runs the model): steps, count and seconds per part, and what each process patched or skipped ("patches")
    and any error it recorded ("errors")."""
    processes = list(json.loads(Path(path).read_text())["processes"].items())
    parts: dict[str, dict] = {}
    patches: dict[str, set] = {}
    errors = [f"pid {pid}: {p['error']}" for pid, p in processes if p.get("error")]
    for _, p in processes:
        for name, v in p.get("parts", {}).items():
            entry = parts.setdefault(name, {"count": 0, "seconds": 0.0})
            entry["count"] += v["count"]
            entry["seconds"] += v["seconds"]
        for k, v in p.get("patches", {}).items():
            patches.setdefault(k, set()).add(v)
    return {"steps": sum(p.get("steps", 0) for _, p in processes), "processes": len(processes), "parts": parts,
            "patches": {k: " / ".join(sorted(v)) for k, v in sorted(patches.items())},
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
    profile.dump()  # the file exists (with the patches) as soon as the engine does
    return profile


def _warn(message: str) -> None:
    import logging

    logging.getLogger("vllm.batchjson").warning("batchjson: %s", message)  # vLLM's handler prints it


INSTALLED = False  # in this process's memory (a process forked from one that installed inherits the patches)


def install() -> None:
    """Called by the plugin in each vLLM process of a batchjson run (not in the runner itself): the step profiler
    when asked for (BATCHJSON_PROFILE_STEPS). Never raises: a failure is logged and recorded in the profile file as
    {"error": ...}."""
    global INSTALLED
    profile = os.environ.get(ENV_PROFILE)
    if INSTALLED or not profile:
        return
    INSTALLED = True
    try:
        install_profiler(Path(profile), os.environ.get(ENV_PROFILE_SYNC, "1") != "0")
    except Exception as e:  # noqa: BLE001
        import traceback

        error = f"install failed: {type(e).__name__}: {e}"
        _warn(error + "\n" + traceback.format_exc())
        try:
            _write_entry(Path(profile), {"steps": 0, "parts": {}, "error": error})
        except Exception:  # noqa: BLE001
            pass

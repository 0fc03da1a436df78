"""The KV cache's size, reported. vLLM sizes an engine's KV cache by measuring the GPU's memory, which is why replicas
sharing a GPU start one at a time (executors/base.py, Turns). `install_kv_size_report` makes the engine core write
the bytes it gave the cache to the file KV_SIZE_ENV names; engine/kv_sizes.py keeps them, and the next start of the
same settings passes them as kv_cache_memory_bytes, measures nothing and starts beside the other replicas. Where it
is off nothing is written, and every start measures, as before.
"""

from __future__ import annotations

import functools
import os

from batchjson.engine.vllm.versions import installs_once, unread_here

# Read on (kv_size_report, 0.26, 0.32 and 0.34): vllm/v1/engine/core.py and vllm/v1/worker/gpu_worker.py.
# EngineCore.__init__ loads the general plugins, then builds the executor (the workers' init_device takes the memory
# snapshot) and calls self._initialize_kv_caches(vllm_config), which sets self.available_gpu_memory_for_kv_cache to the
# bytes the first worker's determine_available_memory found for the KV cache (by profiling, or kv_cache_memory_bytes as
# given: then it skips the profiling's memory measurement), allocates the cache and captures the CUDA graphs. 0.34: the
# same.
KV_SIZE_ENV = "BATCHJSON_KV_SIZE_FILE"  # where the engine core writes its KV cache's bytes (set by VllmEngine)


@installs_once
def install_kv_size_report() -> str:
    """Make EngineCore write the bytes its KV cache was given to the file KV_SIZE_ENV names, once the cache is
    allocated (engine/kv_sizes.py keeps them for the next start of the same settings); "ok" or why not. Reads
    vLLM's number, changes nothing of its start."""
    if why := unread_here("kv_size_report"):
        return why
    from vllm.v1.engine.core import EngineCore

    own = EngineCore._initialize_kv_caches

    @functools.wraps(own)
    def initialize_kv_caches(self, *args, **kwargs):
        config = own(self, *args, **kwargs)
        path, size = os.environ.get(KV_SIZE_ENV), getattr(self, "available_gpu_memory_for_kv_cache", -1)
        if path and isinstance(size, int) and size > 0:
            with open(path, "w") as f:
                f.write(str(size))
        return config

    EngineCore._initialize_kv_caches = initialize_kv_caches
    return "ok"

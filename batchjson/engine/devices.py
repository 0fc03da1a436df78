"""The GPUs a run can see, asked without initialising CUDA: which ones, their memory, what holds it, the host's cores.
How replicas are laid over them is executors/placement.py's.
"""

from __future__ import annotations

import os
import socket
import subprocess

# vLLM's default gpu_memory_utilization (CacheConfig): the share of a GPU's memory one engine takes when the spec does
# not say. The replicas sharing a GPU divide it.
VLLM_GPU_MEMORY_UTILIZATION = 0.9


def visible_gpus() -> list[str]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi), without initialising CUDA here."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def _smi(query: str) -> list[list[str]]:
    """nvidia-smi's answer to `--query-QUERY` (e.g. "gpu=memory.total"): a row of fields per GPU or process; raises
    OSError or SubprocessError where nvidia-smi does not answer."""
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_memory() -> int | None:
    """Bytes of memory of this host's smallest GPU (nvidia-smi), or None where nvidia-smi does not say."""
    try:
        sizes = [int(float(total)) << 20 for total, in _smi("gpu=memory.total")]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) if sizes else None


def visible_models() -> list[str]:
    """Each visible GPU's model and memory ("NVIDIA H200 143771 MiB"), as nvidia-smi names them; empty where it
    does not answer."""
    try:
        seen = set(visible_gpus())  # indices or UUIDs
        return [f"{name} {total} MiB" for index, uuid, name, total in _smi("gpu=index,uuid,name,memory.total")
                if index in seen or uuid in seen]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def memory_taken(utilization: float) -> str:
    """Why an engine that wants `utilization` of its GPU's memory could not start, where nvidia-smi shows it: each
    visible GPU with less free than that, and the processes holding its memory. vLLM's own check says only that the
    engine core failed (its cause is in the engine's log); a process left from an earlier run (an engine core whose
    runner was killed) keeps its memory until it is stopped. Empty where nvidia-smi does not answer or memory was not
    short."""
    try:
        gpus = _smi("gpu=index,uuid,memory.used,memory.total")
        apps = _smi("compute-apps=gpu_uuid,pid,process_name,used_memory")
        seen = set(visible_gpus())  # indices or UUIDs
        short = []
        for index, uuid, used, total in gpus:
            free_mib, total_mib = float(total) - float(used), float(total)
            if (index in seen or uuid in seen) and free_mib < utilization * total_mib:
                holders = ", ".join(f"pid {pid} ({name}, {float(mib) / 1024:.1f} GiB)"
                                    for gpu, pid, name, mib in apps if gpu == uuid)
                short.append(f"GPU {index} has {free_mib / 1024:.1f} of {total_mib / 1024:.1f} GiB free, "
                             f"{utilization:g} wanted; held by {holders or 'processes nvidia-smi does not list'}")
    except (OSError, subprocess.SubprocessError, ValueError):
        return ""
    if not short:
        return ""
    return ("; ".join(short) + ". Stop what holds it if it is not this run's (`nvidia-smi` lists it; an engine left "
            "from a killed run holds its memory until stopped), or lower model.engine.gpu_memory_utilization.")


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def gpus_here() -> str | None:
    """Which GPUs an engine started here would use, as a key the driver compares between replicas (host and
    CUDA_VISIBLE_DEVICES); None without a GPU."""
    gpus = visible_gpus()
    return f"{socket.gethostname()}:{','.join(gpus)}" if gpus else None

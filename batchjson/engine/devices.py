"""The GPUs a run can see, and how many each engine replica takes: the arithmetic every executor shares."""

from __future__ import annotations

import os
import subprocess

from batchjson.errors import SpecError


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


def gpus_per_replica(engine: dict) -> int:
    return int(engine.get("tensor_parallel_size", 1)) * int(engine.get("pipeline_parallel_size", 1))


def replica_count(gpus: int, per: int, requested: int | None, where: str, hint: str) -> int:
    """How many replicas of `per` GPUs to run on `gpus` GPUs: as many as fit, or as many as asked for if they fit."""
    fit = gpus // per
    n = requested or fit
    if fit == 0 or n > fit:
        raise SpecError(f"{where} has {gpus} GPU(s): room for {fit} replica(s) of {per} GPU(s), not {n}. {hint}")
    return n

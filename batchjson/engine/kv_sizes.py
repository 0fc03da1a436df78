"""The KV cache's size of each engine configuration, as vLLM measured it on this kind of GPU, kept for the next start.

vLLM sizes an engine's KV cache by profiling the GPU's memory, which charges every change to the engine measuring,
another process's included: so replicas that share a GPU start one at a time (executors/base.py, Turns), and the
second engine of a 1.5B model waits ~39 s for the first's whole start. Once vLLM has measured a configuration, its
answer (the bytes the engine core gave its KV cache) is kept here; a later start of the same configuration passes it
as `kv_cache_memory_bytes`, vLLM then skips the measurement, and such starts go side by side (never beside one that
measures). It is vLLM's own number for the same settings, vLLM version and GPU model, not a guess: a nightly job's
replicas start together from its second night on.

Kept in `$BATCHJSON_CACHE/kv-sizes.json` (default `~/.cache/batchjson/`), one entry per configuration: a digest of the
vLLM version, the GPU's name and memory, every keyword argument of the engine, and its model's (and draft's)
config.json and weights' bytes (a model replaced in place at the same path is another configuration). A start that
fails with a kept size forgets it (`forget`), and the next measures again. A job that sets `[model.engine] kv_cache_memory_bytes` itself
measures nothing and needs none of this. Only on a GPU: a CPU engine's cache has the size VLLM_CPU_KVCACHE_SPACE says.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from batchjson.engine import devices
from batchjson.engine.models import cache_home, weight_bytes

GIVEN = "kv_cache_memory_bytes"  # vLLM's keyword: the KV cache's bytes, given rather than measured


def path() -> Path:
    return cache_home() / "kv-sizes.json"


def sized(kwargs: dict[str, Any], cpu: bool) -> tuple[str | None, int | None]:
    """An engine's configuration key (`key`), where a size can be kept for it, and the bytes kept for it: neither
    on a CPU, nor where its arguments give the size already."""
    if cpu or GIVEN in kwargs:
        return None, None
    config = key(kwargs)
    return config, kept(config)


def key(kwargs: dict[str, Any]) -> str | None:
    """The configuration's key: vLLM's version, the visible GPUs' models and memory, the engine's keyword arguments
    and its models' identity; None where nvidia-smi does not name the GPUs (no size is kept or used then)."""
    import vllm

    gpus = devices.visible_models()
    if not gpus:
        return None
    models = [kwargs.get("model"), (kwargs.get("speculative_config") or {}).get("model")]
    config = {"vllm": vllm.__version__, "gpus": gpus, "engine": {k: v for k, v in kwargs.items() if k != GIVEN},
              "models": [_identity(m) for m in models if isinstance(m, str)]}
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _identity(model: str) -> list:
    """What of a model folder sizes its engine's memory: its config.json and its weights' bytes (a folder whose
    model was replaced in place is another configuration)."""
    folder = Path(model)
    try:
        config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        config = None
    return [model, config, weight_bytes(model) if folder.is_dir() else None]


def _read() -> dict[str, int]:
    try:
        kept = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in kept.items() if isinstance(v, int) and v > 0} if isinstance(kept, dict) else {}


def _write(kept: dict[str, int]) -> None:
    """Replace the file whole (a replica reading it meanwhile sees the old one or the new one, never half)."""
    folder = path().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".kv-sizes-", delete=False) as f:
            json.dump(kept, f, sort_keys=True)
        os.replace(f.name, path())
    except OSError:  # a read-only home: the next start measures again, as without this file
        pass


def kept(config: str | None) -> int | None:
    """The bytes kept for configuration `config` (a `key`), if any."""
    return _read().get(config) if config else None


def keep(config: str | None, size: int) -> None:
    kept_now = _read()
    if config and size > 0 and kept_now.get(config) != size:
        _write(kept_now | {config: size})


def forget(config: str | None) -> None:
    kept_now = _read()
    if config in kept_now:
        del kept_now[config]
        _write(kept_now)

"""The engine package's face: the Engine contract and the engine names the rest of batchjson imports (no vLLM)."""

import importlib

# Imported on first use: vLLM's engine processes import this package for its plugin (plugin.py) and need none of
# these modules (nor the spec and grammar modules they import).
_NAMES = {"Engine": "base", "EngineFacts": "base", "EngineFactory": "base", "EngineWrapper": "base",
          "WrappedEngines": "base", "VllmEngine": "vllm_engine", "VllmEngines": "vllm_engine", "cpu_dtype": "vllm_engine",
          "check_draft": "models", "convert_gguf": "models", "resolve_model": "models",
          "weight_bytes": "models"}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"batchjson.engine.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'batchjson.engine' has no attribute {name!r}")

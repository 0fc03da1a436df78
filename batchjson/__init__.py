"""batchjson: Parquet rows to schema-validated JSON with vLLM, in two passes, losing no row.

The Python API (batchjson/api.py), next to the command line::

    import batchjson

    job = batchjson.load_job("jobs/invoices.toml")       # or batchjson.build_job(input={...}, prompt={...}, ...)
    batchjson.check_job(job)                              # no engine: input, output folder, schema, grammar
    report = batchjson.run_job(job, "out/2026-11-30")     # the report `batchjson run` writes
    batchjson.verify_job(job, "out/2026-11-30").complete  # each input row once in output or rejects
    batchjson.status_job(job, "out/2026-11-30").summary() # from any machine, while it runs or after
"""

import importlib
import importlib.util
import sys
import types

__version__ = "0.1.0"

# Imported on first use: vLLM's engine processes import this package (for batchjson's vLLM plugin) and need none of
# the API's modules.
_API = {"load_job": "api", "build_job": "api", "run_job": "api", "check_job": "api", "verify_job": "api",
        "status_job": "api", "cancel_job": "api", "Status": "status", "CheckResult": "api", "JobSpec": "spec", "RunReport": "report", "Verdict": "verify",
        "BatchjsonError": "errors"}
__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f"batchjson.{_API[name]}"), name)
    raise AttributeError(f"module 'batchjson' has no attribute {name!r}")


def _defer_iri_parser() -> None:
    """Import rfc3987_syntax on the first `iri` format check instead of at `import jsonschema`.

    jsonschema's format extras import it to check `iri`/`iri-reference`, and it builds an Earley parser when
    imported: 0.85 s of the 1.3 s `batchjson check` took, for a format few schemas use. jsonschema binds
    `is_valid_syntax` at import, so a stand-in module gives it a function that loads the real one when called."""
    if "rfc3987_syntax" in sys.modules or importlib.util.find_spec("rfc3987_syntax") is None:
        return
    stand_in = types.ModuleType("rfc3987_syntax")

    def real():
        if sys.modules.get("rfc3987_syntax") is stand_in:
            del sys.modules["rfc3987_syntax"]
        return importlib.import_module("rfc3987_syntax")

    stand_in.is_valid_syntax = lambda term, value: real().is_valid_syntax(term, value)

    def attribute(name: str):
        if name.startswith("__"):  # the import system probing the module (__path__...), not a use of it
            raise AttributeError(name)
        return getattr(real(), name)

    stand_in.__getattr__ = attribute
    sys.modules["rfc3987_syntax"] = stand_in


_defer_iri_parser()

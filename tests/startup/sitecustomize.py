"""Run at the start of every Python process of the suite (helpers.py puts this folder on PYTHONPATH), vLLM's engine
processes included: it imports batchjson, whose package defers rfc3987_syntax's parser (batchjson/__init__.py).

A `batchjson` command's engine processes get that from its main module; those the suite starts in its own process
(pytest's main module) would otherwise build the parser as they import vLLM, which imports Ray, which imports
jsonschema: ~2 s of CPU in each engine start, for nothing any test checks there."""

try:
    import batchjson  # noqa: F401
except ImportError:  # another interpreter than the suite's
    pass

"""batchjson: Parquet rows to schema-validated JSON with vLLM, in two passes, losing no row."""

__version__ = "0.1.0"

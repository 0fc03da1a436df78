"""batchjson's benchmarks, one package behind one command: `python -m bench <subcommand>` (bench/__main__.py)."""

"""`python -m batchjson` is the `batchjson` command."""

from batchjson.cli import entry

if __name__ == "__main__":  # vLLM starts its engine with spawn, which re-imports this module
    entry()

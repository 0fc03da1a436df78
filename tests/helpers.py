"""What the tests share besides fixtures: the session's scratch folder and environment, the tiny schema and model
sources, job and Parquet writers, and the exactly-once assertion. Test modules import from here (conftest.py holds
the fixtures), never from one another."""

from __future__ import annotations

import collections
import importlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

HERE = Path(__file__).parent  # tests/

# Keep vLLM's caches, its ZMQ sockets and the converted default model out of the home folder.
# Per clone (a digest of its path), so that two clones' suites on one machine never share a model or a socket.
_CLONE = hashlib.sha256(str(HERE.parent.resolve()).encode()).hexdigest()[:10]
SCRATCH = Path(os.environ.get("BATCHJSON_TEST_SCRATCH") or Path(tempfile.gettempdir()) / f"batchjson-tests-{_CLONE}")
# The suite's workers and the commands it starts inherit this process's TMPDIR (set below): they take its folder.
os.environ["BATCHJSON_TEST_SCRATCH"] = str(SCRATCH)
SCRATCH.mkdir(parents=True, exist_ok=True)
for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("HF_HOME", "hf"),
                 ("TMPDIR", "tmp"), ("BATCHJSON_CACHE", "models")):
    os.environ.setdefault(var, str(SCRATCH / sub))
    Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
tempfile.tempdir = None
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "startup"), os.environ.get("PYTHONPATH")]))

# A child process gets the session's environment as it was here, not os.environ as it stands when the child starts:
# an engine started in this process leaves variables there that are its own (BATCHJSON_RUNNER_PID names this
# process as the runner whose engine processes die with it; vLLM sets LD_PRELOAD, VLLM_WORKER_MULTIPROC_METHOD...).
ENV = dict(os.environ) | {"PYTHONPATH": f"{HERE.parent}:{HERE}:{HERE / 'startup'}"}


# Strings are bounded: a random model otherwise writes until max_tokens.
TINY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


# Prompts whose answer's JSON (TINY_SCHEMA's) is in the prompt, so that n-gram lookup finds drafts even for a random
# model; the tests that decode them on the real engine compare their answers across engines.
ANSWER_PROMPTS = [f'<|im_start|>user\nAnswer like {{"name":"thing{i % 7}","n":{i % 10}}}: item {i}<|im_end|>\n'
                  "<|im_start|>assistant\n" for i in range(24)]


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


def tiny_engine_model(tiny_model: str, max_in_flight: int = 16, **settings):
    """The ModelSpec of the tests that start a VllmEngine on the tiny model themselves."""
    from batchjson.spec import ModelSpec

    return ModelSpec(path=tiny_model, dtype="float32", max_model_len=512, max_in_flight=max_in_flight, **settings)


def write_model(folder: Path, source: str = THING_MODEL) -> str:
    """A model module in `folder` under a name of its own (Python imports a module name once per process); returns
    its `schema.pydantic` reference, 'module:Thing'."""
    name = f"things_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(source)
    return f"{name}:Thing"


def import_model(folder: Path, ref: str) -> type:
    """The class `ref` names, imported as the spec loader imports it (from `folder`)."""
    sys.path.insert(0, str(folder))
    try:
        return getattr(importlib.import_module(ref.split(":")[0]), ref.split(":")[1])
    finally:
        sys.path.remove(str(folder))


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


def codes(noted) -> list[str]:
    """The note codes (report.NoteCode) of a pass's stats or of a run report: the object or its to_dict()."""
    return [e["code"] for e in (noted["events"] if isinstance(noted, dict) else noted.events)]


def ids_of(folder: Path) -> list[str]:
    """The ids of the rows in the Parquet files directly in `folder` (what a dataset reader of it reads)."""
    files = sorted(str(p) for p in folder.glob("*.parquet"))
    return ds.dataset(files, format="parquet").to_table(columns=["id"]).column("id").to_pylist() if files else []


def assert_exactly_once(input_ids, out: Path, rejects: Path) -> None:
    """Every input id is in the output or the rejects, once."""
    got = ids_of(out) + ids_of(rejects)
    dupes = [k for k, v in collections.Counter(got).items() if v > 1]
    assert not dupes, f"rows written twice: {dupes[:5]}"
    assert sorted(got) == sorted(input_ids)


def at_commit_step(step: str, n: int, action, patch=setattr) -> None:
    """Call `action()` the n-th time a unit's commit reaches `step`, in every output folder opened from now on
    (storage/commits.py's steps: begin, staged <kind>, committed, published <kind>; "p2:<step>" counts pass 2
    only; n = 0 never). `patch`: pytest's `monkeypatch.setattr`, so that the test undoes it."""
    from batchjson.storage import Commits

    seen, real_init = [], Commits.__init__

    def after(name, stage):
        if step in (name, f"{stage}:{name}"):
            seen.append(name)
            if len(seen) == n:
                action()

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.after = after

    patch(Commits, "__init__", init)


def record_reads(monkeypatch) -> list[str]:
    """The names of the commit records' files (p1-/p2-*.json) read from now on through Location.read_bytes (on
    object storage, two requests each), as a list that grows as they are read."""
    from batchjson.storage.location import Location

    read, read_bytes = [], Location.read_bytes

    def counted(self):
        if self.name.startswith(("p1-", "p2-")) and self.name.endswith(".json"):
            read.append(self.name)
        return read_bytes(self)

    monkeypatch.setattr(Location, "read_bytes", counted)
    return read


def gone_within(processes: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """The processes still alive (not zombies) after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for p in processes:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def wait_for_engine_process(proc: subprocess.Popen, timeout: float = 300) -> psutil.Process:
    """Until the run in `proc` has spawned its engine process (vLLM's engine core, on CPU); the run's process."""
    runner, give_up = psutil.Process(proc.pid), time.monotonic() + timeout

    def spawned(p: psutil.Process) -> bool:
        try:
            return "spawn_main" in " ".join(p.cmdline())
        except psutil.Error:  # gone, or a zombie
            return False

    while not any(spawned(p) for p in runner.children()):
        assert proc.poll() is None and time.monotonic() < give_up, "the run started no engine process"
        time.sleep(0.05)
    return runner


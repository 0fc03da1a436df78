"""The parallel grammar bitmask (vllm_patches.py, installed by the plugin in the engine process): the same outputs
as vLLM's own code, applied only when the spec asks for it, refused on a vLLM it does not know; and step profiling."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from batchjson.records import Prompt
from batchjson.vllm_patches import read_profile
from batchjson.spec import DecodingSpec, ModelSpec, SpeculativeSpec, load_spec
from conftest import TINY_SCHEMA, write_job, write_rows

# The answer's JSON is in the prompt, so that n-gram lookup finds drafts even for a random model.
PROMPTS = [f'<|im_start|>user\nAnswer like {{"name":"thing{i % 7}","n":{i % 10}}}: item {i}<|im_end|>\n'
           "<|im_start|>assistant\n" for i in range(24)]


def _run(tiny_model, monkeypatch, tmp_path, parallel: bool, mode: str = "1"):
    """Greedy outputs of PROMPTS under ngram speculation and TINY_SCHEMA, and the engine process's profile."""
    from batchjson.engine import VllmEngine

    profile = tmp_path / f"profile-{parallel}.json"
    monkeypatch.setenv("BATCHJSON_PROFILE_STEPS", str(profile))
    monkeypatch.setenv("BATCHJSON_PARALLEL_BITMASK", mode)
    model = ModelSpec(path=tiny_model, dtype="float32", max_model_len=512, max_in_flight=16,
                      parallel_grammar=parallel)
    engine = VllmEngine(model, DecodingSpec(max_tokens=40), TINY_SCHEMA,
                        SpeculativeSpec(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1))
    try:
        gens = {g.prompt.row_id: (g.text, g.output_tokens) for g in
                engine.stream(Prompt(str(i), "u", text) for i, text in enumerate(PROMPTS))}
        drafts = engine.stats()["draft_tokens"]
    finally:
        engine.close()
    return gens, drafts, read_profile(profile)


@pytest.mark.engine
def test_parallel_bitmask_same_outputs_and_applied_only_when_on(tiny_model, monkeypatch, tmp_path):
    on, on_drafts, on_profile = _run(tiny_model, monkeypatch, tmp_path, True, mode="check")
    off, off_drafts, off_profile = _run(tiny_model, monkeypatch, tmp_path, False)
    assert on == off and len(on) == len(PROMPTS)
    assert on_drafts > 0 and on_drafts == off_drafts  # speculation ran, and drafted the same tokens
    patch = on_profile["parallel_bitmask"]
    assert patch["state"] == "on" and patch["parallel_steps"] > 0
    # Every parallel step was compared with vLLM's own bitmask on the same grammar state: all rows equal.
    assert patch["checked_steps"] == patch["parallel_steps"] and patch["mismatched_steps"] == 0
    assert off_profile["parallel_bitmask"] == {"state": "off", "parallel_steps": 0, "serial_steps": 0,
                                               "fallback_steps": 0, "checked_steps": 0, "mismatched_steps": 0}
    parts = off_profile["parts"]
    assert off_profile["steps"] > 0
    for part in ("schedule", "grammar_bitmask", "forward", "sample_tokens", "rejection_sampler", "propose",
                 "update_from_output", "engine_step"):
        assert parts[part]["count"] > 0 and parts[part]["seconds"] > 0, part


def test_unknown_vllm_leaves_vllm_alone_and_warns(monkeypatch):
    import vllm

    from batchjson import vllm_patches
    from batchjson.engine import VllmEngine

    assert vllm_patches.unsupported() is None  # the installed vLLM is one it knows
    monkeypatch.setattr(vllm, "__version__", "0.30.1")
    assert vllm_patches.unsupported() == "vLLM 0.30.1 is not a version it was written for (0.26.x, 0.32.x)"
    monkeypatch.setenv("BATCHJSON_PARALLEL_BITMASK", "1")
    with pytest.warns(UserWarning, match=r"model.parallel_grammar: vLLM 0.30.1 .* parallel_grammar = false"):
        VllmEngine._parallel_grammar(True)
    assert os.environ["BATCHJSON_PARALLEL_BITMASK"] == "0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VllmEngine._parallel_grammar(False)  # turned off: no warning


def test_parallel_grammar_key(tmp_path):
    job = write_job(tmp_path, "unused", write_rows(tmp_path / "in.parquet", 2))
    spec = load_spec(job)
    assert spec.model.parallel_grammar is False  # measured no faster (BENCHMARKS.md): opt in
    job.write_text(job.read_text().replace("max_in_flight = 16", "max_in_flight = 16\nparallel_grammar = true"))
    on = load_spec(job)
    assert on.model.parallel_grammar is True
    assert on.hash() == spec.hash()  # the same outputs: switching it does not block a resume
    job.write_text(job.read_text().replace("parallel_grammar = true", 'parallel_grammar = "no"'))
    from batchjson.errors import SpecError

    with pytest.raises(SpecError, match=r"model.parallel_grammar must be bool, got str 'no'"):
        load_spec(job)


def test_plugin_runs_again_in_a_forked_engine_process(monkeypatch):
    """On CUDA vLLM forks its engine process from the runner, whose vllm.plugins.plugins_loaded is already True:
    the runner's at-fork hook clears it in the child, so vLLM loads the plugin there."""
    import vllm.plugins

    from batchjson import vllm_plugin

    monkeypatch.setenv("BATCHJSON_RUNNER_PID", str(os.getpid()))
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", True)
    vllm_plugin.register()  # the runner: nothing but the hook
    assert vllm.plugins.plugins_loaded
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"0" if vllm.plugins.plugins_loaded else b"1")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"


def test_profiler_records_skips_and_errors(monkeypatch, tmp_path):
    """A part this vLLM lacks is skipped and recorded; an error during install is written to the file and never
    raised."""
    from batchjson import vllm_patches

    profile = tmp_path / "p.json"
    monkeypatch.setattr(vllm_patches, "TIMED", vllm_patches.TIMED + (
        ("vllm.v1.no_such_module", "X", "y", "y", False), ("vllm.v1.engine.core", "EngineCore", "no_such", "z", False)))
    vllm_patches.install_profiler(profile, sync=False)
    got = read_profile(profile)
    assert got["patches"]["v1.no_such_module.X.y"].startswith("skipped: import")
    assert got["patches"]["v1.engine.core.EngineCore.no_such"] == "skipped: EngineCore.no_such not found"
    assert got["patches"]["v1.core.sched.scheduler.Scheduler.schedule"] == "ok" and not got["errors"]

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(vllm_patches, "install_profiler", boom)
    monkeypatch.setattr(vllm_patches, "INSTALLED", False)
    monkeypatch.setenv(vllm_patches.ENV_PROFILE, str(tmp_path / "q.json"))
    vllm_patches.install()
    data = json.loads((tmp_path / "q.json").read_text())
    assert "boom" in data["error"] and read_profile(tmp_path / "q.json")["errors"]

"""The keyword arguments VllmEngine gives vllm.LLM (engine/vllm_engine.py, engine_kwargs), built without vLLM."""

from __future__ import annotations

import pytest

from batchjson.engine.vllm_engine import GRAPH_TOKENS, cpu_dtype, engine_kwargs, graph_sizes
from batchjson.errors import EngineError
from batchjson.spec import DecodingSpec, ModelSpec, SpeculativeSpec


@pytest.fixture
def folder(tmp_path):
    """A model folder as resolve_model accepts it (a config.json): nothing is loaded."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_a_gpu_engine_gets_the_grammar_settings_and_no_cpu_ones(folder):
    model = ModelSpec(path=folder, dtype="bfloat16", disable_any_whitespace=False)
    assert engine_kwargs(model, DecodingSpec(seed=3), "guidance", None, cpu=False) == {
        "model": folder, "dtype": "bfloat16", "disable_log_stats": True,  # as bare vLLM: no draft counters to read
        "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": False},
        "compilation_config": {"cudagraph_capture_sizes": graph_sizes(GRAPH_TOKENS)}}


def test_a_gpu_engine_captures_graphs_for_a_full_batchs_steps_and_the_user_can_say_otherwise(folder):
    """vLLM 0.26 captures CUDA graphs for steps of up to 512 tokens; a step at its full batch holds ~900-1,700."""
    sizes = engine_kwargs(ModelSpec(path=folder), DecodingSpec(), "xgrammar", None, cpu=False)[
        "compilation_config"]["cudagraph_capture_sizes"]
    assert sizes == sorted(set(sizes)) and sizes[-1] == 2048 and {1, 512, 1024, 1792} <= set(sizes)
    assert graph_sizes(512) == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]  # vLLM 0.26's own list
    assert "compilation_config" not in engine_kwargs(ModelSpec(path=folder), DecodingSpec(), "xgrammar", None, True)
    ngram = SpeculativeSpec(method="ngram")  # drafted steps keep vLLM's graphs (not measured with these)
    assert "compilation_config" not in engine_kwargs(ModelSpec(path=folder), DecodingSpec(), "xgrammar", ngram, False)
    mine = ModelSpec(path=folder, engine={"compilation_config": {"max_cudagraph_capture_size": 256}})
    assert engine_kwargs(mine, DecodingSpec(), "xgrammar", None, False)["compilation_config"] == {
        "max_cudagraph_capture_size": 256}


def test_a_cpu_engine_runs_eager_and_takes_the_seed_engine_wide(folder):
    model = ModelSpec(path=folder, max_model_len=512)
    kwargs = engine_kwargs(model, DecodingSpec(seed=3), "xgrammar", None, cpu=True)
    assert kwargs["enforce_eager"] is True and kwargs["seed"] == 3 and kwargs["max_model_len"] == 512
    assert kwargs["dtype"] == cpu_dtype("auto")  # float32 without bfloat16 instructions
    assert "seed" not in engine_kwargs(model, DecodingSpec(), "xgrammar", None, cpu=True)
    assert engine_kwargs(ModelSpec(path=folder, dtype="float32"), DecodingSpec(), "xgrammar", None, True)["dtype"] == "float32"


def test_speculation_and_engine_options(folder, tmp_path_factory):
    draft = tmp_path_factory.mktemp("draft")
    (draft / "config.json").write_text("{}")
    ngram = SpeculativeSpec(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, options={"x": 1})
    kwargs = engine_kwargs(ModelSpec(path=folder), DecodingSpec(), "xgrammar", ngram, cpu=False)
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "draft_sample_method": "greedy",
                                            "prompt_lookup_min": 1, "prompt_lookup_max": 4, "x": 1}
    assert kwargs["disable_log_stats"] is False  # the draft's counters (llm.get_metrics()) need vLLM's stats
    small = SpeculativeSpec(method="draft_model", draft_model=str(draft))
    assert engine_kwargs(ModelSpec(path=folder), DecodingSpec(), "xgrammar", small, cpu=False)["speculative_config"] == {
        "method": "draft_model", "num_speculative_tokens": 4, "draft_sample_method": "greedy", "model": str(draft)}
    off = SpeculativeSpec(method="none")
    kwargs = engine_kwargs(ModelSpec(path=folder), DecodingSpec(), "xgrammar", off, False)
    assert "speculative_config" not in kwargs and kwargs["disable_log_stats"] is True
    # [model.engine] goes last: it overrides what batchjson sets
    model = ModelSpec(path=folder, engine={"enforce_eager": False, "gpu_memory_utilization": 0.5})
    kwargs = engine_kwargs(model, DecodingSpec(), "xgrammar", None, cpu=True)
    assert kwargs["enforce_eager"] is False and kwargs["gpu_memory_utilization"] == 0.5


def test_a_missing_model_folder_is_the_users_error(tmp_path):
    with pytest.raises(EngineError, match="no Hugging Face model folder"):
        engine_kwargs(ModelSpec(path=str(tmp_path / "nothing")), DecodingSpec(), "xgrammar", None, cpu=False)


def test_on_a_gpu_batchjson_keeps_the_compile_cache_key_of_a_plain_vllm_run(monkeypatch):
    """vLLM hashes its environment variables into the key of its compile cache: a CPU-only variable set on a GPU
    host made batchjson's first engine start compile again what a plain vLLM run had compiled (~30 s on an H200)."""
    import vllm.envs
    from vllm.platforms import current_platform

    from batchjson.engine.vllm_engine import _vllm

    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_WAIT_POLICY"):
        monkeypatch.setenv(name, "")  # recorded, so the test leaves the environment as it found it
        monkeypatch.delenv(name)
    plain = vllm.envs.compile_factors()
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    _vllm()
    assert vllm.envs.compile_factors() == plain
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    _vllm()  # a CPU build needs them: it refuses to start without a KV cache size
    assert vllm.envs.compile_factors() != plain

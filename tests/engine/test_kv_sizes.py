"""The KV cache sizes vLLM measured, kept per configuration (engine/kv_sizes.py), and the engine core's report of
them (engine/vllm/kv.py, install_kv_size_report) on the real CPU engine."""

from __future__ import annotations

import json

import pytest

from batchjson.engine import devices, kv_sizes
from batchjson.spec import load_spec
from helpers import write_job, write_rows

H200 = [["0", "GPU-aaaa", "NVIDIA H200", "143771"], ["1", "GPU-bbbb", "NVIDIA H200", "143771"]]


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHJSON_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    rows = list(H200)
    monkeypatch.setattr(devices, "_smi", lambda query: rows)
    return rows


def test_a_size_is_kept_per_configuration_and_gpu_and_forgotten_on_demand(gpus):
    half = {"model": "/m", "gpu_memory_utilization": 0.45}
    assert kv_sizes.kept(kv_sizes.key(half)) is None
    kv_sizes.keep(kv_sizes.key(half), 5 << 30)
    assert kv_sizes.kept(kv_sizes.key(half)) == 5 << 30
    assert kv_sizes.kept(kv_sizes.key(half | {kv_sizes.GIVEN: 1})) == 5 << 30  # the size itself is not in the key
    assert kv_sizes.kept(kv_sizes.key(half | {"gpu_memory_utilization": 0.3})) is None  # another share
    gpus[1] = ["1", "GPU-bbbb", "NVIDIA H100 80GB HBM3", "81559"]
    assert kv_sizes.kept(kv_sizes.key(half)) is None  # another kind of GPU
    gpus[1] = H200[1]
    kv_sizes.forget(kv_sizes.key(half))
    assert kv_sizes.kept(kv_sizes.key(half)) is None


def test_a_model_replaced_at_the_same_path_is_another_configuration(gpus, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    kwargs = {"model": str(model), "gpu_memory_utilization": 0.45}
    kv_sizes.keep(kv_sizes.key(kwargs), 4 << 30)
    assert kv_sizes.kept(kv_sizes.key(kwargs)) == 4 << 30
    (model / "model.safetensors").write_bytes(b"\0" * 128)  # larger weights: another KV cache would fit
    assert kv_sizes.kept(kv_sizes.key(kwargs)) is None
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "config.json").write_text('{"hidden_size": 128}')
    assert kv_sizes.kept(kv_sizes.key(kwargs)) is None


def test_no_size_without_a_gpu_nvidia_smi_names_and_a_damaged_file_is_an_empty_one(gpus, monkeypatch):
    config = kv_sizes.key({"model": "/m"})
    kv_sizes.keep(config, 3 << 30)
    kv_sizes.path().write_text("{not json")
    assert kv_sizes.kept(config) is None
    kv_sizes.keep(config, 3 << 30)
    assert json.loads(kv_sizes.path().read_text()) == {config: 3 << 30}
    monkeypatch.setattr(devices, "_smi", lambda query: [])
    assert kv_sizes.key({"model": "/m"}) is None and kv_sizes.kept(None) is None


def test_the_factory_says_a_start_measures_until_a_size_is_kept_or_the_job_gives_one(gpus, tmp_path, tiny_model,
                                                                                      monkeypatch):
    """On a GPU (the platform's answer faked: this machine's vLLM is the CPU build); a CPU engine keeps no size."""
    import dataclasses

    from vllm.platforms import current_platform

    from batchjson.engine import VllmEngines
    from batchjson.engine.vllm_engine import engine_settings

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    write_rows(tmp_path / "in.parquet", 4)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="none"))
    engines, decoding = VllmEngines(), spec.sampling
    assert engines.measures(spec, decoding, None)
    _, kwargs = engine_settings(spec.model, decoding, spec.schema_doc, None, False)
    kv_sizes.keep(kv_sizes.key(kwargs), 2 << 30)
    assert not engines.measures(spec, decoding, None)
    assert engines.measures(spec, dataclasses.replace(decoding, structured_output_backend="guidance"), None)
    given = dataclasses.replace(spec, model=dataclasses.replace(spec.model, engine={kv_sizes.GIVEN: 1 << 30}))
    kv_sizes.forget(kv_sizes.key(kwargs))
    assert not engines.measures(given, decoding, None)
    assert kv_sizes.sized(kwargs, cpu=True) == (None, None)


@pytest.mark.engine
def test_the_engine_core_reports_the_kv_cache_bytes_it_was_given(plain_run):
    """The real engine (CPU; the session's engine without speculation): its engine core writes the bytes of its KV
    cache (here VLLM_CPU_KVCACHE_SPACE's 1 GiB, the tests' setting) to the file the runner names, once the cache
    is allocated."""
    assert plain_run.kv_bytes == 1 << 30

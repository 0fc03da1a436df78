"""How replicas are laid over the GPUs (executors/placement.py, executors/local.py, executors/ray.py): N per GPU, with
tensor parallelism, each engine's share of memory and cores, the "auto" rule, and the combinations refused with
exit 2 naming the key. No GPU is needed: the GPUs are CUDA_VISIBLE_DEVICES, or counts."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from batchjson.cli import main
from batchjson.engine.devices import memory_taken
from batchjson.engine.fake import FakeEngines
from batchjson.executors import placement
from batchjson.executors.placement import (GIB, Layout, Placement, auto_per_gpu, choose_per_gpu, lay_out,
                                           local_layout, memory_share, ray_layout)
from batchjson.errors import SpecError
from batchjson.executors.base import Turns
from batchjson.executors.local import threads_per_replica
from batchjson.report import RunReport
from batchjson.spec import ModelSpec, load_spec
from batchjson.job import run_job
from helpers import at_commit_step, write_job, write_rows

HINT = "(hint)"


def test_n_replicas_on_each_gpu_each_with_its_share_of_memory():
    layout = lay_out(["0", "1"], {}, 3, None, "this host", HINT)
    assert [p.devices for p in layout.placements] == ["0", "1", "0", "1", "0", "1"]
    assert {p.share for p in layout.placements} == {3}
    assert {p.engine["gpu_memory_utilization"] for p in layout.placements} == {0.3}  # vLLM's 0.9, divided
    assert layout.per_gpu == 3


def test_one_per_gpu_changes_nothing_in_the_engine():
    layout = lay_out(["0", "1"], {}, 1, None, "this host", HINT)
    assert layout.placements == (Placement("0"), Placement("1"))


def test_replicas_per_tensor_parallel_group():
    layout = lay_out(["0", "1", "2", "3"], {"tensor_parallel_size": 2}, 2, None, "this host", HINT)
    assert [p.devices for p in layout.placements] == ["0,1", "2,3", "0,1", "2,3"]
    assert {p.engine["gpu_memory_utilization"] for p in layout.placements} == {0.45}


def test_fewer_replicas_than_room_spread_before_sharing():
    """--replicas 3 on 2 GPUs at 2 per GPU: GPU 0 takes two (each half its memory), GPU 1 one (all of it)."""
    layout = lay_out(["0", "1"], {}, 2, 3, "this host", HINT)
    assert [(p.devices, p.share, p.engine) for p in layout.placements] == [
        ("0", 2, {"gpu_memory_utilization": 0.45}), ("1", 1, {}), ("0", 2, {"gpu_memory_utilization": 0.45})]


def test_more_replicas_than_room_are_refused_naming_the_key():
    with pytest.raises(SpecError, match=r"room for 4 replica\(s\) of 1 GPU\(s\) at 2 per GPU \(model.replicas_per_gpu\), "
                                        r"not 5"):
        lay_out(["0", "1"], {}, 2, 5, "this host", HINT)
    with pytest.raises(SpecError, match="room for 0"):
        lay_out(["0"], {"tensor_parallel_size": 2}, 2, None, "this host", HINT)


def test_the_users_gpu_memory_utilization_is_kept_unless_the_replicas_would_overfill_the_gpu():
    assert memory_share({"gpu_memory_utilization": 0.25}, 3) == {}  # kept: vLLM's own, per engine
    assert memory_share({"gpu_memory_utilization": 0.95}, 1) == {}
    with pytest.raises(SpecError, match=r"model.engine.gpu_memory_utilization = 0.5 with 3 replicas .*150%.*at most 0.33"):
        memory_share({"gpu_memory_utilization": 0.5}, 3)
    assert memory_share({}, 4) == {"gpu_memory_utilization": 0.225}
    assert memory_share({}, 3) == {"gpu_memory_utilization": 0.3}  # rounded down: three never ask for more than 0.9


def test_a_placement_changes_only_the_replicas_copy_of_the_spec(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 4)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet",
                               extra="[model.engine]\nenforce_eager = true\n"))
    mine = Placement("0", 2, {"gpu_memory_utilization": 0.45}).applied(spec)
    assert mine.model.engine == {"enforce_eager": True, "gpu_memory_utilization": 0.45}
    assert spec.model.engine == {"enforce_eager": True}
    assert Placement().applied(spec) is spec


def test_the_local_layout_reads_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    layout = local_layout(None, ModelSpec(replicas_per_gpu=2))
    assert [p.devices for p in layout.placements] == ["2", "5", "2", "5"]
    assert (layout.per_gpu, layout.why) == (2, "model.replicas_per_gpu = 2")
    assert local_layout(1, ModelSpec(replicas_per_gpu=2)).placements == (Placement("2"),)


def test_without_gpus_replicas_per_gpu_above_one_is_refused_and_auto_is_one_cpu_replica(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_layout(None, ModelSpec()) == Layout((Placement(),))
    assert local_layout(2, ModelSpec(replicas_per_gpu=1)).placements == (Placement(), Placement())
    with pytest.raises(SpecError, match="model.replicas_per_gpu = 2: this host has no GPU to share.*model.replicas"):
        local_layout(None, ModelSpec(replicas_per_gpu=2))


@pytest.mark.parametrize("value, message", [
    ("0", 'model.replicas_per_gpu must be "auto" or a whole number >= 1, got 0'),
    ('"two"', "model.replicas_per_gpu must be \"auto\" or a whole number >= 1, got 'two'"),
    ("1.5", "model.replicas_per_gpu must be int or str, got float 1.5"),
    ("true", "model.replicas_per_gpu must be int or str, got bool True"),
])
def test_bad_values_exit_2_naming_the_key(tmp_path, tiny_model, value, message):
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    job.write_text(job.read_text().replace("[model]\n", f"[model]\nreplicas_per_gpu = {value}\n"))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("gpus, key, extra, args, message", [
    ("", "2", "", [], "model.replicas_per_gpu = 2: this host has no GPU to share"),
    ("0", "2", "", ["--replicas", "3"], "this host has 1 GPU(s): room for 2 replica(s)"),
    ("0", "2", "[model.engine]\ngpu_memory_utilization = 0.6\n", [], "model.engine.gpu_memory_utilization = 0.6 with 2"),
])
def test_refused_layouts_exit_2_before_any_engine_starts(tmp_path, tiny_model, monkeypatch, gpus, key, extra, args,
                                                         message):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus)
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", extra=extra)
    job.write_text(job.read_text().replace("[model]\n", f"[model]\nreplicas_per_gpu = {key}\n"))
    result = CliRunner().invoke(main, ["run", str(job), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out" / "_batchjson" / "units").exists() or not any((tmp_path / "out" / "_batchjson" / "units").iterdir())


def test_the_spec_hash_ignores_replicas_per_gpu(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    before = load_spec(job).hash()
    job.write_text(job.read_text().replace("[model]\n", "[model]\nreplicas_per_gpu = 3\n"))
    assert load_spec(job).hash() == before


def test_auto_shares_a_gpu_only_where_it_was_measured_to_pay():
    """The measured rule: SmolLM2-135M and the Qwen2.5-Coder 0.5B on an H200 of a 16-core host, 30,000 rows: three
    replicas (5 cores and 10,000 rows for each); the 1.5B target two (15,000 rows each), on an H100 too. A smaller
    job, fewer cores, a larger model: one."""
    smol, coder05, target, h200 = int(0.25 * GIB), int(1.17 * GIB), int(3.31 * GIB), 140 * GIB
    n, why = auto_per_gpu(smol, h200, 16, 1, 30_000)
    assert n == 3 and "measured to pay" in why and "5 cores per replica" in why
    assert auto_per_gpu(smol, h200, 16, 1, None)[0] == 3  # rows unknown: the rule's share and cores decide
    n, why = auto_per_gpu(smol, h200, 16, 1, 600)  # a small job: ends before a second engine's start pays
    assert n == 1 and "no measured rule shares a GPU" in why and "600 rows" in why and "0.25 GiB" in why
    assert auto_per_gpu(smol, h200, 16, 1, 25_000)[0] == 1  # 8,333 rows each
    assert auto_per_gpu(smol, h200, 14, 1, 30_000)[0] == 2  # 4 cores for each of three: two, 7 each
    assert auto_per_gpu(smol, h200, 9, 1, 30_000)[0] == 1  # 4 cores for each of two
    assert auto_per_gpu(smol, h200, 20, 1, 40_000)[0] == 3
    assert auto_per_gpu(smol, h200, 32, 2, 60_000)[0] == 3  # two GPUs, 5 cores and 10,000 rows for each replica
    assert auto_per_gpu(smol, h200, 32, 2, 40_000)[0] == 1  # 6,667 rows each
    assert auto_per_gpu(coder05, h200, 16, 1, 30_000)[0] == 3  # the 0.5B: 0.84% of the GPU
    assert auto_per_gpu(coder05, 80 * GIB, 16, 1, 30_000)[0] == 2  # 1.5% of an 80 GiB GPU: the 1.5B's row
    n, why = auto_per_gpu(target, h200, 16, 1, 30_000)  # the 1.5B: two, 8 cores and 15,000 rows for each
    assert n == 2 and "8 cores per replica" in why
    assert auto_per_gpu(target, h200, 16, 1, 6_000)[0] == 1  # ends before the second engine's start pays
    assert auto_per_gpu(target, h200, 8, 1, 30_000)[0] == 1  # 4 cores each
    assert auto_per_gpu(target, int(79.6 * GIB), 16, 1, 30_000)[0] == 2  # 4.2% of an H100: measured there too
    assert auto_per_gpu(target, 40 * GIB, 16, 1, 30_000)[0] == 1  # 8.3% of a 40 GiB GPU: not measured
    assert auto_per_gpu(int(15 * GIB), h200, 64, 1, 1_000_000)[0] == 1  # a 7B: never shared
    assert auto_per_gpu(None, h200, 16, 1) == (1, "auto: the model's weights or the GPU's memory are unknown")


def test_the_auto_rule_shares_a_gpu_only_for_small_models_with_cores_to_spare(monkeypatch):
    monkeypatch.setattr(placement, "REPLICAS_PER_GPU_RULE", ((0.01, 4, 0, 3), (0.01, 4, 0, 2), (1.0, 0, 0, 1)))
    small, big, gpu = int(0.27 * GIB), 3 * GIB, 140 * GIB
    assert auto_per_gpu(small, gpu, 16, 1)[0] == 3  # 5 cores for each of 3
    assert auto_per_gpu(small, gpu, 10, 1)[0] == 2  # 3 each would be too few for 3: two, 5 each
    assert auto_per_gpu(small, gpu, 16, 2)[0] == 2  # two GPUs: 6 replicas would get 2 cores each
    assert auto_per_gpu(small, gpu, 6, 1)[0] == 1
    assert auto_per_gpu(big, gpu, 64, 1)[0] == 1  # weights above 1% of the GPU: never shared
    assert "measured to pay" in auto_per_gpu(small, gpu, 16, 1)[1]


def test_auto_reads_the_models_weights(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(placement, "REPLICAS_PER_GPU_RULE", ((0.01, 1, 0, 2), (1.0, 0, 0, 1)))
    assert choose_per_gpu(ModelSpec(path=str(tmp_path)), 1, 1, 8, 1 << 20)[0] == 2  # 4 KiB of a 1 MiB GPU
    assert choose_per_gpu(ModelSpec(path=str(tmp_path)), 1, 1, 8, 1 << 18)[0] == 1  # 1.6% of it
    assert choose_per_gpu(ModelSpec(path=str(tmp_path), replicas_per_gpu=4), 1, 1, 8, None) == (4, "model.replicas_per_gpu = 4")


def test_auto_fits_the_users_gpu_memory_utilization(tmp_path):
    """A gpu_memory_utilization the user set is each engine's: auto takes no more engines than fit it (with 0.85, a
    job that ran on one engine exited 2 once auto chose two)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    model = lambda given: ModelSpec(path=str(tmp_path), engine={"gpu_memory_utilization": given})  # noqa: E731
    assert choose_per_gpu(model(0.85), 1, 1, 16, 1 << 20, 30_000) == (
        1, "auto: weights 0.00 GiB, 0.4% of a 0 GiB GPU, 5 cores per replica: measured to pay; 1 with "
           "model.engine.gpu_memory_utilization = 0.85")
    assert choose_per_gpu(model(0.45), 1, 1, 16, 1 << 20, 30_000)[0] == 2
    assert choose_per_gpu(model(0.3), 1, 1, 16, 1 << 20, 30_000)[0] == 3
    assert choose_per_gpu(model(0.25), 1, 1, 16, 1 << 20, 30_000)[0] == 3  # four fit, the rule takes three


def test_each_replicas_threads_are_its_share_of_the_cores():
    assert threads_per_replica(2, 16) == 4  # the measured 4, where the cores allow it
    assert threads_per_replica(8, 16) == 2
    assert threads_per_replica(32, 16) == 1


def test_ray_actors_take_a_fraction_of_a_gpu():
    layout, gpus = ray_layout(2, ModelSpec(replicas_per_gpu=4), None)
    assert len(layout.placements) == 8 and gpus == 0.25
    assert {p.engine["gpu_memory_utilization"] for p in layout.placements} == {0.225}
    assert ray_layout(2, ModelSpec(replicas_per_gpu=3), None)[1] == 0.3333  # Ray's precision: 4 decimals
    layout, gpus = ray_layout(4, ModelSpec(engine={"tensor_parallel_size": 2}), None)
    assert len(layout.placements) == 2 and gpus == 2 and layout.per_gpu == 1  # auto: one per group on Ray
    with pytest.raises(SpecError, match="model.replicas_per_gpu = 2 with 2 GPUs per replica"):
        ray_layout(4, ModelSpec(replicas_per_gpu=2, engine={"tensor_parallel_size": 2}), None)
    with pytest.raises(SpecError, match="the Ray cluster has no GPU to share"):
        ray_layout(0, ModelSpec(replicas_per_gpu=2), None)
    with pytest.raises(SpecError, match="room for 4"):
        ray_layout(2, ModelSpec(replicas_per_gpu=2), 5)


def test_turns_go_one_at_a_time_per_gpu_in_the_order_asked_and_a_dead_holder_passes_it_on():
    turns = Turns()
    assert turns.ask(0, "h:0") and turns.ask(3, "h:1")  # other GPUs do not wait
    assert not turns.ask(1, "h:0") and not turns.ask(2, "h:0")
    assert turns.release(0) == [1]
    assert turns.release(2) == []  # gave up waiting (a stop): withdrawn
    assert turns.release(1) == []  # its turn done, nobody waiting
    assert turns.ask(2, "h:0")
    assert turns.release(5) == []  # never asked


def test_starts_that_measure_nothing_and_closes_go_side_by_side_but_never_beside_one_that_measures():
    turns = Turns()
    assert turns.ask(0, "h:0", alone=False) and turns.ask(1, "h:0", alone=False)  # side by side
    assert not turns.ask(2, "h:0")  # measures: waits for both
    assert not turns.ask(3, "h:0", alone=False)  # in the order asked: not past the one that measures
    assert turns.release(0) == [] and turns.release(1) == [2]
    assert turns.release(2) == [3]
    assert not turns.ask(4, "h:0")  # 3 does not measure, but 4 does: it waits for 3
    assert turns.ask(5, "h:1", alone=False)  # another GPU
    assert not turns.ask(6, "h:0", alone=False) and not turns.ask(7, "h:0", alone=False)
    assert turns.release(4) == [6, 7]  # gave up waiting: the two behind it go beside 3


def test_the_report_says_how_many_per_gpu_and_why():
    report = RunReport("h", 10, "out", "rej")
    report.lay_out(lay_out(["0"], {}, 2, None, "this host", HINT, why="model.replicas_per_gpu = 2"))
    assert (report.replicas, report.replicas_per_gpu) == (2, 2)
    assert ("  replicas: 2 replica(s) on 1 GPU(s), 2 per GPU (model.replicas_per_gpu = 2); each engine "
            "gpu_memory_utilization 0.45") in report.summary()
    assert report.to_dict()["replicas_per_gpu"] == 2
    cpu = RunReport("h", 10, "out", "rej")
    cpu.lay_out(Layout((Placement(),)))
    assert "replicas:" not in cpu.summary()


def test_a_resumed_run_lays_out_its_replicas_by_the_rows_it_has_left(tmp_path, tiny_model, monkeypatch):
    """auto's replicas per GPU count the rows a run has left to decode: a resumed run of 16 rows with 8 done lays out
    its replicas for 8 (the job's 16 only check that the layout is possible, before the output folder is claimed)."""
    import batchjson.start

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    write_rows(tmp_path / "in.parquet", 16)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4))
    real, asked = batchjson.start.local_layout, []
    monkeypatch.setattr(batchjson.start, "local_layout",
                        lambda requested, model, rows=None: asked.append(rows) or real(requested, model, rows))
    at_commit_step("committed", 2, stop, monkeypatch.setattr)  # the first run dies after its second unit
    with pytest.raises(Stop):  # every row valid: both commits are pass 1's
        run_job(spec, engine_factory=FakeEngines(valid=1.0), progress=False)
    assert asked == [16]
    at_commit_step("committed", 0, stop, monkeypatch.setattr)
    report = run_job(spec, engine_factory=FakeEngines(valid=1.0), progress=False)
    assert report.resumed and asked == [16, 16, 8]
    assert report.valid + report.rejected == 16


NVIDIA_SMI = """#!/bin/sh
case "$1" in
  -L) printf 'GPU 0: NVIDIA H200 (UUID: GPU-aaa)\nGPU 1: NVIDIA H200 (UUID: GPU-bbb)\n' ;;
  --query-gpu=*) printf '0, GPU-aaa, 133005, 143771\\n1, GPU-bbb, 0, 143771\\n' ;;
  --query-compute-apps=*) printf 'GPU-aaa, 4161, python3, 132990\\n' ;;
esac
"""


def test_an_engine_that_cannot_start_for_gpu_memory_names_what_holds_it(tmp_path, monkeypatch):
    """A run killed without its engine core leaves the GPU's memory taken: the next run's message says by whom."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hint = memory_taken(0.9)
    assert hint.startswith("GPU 0 has 10.5 of 140.4 GiB free, 0.9 wanted; held by pid 4161 (python3, 129.9 GiB). "
                           "Stop what holds it"), hint
    assert "GPU 1" not in hint and "model.engine.gpu_memory_utilization" in hint
    assert memory_taken(0.05) == ""  # enough free for that share: not the cause
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # only the free GPU is this run's
    assert memory_taken(0.9) == ""
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no nvidia-smi: nothing to say
    assert memory_taken(0.9) == ""

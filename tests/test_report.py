"""The run report's account of where a run's time went and what it cost (fake engine)."""

from __future__ import annotations

import time

import pytest

from batchjson.engine import EngineWrapper, WrappedEngines
from batchjson.executors.placement import Layout, Placement
from batchjson.errors import SpecError
from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.report import PassStats
from batchjson.spec import load_spec
from helpers import codes, write_job, write_rows


def test_the_report_says_where_the_runs_time_went(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 200)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=50))

    class SlowClose(EngineWrapper):
        def close(self):
            time.sleep(0.5)
            self.inner.close()

    report = run_job(spec, engine_factory=WrappedEngines(FakeEngines(seed=1), SlowClose), progress=False).to_dict()
    t = report["timeline"]
    assert 0 < t["before_run"] < 3600  # this process (pytest's) started before the run
    assert 0 <= t["checked"] <= t["passes"] <= t["verified"] <= report["seconds"]
    closed = sum(p["engine_close_s"] for p in report["passes"].values())
    assert 0.5 <= closed < t["passes"]


def test_each_note_keeps_its_code_next_to_its_text():
    """A note's text stays where readers find it (`note`, `notes`); its code is in `events`, once per distinct note,
    also when merged from a replica's counts, and a replica's counts without events (an older batchjson) merge."""
    from batchjson.report import PassStats, RunReport

    stats = PassStats()
    stats.note = stats.event("engine-restarted", "engine restarted after 1 death(s)")
    older = PassStats(note="replica 1 died").to_dict()
    del older["events"]
    for other in (stats.to_dict(), older):
        stats.merge(other)
    assert stats.note == "engine restarted after 1 death(s); replica 1 died"
    assert stats.to_dict()["events"] == [{"code": "engine-restarted", "text": "engine restarted after 1 death(s)"}]

    report = RunReport("h", 1, "out", "rej")
    report.note("unit-redone", "unit a.parquet#0: the record was missing; the unit was redone")
    d = report.to_dict()
    assert d["notes"] == ["unit a.parquet#0: the record was missing; the unit was redone"]
    assert codes(d) == ["unit-redone"] and "note: unit a.parquet#0" in report.summary()


def test_every_note_is_an_event_though_the_note_keeps_the_first():
    """An engine that hung after a restart: the pass's note stays the first, its events hold both, in order."""
    stats = PassStats()
    stats.first_note("engine-restarted", "engine restarted after 1 death(s)")
    stats.first_note("engine-hung", "engine hung and was restarted")
    assert stats.note == "engine restarted after 1 death(s)"
    assert [e["code"] for e in stats.events] == ["engine-restarted", "engine-hung"]


def test_the_report_says_what_the_run_cost(tmp_path, tiny_model):
    """Engine time x GPUs, per 1,000 valid rows, tokens per row, and a price with [report] gpu_hour_price."""
    write_rows(tmp_path / "in.parquet", 60)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", extra="[report]\ngpu_hour_price = 3.6"))
    report = run_job(spec, engine_factory=FakeEngines(seed=1), progress=False)
    cost, passes = report.cost(), report.to_dict()["passes"]
    window = report.timeline["passes"] - report.timeline["checked"]
    assert report.gpus == 0 and cost["gpu_seconds"] == 0 and "price_per_1000_valid" not in cost  # a CPU engine
    assert cost["engine_seconds"] == round(window, 1) and "engine-seconds (a CPU engine)" in report.summary()
    assert cost["output_tokens_per_row"] == round(sum(p["output_tokens"] for p in passes.values()) / 60, 1) > 0
    report.lay_out(Layout((Placement("0"), Placement("1")), per_gpu=1, why="one per GPU"))  # as two GPUs would
    cost = report.cost()
    assert report.gpus == 2 and cost["gpu_seconds"] == round(window * 2, 1)
    assert cost["gpu_seconds_per_1000_valid"] == round(window * 2 * 1000 / report.valid, 2)
    assert cost["price_per_1000_valid"] == round(cost["gpu_seconds_per_1000_valid"] / 1000, 4)  # 3.6 an hour
    assert "GPU-seconds (2 GPU(s))" in report.summary() and "per GPU-hour" in report.summary()
    report.lay_out(Layout((Placement(),) * 4, per_gpu=2, why="two per GPU"))
    assert report.gpus == 2


def test_a_negative_gpu_hour_price_is_refused(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", extra="[report]\ngpu_hour_price = -1")
    with pytest.raises(SpecError, match="report.gpu_hour_price"):
        load_spec(job)


def test_the_report_says_what_a_step_cost(tmp_path, tiny_model):
    """Engine steps and ms per step (the fake engine answers a row a step, `delay` seconds each), per pass and for the
    run, in the report's file and on its summary's engine line; an engine that counts no steps says nothing of them."""
    write_rows(tmp_path / "in.parquet", 40)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))
    report = run_job(spec, engine_factory=FakeEngines(seed=1, valid=0.75, delay=0.01), progress=False)
    d = report.to_dict()
    first, second = d["passes"]["pass1"], d["passes"]["pass2"]
    assert second["rows"] > 0 and d["engine_starts"] == 1  # pass 2 on pass 1's engine: its steps count in pass 1
    assert d["engine_steps"] == first["engine_steps"] == 40 + second["rows"] and second["engine_steps"] == 0
    assert 10 <= d["ms_per_step"] == first["ms_per_step"] < 200  # at least the engine's 10 ms a step
    assert f"; {d['engine_steps']} steps, {d['ms_per_step']:.1f} ms a step" in report.summary()
    merged = PassStats()
    merged.merge(PassStats(rows=3, engine_steps=3, engine_step_s=0.06).to_dict())
    assert merged.engine_steps == 3 and merged.to_dict()["ms_per_step"] == 20.0
    assert PassStats(rows=3).to_dict()["ms_per_step"] is None

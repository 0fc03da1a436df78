"""The run report's account of where a run's time went (fake engine)."""

from __future__ import annotations

import time

from batchjson.engine import EngineWrapper, WrappedEngines
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

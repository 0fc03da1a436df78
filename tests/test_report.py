"""The run report's account of where a run's time went (fake engine)."""

from __future__ import annotations

import time

from batchjson.engine import EngineWrapper, WrappedEngines
from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.spec import load_spec
from helpers import write_job, write_rows


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

"""Pass 1's recipe: when greedy decoding fails most of its first rows, pass 1 decodes the rest with the fallback's
sampling settings (fake engine: greedy and sampled rows are valid at rates the test sets)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchjson.adapt import recipe
from batchjson.engine import EngineWrapper, WrappedEngines
from batchjson.engine.fake import FakeEngines
from batchjson.errors import SpecError
from batchjson.job import run_job
from batchjson.spec import load_spec
from helpers import assert_exactly_once, codes, write_job, write_rows

ROWS = 600


def job_with(tmp_path, tiny_model, sampling: str = ""):
    write_rows(tmp_path / "in.parquet", ROWS)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=50)
    job.write_text(job.read_text().replace("[sampling]\n", f"[sampling]\n{sampling}\n"))
    return load_spec(job)


def run(spec, **engine):
    engines = FakeEngines(seed=1, max_in_flight=64, **engine)
    report = run_job(spec, engine_factory=engines, progress=False)
    out = Path(spec.output.path)
    assert_exactly_once([f"r{i:05d}" for i in range(ROWS)], out, out / "_rejects")
    return report, engines


def test_pass_one_takes_the_fallbacks_sampling_when_greedy_fails(tmp_path, tiny_model):
    report, engines = run(job_with(tmp_path, tiny_model), valid=0.1, sampled_valid=0.9)
    p1 = report.passes["pass1"]
    (judged,) = p1.recipe
    assert judged["recipe"] == "fallback"
    assert judged["judged"]["sampling"]["rows"] == recipe.JUDGE_ROWS
    # Most of pass 1 decoded sampled: far more valid rows than greedy's 10%, fewer left for pass 2.
    assert p1.valid > 0.7 * ROWS and report.passes["pass2"].rows == ROWS - p1.valid
    assert len(engines.started) == 1  # the same engine: only the requests' settings changed
    (engine,) = engines.engines
    p1_now, p2 = engine.decoding["p1"], engine.decoding["p2"]
    assert p1_now.temperature == p2.temperature == 0.7 and p1_now.n == 1
    assert p1_now.seed != p2.seed  # a row failing pass 1 gets another sample in pass 2
    assert engine.drafted["p1"] and not engine.drafted["p2"]  # pass 1 keeps its draft, pass 2 has none


def test_adapt_false_keeps_pass_one_on_its_own_settings(tmp_path, tiny_model):
    report, engines = run(job_with(tmp_path, tiny_model, "adapt = false"), valid=0.1, sampled_valid=0.9)
    assert report.passes["pass1"].recipe == []
    assert report.passes["pass1"].valid < 0.2 * ROWS
    assert engines.engines[0].decoding["p1"].temperature == 0


def test_a_pass_one_that_mostly_succeeds_keeps_its_settings(tmp_path, tiny_model):
    report, engines = run(job_with(tmp_path, tiny_model), valid=0.9, sampled_valid=0.1)
    (judged,) = report.passes["pass1"].recipe
    assert judged["recipe"] == "sampling" and judged["why"].startswith("kept its own sampling settings")
    assert engines.engines[0].decoding["p1"].temperature == 0


def test_a_fallback_that_does_worse_hands_pass_one_back(tmp_path, tiny_model):
    report, engines = run(job_with(tmp_path, tiny_model), valid=0.4, sampled_valid=0.05)
    (judged,) = report.passes["pass1"].recipe
    assert judged["recipe"] == "sampling" and judged["why"].startswith("back to its own sampling settings")
    assert judged["judged"]["fallback"]["rows"] == recipe.JUDGE_ROWS
    assert engines.engines[0].decoding["p1"].temperature == 0


def test_adapt_is_a_pass_one_key_and_leaves_the_hash_alone(tmp_path, tiny_model):
    default = job_with(tmp_path, tiny_model)
    assert job_with(tmp_path, tiny_model, "adapt = false").hash() == default.hash()
    job = tmp_path / "job.toml"
    job.write_text(job.read_text().replace("[fallback]\n", "[fallback]\nadapt = true\n"))
    with pytest.raises(SpecError, match="fallback.adapt is not allowed.*sampling.adapt"):
        load_spec(job)


def test_an_engine_death_right_after_the_switch_loses_no_row(tmp_path, tiny_model):
    """The rows sent again with the new settings are in flight when the engine dies: the next engine takes them
    with pass 1's new settings, and every row still lands once."""
    spec = job_with(tmp_path, tiny_model)
    engines = FakeEngines(seed=1, max_in_flight=64, valid=0.1, sampled_valid=0.9)

    class DiesAfterTheSwitch(EngineWrapper):
        streams = 0

        def stream(self, prompts, stop=None):
            DiesAfterTheSwitch.streams += 1
            if DiesAfterTheSwitch.streams == 2:  # the first stream ended at the switch
                self.inner.die_after = 30
            return self.inner.stream(prompts, stop)

    report = run_job(spec, engine_factory=WrappedEngines(engines, DiesAfterTheSwitch), progress=False)
    out = Path(spec.output.path)
    assert_exactly_once([f"r{i:05d}" for i in range(ROWS)], out, out / "_rejects")
    assert len(engines.started) == 2 and "engine-restarted" in codes(report.passes["pass1"])
    assert engines.engines[1].decoding["p1"].temperature == 0.7  # the new engine decodes with the new settings
    assert report.passes["pass1"].recipe[0]["recipe"] == "fallback" and report.passes["pass1"].valid > 0.7 * ROWS

"""The default loop guard and the fallback's n candidates, on the real vLLM CPU engine with a tiny model."""

from __future__ import annotations

import pyarrow.dataset as ds
import pytest

from batchjson.engine import WrappedEngines
from batchjson.job import run_job
from batchjson.spec import LOOP_GUARD, LOOP_GUARD_BOUNDED, load_spec
from helpers import write_job, write_rows

pytestmark = pytest.mark.engine


class _Spy:
    """Records the sampling parameters per pass ("p1", "p2") that each stream decodes with: both passes share the
    engine and its stream, each request with its own pass's parameters."""

    def __init__(self, engine, seen):
        self._engine, self._seen = engine, seen

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream(self, *args, **kwargs):
        self._seen.append(dict(self._engine.params))
        return self._engine.stream(*args, **kwargs)


def spying(engines, seen):
    return WrappedEngines(engines, lambda engine: _Spy(engine, seen))


def guard_of(params):
    rd = params.repetition_detection
    return rd and {"max_pattern_size": rd.max_pattern_size, "min_pattern_size": rd.min_pattern_size,
                   "min_count": rd.min_count}


def test_default_loop_guard_reaches_both_passes(tmp_path, tiny_model, engines):
    write_rows(tmp_path / "in.parquet", 12)
    # No repetition_detection in the job; pass 1 cannot finish in 3 tokens, so pass 2 runs too.
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", max_tokens=3, fallback_max_tokens=64)
    assert "repetition_detection" not in job.read_text()
    seen = []
    report = run_job(load_spec(job), engine_factory=spying(engines, seen), progress=False)
    assert report.passes["pass2"].rows == 12
    # The tests' schema bounds its strings: the light guard. A schema without bounds gets LOOP_GUARD.
    assert len(seen) == 1  # one stream: pass 2 ran beside pass 1
    assert [guard_of(seen[0][stage]) for stage in ("p1", "p2")] == [LOOP_GUARD_BOUNDED, LOOP_GUARD_BOUNDED]
    unbounded = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", max_tokens=3, fallback_max_tokens=64,
                          schema={"type": "object", "properties": {"name": {"type": "string"}}})
    assert load_spec(unbounded).sampling.repetition_detection == LOOP_GUARD


def test_fallback_keeps_the_first_valid_of_n_candidates(tmp_path, tiny_model, engines):
    write_rows(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", max_tokens=3, fallback_max_tokens=64)
    job.write_text(job.read_text().replace("[fallback]\n", "[fallback]\nn = 3\nrepetition_detection = false\n"))
    seen = []
    report = run_job(load_spec(job), engine_factory=spying(engines, seen), progress=False)
    params = seen[-1]
    assert [params[stage].n for stage in ("p1", "p2")] == [1, 3] and guard_of(params["p2"]) is None
    p2 = report.passes["pass2"]
    assert p2.rows == 12 and p2.valid > 0
    valid = ds.dataset(str(tmp_path / "out"), format="parquet").to_table().to_pylist()
    chosen = [r for r in valid if r["_pass"] == 2]
    assert len(chosen) == p2.valid and len(valid) + report.rejected == 12
    # The pass counts the tokens of every candidate; each output row carries its own candidate's.
    assert p2.output_tokens > sum(r["_output_tokens"] for r in chosen)

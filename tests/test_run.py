"""End to end on the real vLLM CPU engine with a tiny random model: every row lands exactly once."""

from __future__ import annotations

import typing

import pyarrow.dataset as ds
import pytest

from batchjson.records import Reason
from batchjson.job import run_job
from batchjson.spec import load_spec
from helpers import assert_exactly_once, codes, write_job, write_rows

pytestmark = pytest.mark.engine

REASONS = set(typing.get_args(Reason))


def test_two_passes_cover_every_row(tmp_path, tiny_model, engines):
    data = write_rows(tmp_path / "in" / "a.parquet", 40)
    write_rows(tmp_path / "in" / "b.parquet", 13, start=40)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in"))
    report = run_job(spec, engine_factory=engines, progress=False)

    out, rejects = tmp_path / "out", tmp_path / "out" / "_rejects"
    assert_exactly_once([f"r{i:05d}" for i in range(53)], out, rejects)
    assert report.input_rows == 53 and report.valid + report.rejected == 53
    assert report.passes["pass1"].rows == 53
    # Whatever pass 1 did not get right went to pass 2, and nowhere else.
    assert report.passes.get("pass2") is None or report.passes["pass2"].rows == 53 - report.passes["pass1"].valid
    rejected = ds.dataset(str(rejects), format="parquet").to_table().to_pylist() if report.rejected else []
    assert {r["reason"] for r in rejected} <= REASONS
    assert all(r["detail"] for r in rejected)
    valid = ds.dataset(str(out), format="parquet").to_table()
    assert {"id", "source", "json", "name", "n", "_pass", "_finish_reason"} <= set(valid.column_names)
    assert (tmp_path / "out" / "_report.json").exists()
    assert data.exists()


def test_truncated_rows_are_rescued_by_a_larger_fallback_budget(tmp_path, tiny_model, engines):
    write_rows(tmp_path / "in.parquet", 12)
    # Pass 1 cannot finish any object in 3 tokens; the fallback has room.
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", max_tokens=3, fallback_max_tokens=64))
    report = run_job(spec, engine_factory=engines, progress=False)
    assert report.passes["pass1"].valid == 0
    assert report.passes["pass1"].reasons == {"truncated": 12}
    assert report.passes["pass2"].rows == 12
    assert report.valid_by_pass.get("pass2", 0) == report.passes["pass2"].valid > 0
    assert_exactly_once([f"r{i:05d}" for i in range(12)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_pass_one_takes_the_fallbacks_settings_when_its_own_fail(tmp_path, tiny_model, engines, monkeypatch):
    """Pass 1's budget cuts every row; once its first rows show it, the rest decode with the fallback's settings on
    the same engine, and pass 2 has only what still failed."""
    from batchjson.adapt import recipe

    monkeypatch.setattr(recipe, "JUDGE_ROWS", 8)
    write_rows(tmp_path / "in.parquet", 40)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", max_tokens=3, fallback_max_tokens=64))
    report = run_job(spec, engine_factory=engines, progress=False)
    p1 = report.passes["pass1"]
    (judged,) = p1.recipe
    assert judged["judged"]["sampling"] == {"rows": 8, "valid": 0}
    assert judged["recipe"] == "fallback"
    assert p1.valid > 0 and report.valid_by_pass.get("pass1", 0) == p1.valid
    assert report.passes.get("pass2") is None or report.passes["pass2"].rows == 40 - p1.valid
    assert report.to_dict()["engine_starts"] <= 1
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_rerun_resumes_without_redoing_or_duplicating(tmp_path, tiny_model, engines):
    write_rows(tmp_path / "in.parquet", 20)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))
    first = run_job(spec, engine_factory=engines, progress=False)
    again = run_job(spec, engine_factory=engines, progress=False)
    assert again.resumed and again.passes == {}
    assert (again.valid, again.rejected) == (first.valid, first.rejected)
    assert_exactly_once([f"r{i:05d}" for i in range(20)], tmp_path / "out", tmp_path / "out" / "_rejects")


@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_pass_two_reuses_the_engine_when_its_settings_allow(tmp_path, tiny_model, engines, speculative):
    """The fallback's sampling is per request, and on a speculative engine its requests skip the draft: one engine
    start for both passes, with or without speculation in pass 1 (the run's starts counted, on the shared engines)."""
    from batchjson.engine import WrappedEngines

    write_rows(tmp_path / "in.parquet", 12)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", max_tokens=3, speculative=speculative))
    starts = []
    report = run_job(spec, engine_factory=WrappedEngines(engines, lambda e: starts.append(e) or e), progress=False)
    assert len(starts) == 1
    assert report.passes["pass2"].rows == 12 and "shared-engine" in codes(report.passes["pass2"])
    assert report.valid_by_pass.get("pass2", 0) > 0  # the fallback's own budget and sampling were used
    d = report.to_dict()
    assert d["passes"]["pass1"]["failed_output_token_share"] == 1.0
    assert d["passes"]["pass2"]["gpu_seconds_per_valid_row"] > 0 and d["gpu_seconds_per_valid_row"] > 0
    assert_exactly_once([f"r{i:05d}" for i in range(12)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_suffix_job_runs_and_reports_speculation(tmp_path, tiny_model, engines):
    """method = "suffix" on the real engine: drafts come from the suffix trees and the report counts them."""
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:
        pytest.skip("arctic_inference is not installed: `make install` builds it (bench/gpu/arctic_wheel.py)")
    write_rows(tmp_path / "in.parquet", 24)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="suffix"))
    report = run_job(spec, engine_factory=engines, progress=False)
    pass1 = report.to_dict()["passes"]["pass1"]
    # Rows share the schema's keys, so the global suffix tree drafts them once earlier rows are cached.
    assert pass1["speculative"]["drafts"] > 0 and pass1["speculative"]["draft_tokens"] > 0
    assert 0 < pass1["acceptance"] <= 1
    assert_exactly_once([f"r{i:05d}" for i in range(24)], tmp_path / "out", tmp_path / "out" / "_rejects")

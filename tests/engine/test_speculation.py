"""speculative.method = "auto": the policy's choices, and a pass that switches engines mid-way losing no row."""

from __future__ import annotations

import pytest

from batchjson.adapt.audit import Audit
from batchjson.adapt.base import KEEP
from batchjson.adapt import auto as speculation
from batchjson.engine.base import EngineFacts
from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.spec import SpeculativeSpec, load_spec
from helpers import assert_exactly_once, codes, write_job, write_rows  # noqa: E402

AUTO = SpeculativeSpec(method="auto")


def feed(auto, rows, tokens=100, seconds=1.0, steps=100, stats=None):
    """The config auto switches to after these rows, or "stay"."""
    for _ in range(rows):
        if auto.add(tokens):
            auto.measure(seconds * auto.trials[-1].rows / rows, steps, stats)
            answer = auto.decide()
            return "stay" if answer is KEEP else answer.speculative
    return "stay"


def test_prior_follows_the_measured_speedups(monkeypatch):
    monkeypatch.setattr(speculation, "draft_method", lambda: "suffix")
    for in_flight in (1, 16, 512):  # 1.34x, 1.65x (at 8) and 1.38x
        chosen = speculation.Auto(AUTO, in_flight, "gpu", 10_000).current()
        assert chosen.method == "suffix" and chosen.num_speculative_tokens == 8
    assert speculation.Auto(AUTO, 16, "cpu", 10_000).current() is None
    # The default max_in_flight (None) fills the engine's batch: there no speculation was faster (0.88x)
    full = speculation.Auto(AUTO, None, "gpu", 10_000)
    assert full.current() is None and full.sample == 2048
    assert "a full engine batch" in full.to_dict()["why"]
    monkeypatch.setattr(speculation, "draft_method", lambda: "ngram")
    assert speculation.Auto(AUTO, 1, "gpu", 10_000).current() is None  # ngram 0.97x at 1 in flight


def test_prior_follows_the_model_size(monkeypatch):
    """On the 1.5B target (3.1 GB of weights) suffix decoding paid at 16 in flight (1.48x) and lost at 64 (0.85x):
    auto starts with suffix only with few requests in flight there, where SmolLM2's numbers (0.27 GB) say 64 pays."""
    monkeypatch.setattr(speculation, "draft_method", lambda: "suffix")
    big = dict(weights_gb=3.1)
    assert speculation.Auto(AUTO, 16, "gpu", 10_000, **big).current().method == "suffix"
    at_64 = speculation.Auto(AUTO, 64, "gpu", 10_000, **big)
    assert at_64.current() is None and at_64.prior == 0.85
    assert "with a 3.1 GB model" in at_64.to_dict()["why"] and at_64.to_dict()["weights_gb"] == 3.1
    assert speculation.Auto(AUTO, 64, "gpu", 10_000, weights_gb=0.3).current().method == "suffix"  # 2.29x at 32
    assert speculation.Auto(AUTO, 64, "gpu", 10_000, weights_gb=14.0).prior == 0.85  # the nearest size measured
    # A method measured on one size only is judged by that size's numbers at every size.
    assert speculation.predicted_speedup("gpu", "draft_model", 1024, 0.27) == 0.72
    assert speculation.predicted_speedup("gpu", "eagle", 16, 3.1) == 1.0  # unmeasured: no gain assumed


def test_on_vllm_034_the_prior_is_what_model_runner_v2_measured(monkeypatch):
    """vLLM 0.34 runs every drafter on Model Runner V2: on the 1.5B suffix decoding gained x1.29 at 64 in flight
    there with 8 drafts a request (it lost, x0.85, on 0.26's V1 runner); at a full batch, with 2 drafts, about x0.9 of
    batchjson's none (estimated): auto starts without drafts there and tries suffix decoding on a long pass; its suffix
    speculator is vLLM's own, so auto tries it without arctic-inference."""
    from batchjson.engine.vllm import versions

    big = dict(weights_gb=3.1)
    monkeypatch.setattr(speculation, "draft_method", lambda: "suffix")
    at_64 = speculation.Auto(AUTO, 64, "gpu", 10_000, **big, mrv2=True)
    assert at_64.current().method == "suffix" and at_64.prior == 1.29
    assert at_64.current().num_speculative_tokens == 8
    assert speculation.Auto(AUTO, 64, "gpu", 10_000, **big).current() is None  # 0.26's V1 runner: x0.85
    full = speculation.Auto(AUTO, None, "gpu", 10_000, **big, mrv2=True)  # vLLM's batch of 1,024
    assert full.current() is None and full.prior == 0.9
    assert (full.candidate.method, full.candidate.num_speculative_tokens) == ("suffix", 2)  # with 8: x0.88
    full.trials[-1] = speculation.Trial("none", rows=full.sample, tokens=100, seconds=100.0, start_s=1.0)
    assert full.decide().speculative.num_speculative_tokens == 2  # a long pass tries it on its own rows
    assert speculation.Auto(AUTO, None, "gpu", 10_000, **big).current() is None  # 0.26: x0.57 at 1,024
    assert speculation.Auto(AUTO, None, "gpu", 10_000, weights_gb=0.27, mrv2=True).current() is None  # SmolLM2: x0.88
    assert speculation.Auto(AUTO, 16, "gpu", 10_000, **big, mrv2=True).prior == 1.48  # 0.26's, unmeasured on 0.34
    assert speculation.predicted_speedup("gpu", "schema", 1024, 3.1, mrv2=True) == 0.61
    monkeypatch.undo()
    monkeypatch.setattr(speculation.importlib.util, "find_spec", lambda name, *a: None)  # no arctic-inference
    for version, method, mrv2 in (("0.34.0", "suffix", True), ("0.32.0", "ngram", False), (None, "ngram", False)):
        monkeypatch.setattr(versions, "installed_version", lambda v=version: v)
        assert (speculation.draft_method(), speculation.on_model_runner_v2()) == (method, mrv2), version


def test_a_short_pass_keeps_the_first_choice():
    auto = speculation.Auto(AUTO, 8, "cpu", 100)
    auto.started(30.0)
    assert feed(auto, 64, seconds=10.0) == "stay"
    assert "too short" in auto.decided and auto.to_dict()["chosen"] == "none"


def test_a_long_pass_tries_the_other_choice_and_keeps_the_faster():
    auto = speculation.Auto(AUTO, 8, "cpu", 100_000)
    auto.started(30.0)
    other = feed(auto, 64, seconds=10.0)
    assert other is not None and other.method in ("ngram", "suffix")
    auto.started(30.0)
    assert feed(auto, 64, seconds=5.0, stats={"draft_tokens": 400, "accepted_tokens": 300}) == "stay"
    report = auto.to_dict()
    assert report["chosen"] == other.method and "2.00x" in report["why"]
    assert report["trials"][1]["acceptance"] == 0.75


def test_a_slower_trial_goes_back():
    auto = speculation.Auto(AUTO, 8, "cpu", 100_000)
    auto.started(30.0)
    feed(auto, 64, seconds=10.0)
    assert feed(auto, 64, seconds=20.0) is None  # back to no speculation
    assert auto.to_dict()["chosen"] == "none"


@pytest.mark.parametrize("spec_delay, chosen", [(0.0005, "ngram"), (0.02, "none")])
def test_auto_switches_engines_mid_pass_and_loses_no_row(tmp_path, tiny_model, monkeypatch, spec_delay, chosen):
    monkeypatch.setattr(speculation, "TRIAL_PAYS", 0.0)  # any pass is long enough for a trial
    monkeypatch.setattr(speculation, "draft_method", lambda: "ngram")
    write_rows(tmp_path / "in.parquet", 300)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=8, speculative="auto")
    job.write_text(job.read_text().replace("[fallback]\n", "[fallback]\nenabled = false\n"))  # no next pass to pay for
    engines = FakeEngines(valid=0.8, delay=0.005, spec_delay=spec_delay)
    report = run_job(load_spec(job), engine_factory=engines, progress=False)
    assert_exactly_once([f"r{i:05d}" for i in range(300)], tmp_path / "out", tmp_path / "out" / "_rejects")
    (choice,) = report.passes["pass1"].auto
    assert choice["chosen"] == chosen, choice
    assert [t["method"] for t in choice["trials"]][:2] == ["none", "ngram"]
    assert report.verified["ok"] and report.verified["complete"]


@pytest.mark.engine
def test_auto_on_the_engine_keeps_none_for_a_short_pass_and_pass2_reuses_it(tmp_path, tiny_model, engines):
    """A minimal job (no [speculative] table) on the CPU: auto decodes without speculation, the report says why,
    and the fallback runs on pass 1's engine (one engine start for the run)."""
    write_rows(tmp_path / "in.parquet", 24)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    job.write_text(job.read_text().replace('[speculative]\nmethod = "ngram"\n', ""))
    spec = load_spec(job)
    assert spec.speculative.method == "auto"
    starts = engines.starts
    report = run_job(spec, engine_factory=engines, progress=False)
    (choice,) = report.passes["pass1"].auto
    assert choice["chosen"] == "none" and choice["platform"] == "cpu", choice
    assert report.passes["pass1"].speculative == {}
    if "pass2" in report.passes:
        assert "shared-engine" in codes(report.passes["pass2"])
        assert report.passes["pass2"].engine_starts == 0
    assert engines.starts - starts <= 1
    assert report.to_dict()["engine_starts"] == 1
    assert_exactly_once([f"r{i:05d}" for i in range(24)], tmp_path / "out", tmp_path / "out" / "_rejects")


@pytest.mark.engine
def test_auto_trial_on_the_engine_hands_rows_in_flight_to_the_next_engine(tmp_path, tiny_model, engines, monkeypatch):
    """A long pass (TRIAL_PAYS = 0): auto measures none, then the draft method, on real engines; the rows in flight
    at each switch are decoded by the next engine, none lost or doubled."""
    monkeypatch.setattr(speculation, "TRIAL_PAYS", 0.0)
    write_rows(tmp_path / "in.parquet", 160)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=8, speculative="auto")
    report = run_job(load_spec(job), engine_factory=engines, progress=False)
    (choice,) = report.passes["pass1"].auto
    methods = [t["method"] for t in choice["trials"]]
    assert methods[:2] == ["none", speculation.draft_method()], choice
    assert choice["trials"][1]["ms_per_step"] and choice["trials"][1]["tokens_per_step"]
    assert "acceptance" in choice["trials"][1]
    assert report.passes["pass1"].rows == 160
    assert_exactly_once([f"r{i:05d}" for i in range(160)], tmp_path / "out", tmp_path / "out" / "_rejects")
    assert report.verified["ok"] and report.verified["complete"]


@pytest.mark.parametrize("trial_s, chosen", [(5.0, "suffix"), (9.8, "none")])
def test_a_speculative_trial_is_kept_only_if_it_is_faster(trial_s, chosen, monkeypatch):
    """512 rows took 10 s without speculation; the rest of the pass is ~3,000 s, long enough for a trial. Suffix at 2x
    is kept; at 1.02x (within a run's spread) auto goes back to none."""
    monkeypatch.setattr(speculation, "draft_method", lambda: "suffix")
    monkeypatch.setitem(speculation.MEASURED_SPEEDUP["gpu"][0.27], "suffix", {256: 1.0})  # the prior: none first
    auto = speculation.Auto(AUTO, 256, "gpu", 160_000)
    assert auto.current() is None
    auto.started(20.0)
    trial = feed(auto, 512, seconds=10.0)
    assert trial is not None and trial.method == "suffix"
    auto.started(20.0)
    assert feed(auto, 512, seconds=trial_s) == ("stay" if chosen != "none" else None)
    report = auto.to_dict()
    assert report["chosen"] == chosen, report


def test_a_draft_method_that_cannot_start_gives_way_to_none(monkeypatch):
    monkeypatch.setattr(speculation, "draft_method", lambda: "suffix")
    auto = speculation.Auto(AUTO, 16, "gpu", 10_000)
    assert auto.current().method == "suffix"
    auto.could_not_start("vLLM could not start with model m: no module named arctic_inference")
    assert auto.current() is None and feed(auto, 64) == "stay"  # decided: no trial after that
    report = auto.to_dict()
    assert report["chosen"] == "none" and "suffix could not start here" in report["why"]
    assert [t["method"] for t in report["trials"]] == ["none"]


@pytest.mark.engine
def test_auto_goes_on_without_speculation_when_its_engine_cannot_start(tmp_path, tiny_model, engines, monkeypatch):
    """auto's speculative engine is refused by vLLM at start (here: an option it does not know). The user asked for
    none of it, so the job goes on without speculation, every row once, and the report says why."""
    monkeypatch.setattr(speculation, "MEASURED_SPEEDUP", {"cpu": {0.27: {"ngram": {1: 2.0}, "suffix": {1: 2.0}}}})
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="auto")
    job.write_text(job.read_text().replace("[fallback]\n", "[fallback]\nenabled = false\n")  # auto speculates at once
                   + "\n[speculative.options]\nno_such_option = 1\n")
    report = run_job(load_spec(job), engine_factory=engines, progress=False)
    (choice,) = report.passes["pass1"].auto
    assert choice["chosen"] == "none" and "could not start here" in choice["why"], choice
    assert "no_such_option" in choice["why"]
    assert report.passes["pass1"].speculative == {}
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")
    assert report.verified["ok"] and report.verified["complete"]


@pytest.mark.parametrize("method, no_draft, starts", [("ngram", True, 1), ("auto", True, 1), ("ngram", False, 2),
                                                       ("auto", False, 1)])
def test_both_passes_share_one_engine_start_and_pass_2_never_drafts(tmp_path, tiny_model, method, no_draft, starts):
    """Pass 2 runs on pass 1's speculative engine, its requests without a draft; only an engine that cannot skip
    drafts per request makes pass 2 start its own (and then auto does not speculate at all)."""
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative=method, batch_size=4)
    engines = FakeEngines(valid=0.5, no_draft=no_draft)
    report = run_job(load_spec(job), engine_factory=engines, progress=False).to_dict()
    assert report["passes"]["pass2"]["rows"] > 0
    assert report["engine_starts"] == starts, report
    assert [report["passes"][p]["engine_starts"] for p in ("pass1", "pass2")] == [1, starts - 1]
    assert report["engine_start_s"] >= 0
    # Seconds from the run's start to each pass's first request: pass 2's comes after pass 1's first commit
    assert 0 <= report["passes"]["pass1"]["first_request_s"] <= report["passes"]["pass2"]["first_request_s"]
    assert sum(e.stages["p2"] for e in engines.engines) == report["passes"]["pass2"]["rows"]
    assert sum(e.drafted["p2"] for e in engines.engines) == 0  # the target alone decoded every pass-2 row
    if method == "ngram":
        assert sum(e.drafted["p1"] for e in engines.engines) == report["passes"]["pass1"]["rows"]
    if starts == 1:
        assert "shared-engine" in codes(report["passes"]["pass2"])
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_a_configured_draft_model_is_the_candidate_judged_like_the_others():
    spec = SpeculativeSpec(method="auto", draft_model="/models/draft", num_speculative_tokens=5)
    full = speculation.Auto(spec, None, "gpu", 1_000_000)  # measured 0.72x at a full batch: starts without
    assert full.current() is None and full.candidate.method == "draft_model"
    assert full.candidate.num_speculative_tokens == 5 and full.candidate.draft_model == "/models/draft"
    full.started(30.0)
    trial = feed(full, full.sample, seconds=10.0)  # a long pass tries the draft model
    assert trial is not None and trial.method == "draft_model"


def test_an_audited_row_that_differs_without_drafts_turns_speculation_off_and_loses_no_row(tmp_path):
    """The speculation audit found a row whose answer without drafts differs: pass 1 goes on on an engine without
    drafts (the rows in flight move to it), the report says why, every row once."""
    class Differing(FakeEngines):
        def start(self, spec, decoding, speculative):
            engine = super().start(spec, decoding, speculative)
            if speculative is not None:
                engine.told = EngineFacts(audited=3, differ=1)
            return engine

    write_rows(tmp_path / "in.parquet", 48)
    job = write_job(tmp_path, "default", tmp_path / "in.parquet", speculative="ngram", batch_size=4)
    engines = Differing()
    report = run_job(load_spec(job), engine_factory=engines, progress=False)
    assert [s is not None for _, s in engines.started] == [True, False]  # drafts, then none for the rest
    assert engines.engines[1].drafted["p1"] == 0 and engines.engines[1].stages["p1"] > 0
    assert "speculation-off" in codes(report.passes["pass1"])
    assert "1 of the 3 rows audited" in report.passes["pass1"].note
    assert_exactly_once([f"r{i:05d}" for i in range(48)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_no_audit_where_speculation_is_off_or_the_audit_is():
    assert Audit.for_job(SpeculativeSpec(method="ngram")) is not None
    assert Audit.for_job(SpeculativeSpec(method="none")) is None
    assert Audit.for_job(SpeculativeSpec(method="ngram", audit_rows=0)) is None


def test_at_a_full_batch_the_schema_drafts_are_the_candidate_and_too_slow_to_try(monkeypatch):
    """On the 1.5B at a full batch the schema drafts were measured x0.79 of none (run30) and suffix decoding x0.57:
    auto starts without drafts, names the schema drafts as the candidate, and a long pass does not try them (a trial
    would cost slower rows and two engine starts); the report says why. A candidate measured near none is still
    tried. With few requests in flight suffix was faster (x1.48 at 16) and stays the candidate, and no speculation
    is still tried against it; without a JSON Schema or an engine that can make them, the schema drafts are never
    the candidate."""
    monkeypatch.setattr(speculation, "draft_method", lambda: "suffix")
    big = dict(weights_gb=3.1)
    full = speculation.Auto(AUTO, None, "gpu", 1_000_000, schema_drafts=True, **big)
    assert full.current() is None and full.candidate.method == "schema"
    assert full.candidate.num_speculative_tokens == 8 and full.prior < speculation.WORTH_TRYING
    full.started(30.0)
    assert feed(full, full.sample, seconds=10.0) == "stay"
    assert full.to_dict()["why"] == ("kept none: schema was measured at 0.79x none at this size, too slow to be "
                                     "worth a trial")
    monkeypatch.setitem(speculation.MEASURED_SPEEDUP["gpu"][3.1], "schema", {1024: 1.0})
    near = speculation.Auto(AUTO, None, "gpu", 1_000_000, schema_drafts=True, **big)
    near.started(30.0)
    trial = feed(near, near.sample, seconds=10.0)
    assert trial is not None and trial.method == "schema"
    few = speculation.Auto(AUTO, 16, "gpu", 10_000_000, schema_drafts=True, **big)
    assert few.current().method == "suffix"
    few.started(30.0)
    assert feed(few, few.sample, seconds=10.0) is None  # the switch to none
    assert few.trials[-1].method == "none"
    assert speculation.Auto(AUTO, None, "gpu", 1_000_000, **big).candidate.method == "suffix"
    assert speculation.Auto(AUTO, None, "cpu", 1_000_000, schema_drafts=True).candidate.method == "suffix"


@pytest.mark.parametrize("can, tried", [(True, "schema"), (False, "ngram")])
def test_a_long_pass_tries_the_schema_drafts_only_where_the_engine_can_make_them(tmp_path, tiny_model, monkeypatch,
                                                                                  can, tried):
    """Where the schema drafts were measured the faster speculative method, a long pass tries them on an engine
    that can make them, and the lookup method elsewhere; every row once either way."""
    monkeypatch.setattr(speculation, "TRIAL_PAYS", 0.0)
    monkeypatch.setattr(speculation, "draft_method", lambda: "ngram")
    monkeypatch.setattr(speculation, "MEASURED_SPEEDUP", {"cpu": {0.27: {"ngram": {1: 0.9}, "schema": {1: 1.0}}}})
    write_rows(tmp_path / "in.parquet", 200)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=8, speculative="auto")
    engines = FakeEngines(valid=1.0, delay=0.001, schema_drafts=can)
    report = run_job(load_spec(job), engine_factory=engines, progress=False)
    (choice,) = report.passes["pass1"].auto
    assert [t["method"] for t in choice["trials"]][:2] == ["none", tried], choice
    assert [s.method for _, s in engines.started if s is not None][:1] == [tried]
    assert_exactly_once([f"r{i:05d}" for i in range(200)], tmp_path / "out", tmp_path / "out" / "_rejects")


@pytest.mark.parametrize("engine_batch, first", [(8, "ngram"), (None, "none")])
def test_auto_judges_the_engines_batch_where_the_job_sets_it_smaller(tmp_path, tiny_model, monkeypatch,
                                                                     engine_batch, first):
    """A job that caps the engine's batch ([model.engine] max_num_seqs) decodes that many requests at once whatever
    max_in_flight keeps waiting: auto starts with the choice measured faster at that size."""
    monkeypatch.setattr(speculation, "draft_method", lambda: "ngram")
    monkeypatch.setattr(speculation, "MEASURED_SPEEDUP", {"cpu": {0.27: {"ngram": {8: 1.5, 64: 0.5}}}})
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="auto")
    engine = f"\n[model.engine]\nmax_num_seqs = {engine_batch}\n" if engine_batch else ""
    job.write_text(job.read_text().replace("max_in_flight = 16\n", "max_in_flight = 64\n" + engine))
    report = run_job(load_spec(job), engine_factory=FakeEngines(valid=1.0, delay=0.001), progress=False)
    (choice,) = report.passes["pass1"].auto
    assert choice["trials"][0]["method"] == first, choice
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")

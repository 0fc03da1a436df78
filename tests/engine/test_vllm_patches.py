"""What the plugin installs in vLLM's engine processes (engine/plugin.py, engine/vllm/, profiler.py): the step
profiler, and the plugin itself in a forked engine process; the versions the patches were read on, and what a run on
another vLLM reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from batchjson.engine.base import EngineFacts
from batchjson.engine.fake import FakeEngines
from batchjson.engine.profiler import DUMP_EVERY_S, read_profile
from batchjson.engine.vllm import scheduler, timers, versions
from batchjson.job import run_job
from batchjson.records import Prompt
from batchjson.report import PassStats, RunReport
from batchjson.spec import DecodingSpec, ModelSpec, SpeculativeSpec, load_spec
from helpers import ANSWER_PROMPTS, TINY_SCHEMA, codes, write_job, write_rows

PROMPTS = ANSWER_PROMPTS  # the answer's JSON is in the prompt: n-gram lookup finds drafts even for a random model


@pytest.mark.engine
def test_pass_2_requests_take_no_draft_and_the_step_profiler_times_each_part_of_a_speculative_step(
        tiny_model, monkeypatch, tmp_path):
    """Both passes on one speculative engine: pass-2 requests (no draft) get no draft tokens, pass-1 ones do. The
    step profiler, on in that engine's processes, times each part of its steps (one engine start for both)."""
    from batchjson.engine import VllmEngine

    profile = tmp_path / "profile.json"
    monkeypatch.setenv("BATCHJSON_PROFILE_STEPS", str(profile))
    model = ModelSpec(path=tiny_model, dtype="float32", max_model_len=512, max_in_flight=16)
    engine = VllmEngine(model, DecodingSpec(max_tokens=40), TINY_SCHEMA,
                        SpeculativeSpec(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, audit_rows=0))
    try:
        assert engine.no_draft and engine.accepts(DecodingSpec(max_tokens=30), None)
        # the report names every patch this vLLM leaves off (versions.py's table), and only those
        off = versions.off_here(versions.vllm_version())
        assert "no_draft" not in off and "fast_loop_guard" not in off
        assert engine.notice_code == ("patches-off" if off else "")
        assert [name for name in versions.PATCHES if f"{name} (" in engine.notice] == list(off)
        engine.use(DecodingSpec(max_tokens=40), "p2", draft=False)
        second = list(engine.stream(Prompt(str(i), "u", text, stage="p2") for i, text in enumerate(PROMPTS)))
        after_second = engine.stats()["draft_tokens"]
        first = list(engine.stream(Prompt(str(i), "u", text) for i, text in enumerate(PROMPTS)))
        after_first = engine.stats()["draft_tokens"]
    finally:
        engine.close()
    assert len(second) == len(first) == len(PROMPTS)
    assert sum(g.output_tokens for g in second) > len(PROMPTS)  # they decoded, many steps each
    assert after_second == 0  # the target alone decoded pass 2
    assert after_first > 0  # the same engine drafts for pass 1
    got = read_profile(profile)
    assert got["steps"] > 0 and not got["errors"]
    # the batch's size per step: every step schedules a request, drafted tokens are among the scheduled ones
    assert got["steps"] <= got["scheduled_requests"] <= 16 * got["steps"]
    assert 0 < got["drafted_tokens"] < got["scheduled_tokens"]
    for part in ("schedule", "grammar_bitmask", "forward", "sample_tokens", "rejection_sampler", "propose",
                 "update_from_output", "engine_step", "gc"):
        assert got["parts"][part]["count"] > 0 and got["parts"][part]["seconds"] > 0, part


def profiled(engine, profile) -> dict:
    """The step profile of everything `engine` has decoded so far, exact: its processes write their counts at most
    every DUMP_EVERY_S while they step, so after that long idle, a pass-2 request of one token makes each write what
    came before it (its own first step's parts, no draft's, may be counted here or in what comes next)."""
    time.sleep(DUMP_EVERY_S + 0.1)
    engine.use(DecodingSpec(max_tokens=1), "p2", draft=False)
    list(engine.stream([Prompt("probe", "u", PROMPTS[0], stage="p2")]))
    return read_profile(profile)


@pytest.mark.engine
def test_a_draft_model_runs_no_forward_in_a_step_mostly_of_pass_2_requests(tiny_model, monkeypatch, tmp_path):
    """A draft-model engine decoding pass-2 requests alone (pass 1 done): no drafter forward in any step (the step
    profiler counts the model runner's propose_draft_token_ids), where pass-1 requests on the same engine are
    drafted for. Mixed, one pass-1 request in four: the drafter runs in few steps, and every request ends. The three,
    in that order, on one engine (a start is 35-45 s on two cores). Its start holds the start-up probe's abort back a
    second, so that the probe is stepped (it once ran the drafter when its abort came late)."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from batchjson.engine import VllmEngine

    abort = LLMEngine.abort_request

    def late_abort(*args, **kwargs):
        time.sleep(1.0)
        return abort(*args, **kwargs)

    profile = tmp_path / "profile.json"
    monkeypatch.setenv("BATCHJSON_PROFILE_STEPS", str(profile))
    model = ModelSpec(path=tiny_model, dtype="float32", max_model_len=512, max_in_flight=16)
    with monkeypatch.context() as starting:
        starting.setattr(LLMEngine, "abort_request", late_abort)
        engine = VllmEngine(model, DecodingSpec(max_tokens=40), TINY_SCHEMA,
                            SpeculativeSpec(method="draft_model", draft_model=tiny_model, num_speculative_tokens=2))
    profiles, drafted = [], []  # after each stage: the profile so far, the draft tokens so far
    try:
        for stage in ("p2", "p1", "mixed"):
            stages = {i: stage if stage != "mixed" else ("p1" if i % 4 == 0 else "p2") for i in range(len(PROMPTS))}
            for used in set(stages.values()):
                engine.use(DecodingSpec(max_tokens=40), used, draft=used == "p1")
            gens = list(engine.stream(Prompt(str(i), "u", text, stage=stages[i]) for i, text in enumerate(PROMPTS)))
            assert len(gens) == len(PROMPTS) and sum(g.output_tokens for g in gens) > len(PROMPTS), stage
            drafted.append(engine.stats()["draft_tokens"])
            if stage != "mixed":
                profiles.append(profiled(engine, profile))
    finally:
        engine.close()
    profiles.append(read_profile(profile))  # written whole at the engine's shutdown
    assert not profiles[-1]["errors"]
    totals = [(p["steps"], p["parts"].get("propose", {}).get("count", 0), d) for p, d in zip(profiles, drafted)]
    # each stage's own: steps, drafter forwards (propose), draft tokens
    p2, p1, mixed = (tuple(b - a for a, b in zip(before, after)) for before, after in
                     zip([(0, 0, 0)] + totals, totals))
    assert all(stage[0] > len(PROMPTS) // 16 for stage in (p2, p1, mixed)), (p2, p1, mixed)
    assert p2[1:] == (0, 0), p2
    assert p1[1] > 0 and p1[2] > 0, p1
    assert mixed[1] < mixed[0] // 4, mixed


def test_the_idle_drafter_patch_counts_the_requests_of_the_step():
    """The model runner's drafter is idle when at most half of the step's requests want drafts, and only for a
    draft model; otherwise vLLM's own answer stands. The installed vLLM is one the patch was read on."""
    from types import SimpleNamespace as NS

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert scheduler.install_idle_drafter() == "ok"
    no, yes = NS(sampling_params=NS(extra_args={scheduler.NO_DRAFT: True})), NS(sampling_params=NS(extra_args=None))
    both = {"a": no, "b": yes}
    assert scheduler.few_drafted(both, ["a", "a"])
    assert scheduler.few_drafted(both, ["a", "b"])  # half: the drafter's forwards would cost the other half
    assert scheduler.few_drafted(both, ["a", "a", "b"])
    assert not scheduler.few_drafted(both, ["a", "b", "b"])  # most of the step is drafted for
    assert not scheduler.few_drafted(both, ["b"])
    assert not scheduler.few_drafted({}, [])  # an empty step: vLLM decides
    twin = NS(sampling_params=NS(extra_args={scheduler.NO_DRAFT: True, scheduler.AUDIT_TWIN: True}))
    assert not scheduler.few_drafted(both | {"t": twin}, ["b", "t", "t"])  # audit twins do not idle the drafter

    def runner(draft_model: bool, ids: list[str]):
        return NS(speculative_config=NS(uses_draft_model=lambda: draft_model, use_dflash=lambda: False),
                  requests={"a": no, "b": yes}, input_batch=NS(req_ids=ids), num_spec_tokens=2,
                  effective_drafter_max_model_len=512)

    fits = GPUModelRunner._input_fits_in_drafter
    meta = NS(max_seq_len=100)
    assert fits(runner(True, ["a"]), meta) is False  # pass 2 alone: no draft forward
    assert fits(runner(True, ["a", "b", "b"]), meta) is True  # mostly pass 1: vLLM's answer
    assert fits(runner(True, ["a", "a", "b"]), meta) is False  # mostly pass 2: none
    assert fits(runner(False, ["a"]), meta) is True  # ngram, suffix: untouched
    assert fits(runner(True, ["b"]), NS(max_seq_len=511)) is False  # vLLM's own reason still holds


def test_plugin_runs_again_in_a_forked_engine_process():
    """On CUDA vLLM forks its engine process from the runner, whose vllm.plugins.plugins_loaded is already True:
    the runner's at-fork hook clears it in the child, so vLLM loads the plugin there. The runner is a fresh
    Python, as a user's is: forking this many-threaded test process could hang in another library's fork hook."""
    runner = textwrap.dedent("""
        import os
        import vllm.plugins
        from batchjson.engine import plugin

        os.environ["BATCHJSON_RUNNER_PID"] = str(os.getpid())
        vllm.plugins.plugins_loaded = True
        plugin.register()  # the runner: nothing but the hook
        assert vllm.plugins.plugins_loaded
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"0" if vllm.plugins.plugins_loaded else b"1")
            os._exit(0)
        os.waitpid(pid, 0)
        print("child loads plugins:", os.read(r, 1) == b"1")
    """)
    done = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "child loads plugins: True" in done.stdout


def test_profiler_records_skips_and_errors(monkeypatch, tmp_path):
    """A part this vLLM lacks is skipped and recorded; an error during install is written to the file and never
    raised."""
    from batchjson.engine import profiler

    profile = tmp_path / "p.json"
    monkeypatch.setattr(timers, "TIMED", timers.TIMED + (
        ("vllm.v1.no_such_module", "X", "y", "y", False), ("vllm.v1.engine.core", "EngineCore", "no_such", "z", False)))
    profiler.install_profiler(profile, sync=False)
    got = read_profile(profile)
    assert got["patches"]["v1.no_such_module.X.y"].startswith("skipped: import")
    assert got["patches"]["v1.engine.core.EngineCore.no_such"] == "skipped: EngineCore.no_such not found"
    assert got["patches"]["v1.core.sched.scheduler.Scheduler.schedule"] == "ok" and not got["errors"]

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(profiler, "install_profiler", boom)
    monkeypatch.setattr(profiler, "INSTALLED", False)
    monkeypatch.setenv(profiler.ENV_PROFILE, str(tmp_path / "q.json"))
    profiler.install()
    data = json.loads((tmp_path / "q.json").read_text())
    assert "boom" in data["error"] and read_profile(tmp_path / "q.json")["errors"]


def test_the_grammar_warning_flood_of_an_engine_process_is_counted_not_printed():
    """What xgrammar's C++ writes to fd 2 under speculation: thousands of one line. The rest passes unchanged."""
    flood = "[12:00:01] grammar_matcher.cc:42: Warning: The matcher has terminated after accepting the stop token, " \
            "but is trying to accept new token with id 7"
    code = textwrap.dedent(f"""
        import os, sys
        from batchjson.engine.quiet import quiet_floods
        quiet_floods()
        os.write(2, b"engine started\\n")
        for _ in range(3000):
            os.write(2, {flood!r}.encode() + b"\\n")
        print("a Python traceback line", file=sys.stderr, flush=True)
        os.write(2, b"no newline at the end")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert "engine started" in lines and "a Python traceback line" in lines
    assert not any("matcher has terminated" in line and "hid" not in line for line in lines), lines[:5]
    assert any(line.startswith("batchjson: hid 3000 repeated grammar warning line(s)") for line in lines), lines
    assert "no newline at the end" in done.stderr
    raw = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=os.environ | {"BATCHJSON_ENGINE_STDERR": "raw"})
    assert raw.stderr.count("matcher has terminated") == 3000



def test_the_fast_loop_guard_answers_as_vllms_own_check():
    """scheduler.repeats replaces vLLM's per-token repetition check in the engine core: same answer on every
    sequence (random ones, many of them ending in repeats), on the token lists vLLM passes (ConstantList)."""
    import random

    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched import utils
    from vllm.v1.utils import ConstantList

    assert scheduler.install_fast_loop_guard() == "ok"
    assert utils.check_sequence_repetition is scheduler.repeats
    vllms = scheduler.VLLM_CHECK
    assert vllms is not scheduler.repeats and vllms.__module__ == "vllm.v1.core.sched.utils"
    rng, hits = random.Random(7), 0
    for _ in range(20_000):
        size = rng.randrange(0, 70)
        guard = RepetitionDetectionParams(size, rng.randrange(0, size + 1), rng.randrange(2, 6) if size else 0)
        seq = [rng.randrange(rng.choice((2, 3, 50))) for _ in range(rng.randrange(1, 80))]
        if rng.random() < 0.7:
            seq += rng.randrange(1, 6) * seq[-rng.randrange(1, 20):]
        if rng.random() < 0.3:
            seq.append(rng.randrange(3))
        expected = vllms(ConstantList(seq), guard)
        assert scheduler.repeats(ConstantList(seq), guard) == expected, (seq, guard)
        hits += expected
    assert 2_000 < hits < 18_000  # both answers were tested often


def test_the_plugin_installs_both_scheduler_patches_in_an_engine_process():
    """In a process vLLM starts for a batchjson run (not the runner), the plugin replaces the loop check and wraps
    the scheduler."""
    code = textwrap.dedent("""
        import os
        os.environ["BATCHJSON_RUNNER_PID"] = str(os.getppid())
        from batchjson.engine import plugin
        plugin.register()
        from vllm.v1.core.sched import utils
        from vllm.v1.core.sched.scheduler import Scheduler
        print("guard:", utils.check_sequence_repetition.__module__)
        print("schedule wrapped:", hasattr(Scheduler.schedule, "__wrapped__"))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=os.environ | {"BATCHJSON_ENGINE_STDERR": "raw"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "guard: batchjson.engine.vllm.scheduler" in done.stdout
    assert "schedule wrapped: True" in done.stdout


UNREAD = "0.35.0"


def test_a_vllm_the_patches_were_not_read_on_gets_neither_and_says_why(monkeypatch):
    """The bound: on a version outside versions.EVERY neither scheduler patch is installed, each says why, and
    notice() is the report's line. The installed vLLM (read on) gets both. No engine starts."""
    import vllm
    from vllm.v1.core.sched import utils
    from vllm.v1.core.sched.scheduler import Scheduler

    assert vllm.__version__.startswith(versions.EVERY)
    monkeypatch.setattr(scheduler, "VLLM_CHECK", scheduler.VLLM_CHECK)
    monkeypatch.setattr(vllm, "__version__", UNREAD)
    before = Scheduler.add_request, Scheduler.schedule, utils.check_sequence_repetition
    kept = versions.reset()  # as in a fresh process
    try:
        assert scheduler.install_no_draft() == \
            f"vLLM {UNREAD} is not a version this patch was read on (0.26.x, 0.32.x, 0.33.x, 0.34.x)"
        assert "check_sequence_repetition is not the one this was read on" in scheduler.install_fast_loop_guard()
        assert not scheduler.no_draft_ready()
        assert (Scheduler.add_request, Scheduler.schedule, utils.check_sequence_repetition) == before  # untouched
        assert versions.notice() == versions.unread(UNREAD) and versions.notice_code() == "unread-vllm"
    finally:
        versions.reset(kept)


def test_the_versions_table_says_what_each_vllm_leaves_off_and_the_report_names_them_all(monkeypatch):
    """versions.py's one table: on each vLLM the wing was read on, the patches off there, and why; an answer this
    process got at an install (a check that failed) stands over the table's. The report's line names them all."""
    import vllm

    off = {v: versions.off_here(v, {}) for v in ("0.26.0", "0.32.0", "0.33.1", "0.34.0")}
    assert off["0.26.0"] == {}
    assert set(off["0.32.0"]) == {"drafted_fills", "grammar_ahead"}
    assert set(off["0.34.0"]) == {"mask_scatter", "scheduler_drafts"}
    assert off["0.34.0"]["mask_scatter"].startswith("no V1 GPU model runner")
    assert "no_draft" not in off["0.33.1"] and "idle_drafter" not in off["0.33.1"]
    assert off["0.33.1"]["grammar_ahead"] == "vLLM 0.33.1 is not a version this patch was read on (0.26.x, 0.34.x)"
    assert versions.off_here("0.26.0", {"no_draft": "Scheduler.schedule changed"}) == {
        "no_draft": "Scheduler.schedule changed"}

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    kept = versions.reset({"no_draft": "ok"})
    try:
        assert versions.notice() == ("batchjson's engine patches off in vLLM 0.34.0: "
                                     f"mask_scatter ({off['0.34.0']['mask_scatter']}); "
                                     f"scheduler_drafts ({off['0.34.0']['scheduler_drafts']})")
        assert versions.notice_code() == "patches-off"
        monkeypatch.setattr(vllm, "__version__", "0.26.0")
        assert versions.notice() == versions.notice_code() == ""
    finally:
        versions.reset(kept)


def test_an_install_runs_once_and_its_exception_is_its_answer():
    """versions.installs_once: the first answer is every later call's; an exception is an answer, never raised."""
    calls = []

    @versions.installs_once
    def install_broken() -> str:
        calls.append(1)
        raise RuntimeError("no such attribute")

    kept = versions.reset()
    try:
        assert install_broken() == install_broken() == "RuntimeError: no such attribute" and len(calls) == 1
        assert versions.reset() == {"broken": "RuntimeError: no such attribute"}
        assert install_broken() == "RuntimeError: no such attribute" and len(calls) == 2  # forgotten: run again
    finally:
        versions.reset(kept)


def test_a_patch_named_off_is_not_installed(monkeypatch):
    """BATCHJSON_PATCHES_OFF (side-by-side measurements): a patch it names is never installed and says so; the
    others install as before."""
    calls = []

    @versions.installs_once
    def install_thing() -> str:
        calls.append(1)
        return "ok"

    @versions.installs_once
    def install_other() -> str:
        return "ok"

    monkeypatch.setenv(versions.PATCHES_OFF_ENV, "idle_drafter,thing")
    kept = versions.reset()
    try:
        assert install_thing() == f"off: {versions.PATCHES_OFF_ENV}" and not calls
        assert install_other() == "ok"
    finally:
        versions.reset(kept)


def test_the_profiler_times_nothing_on_a_vllm_it_was_not_read_on(monkeypatch, tmp_path):
    """Outside versions.PATCHES["timers"] every part is skipped, with why, and no vLLM class is touched."""
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from batchjson.engine import profiler

    monkeypatch.setattr(vllm, "__version__", UNREAD)
    before = Scheduler.schedule, EngineCore.shutdown
    profiler.install_profiler(tmp_path / "p.json", sync=False)
    got = read_profile(tmp_path / "p.json")
    assert len(got["patches"]) == len(timers.TIMED) and not got["errors"]
    assert set(got["patches"].values()) == {
        f"skipped: vLLM {UNREAD} is not a version this patch was read on (0.26.x, 0.32.x, 0.34.x)"}
    assert (Scheduler.schedule, EngineCore.shutdown) == before


def test_the_report_line_for_a_vllm_outside_read_on():
    line = versions.unread(UNREAD)
    assert line == (f"vLLM {UNREAD} is newer than the versions batchjson's engine patches were read on (0.26, 0.32, "
                    "0.33, 0.34): all are off (pass 2 cannot share a speculative engine, and vLLM's own loop guard "
                    "and grammar fills run)")
    assert versions.unread("0.25.1").startswith("vLLM 0.25.1 is not one of the versions")
    assert versions.unread("dev").startswith("vLLM dev is not one of the versions")
    assert versions.unread("0.34.0") == versions.unread("0.33.2rc1") == versions.unread("0.26.0") == ""


def test_a_run_on_an_unread_vllm_says_so_once_in_its_summary(tmp_path, tiny_model):
    """The engine's notice reaches the summary as one line, however many passes and engines saw it, and its JSON."""
    line = versions.unread(UNREAD)

    class Unread(FakeEngines):
        def start(self, *args):
            engine = super().start(*args)
            engine.told = EngineFacts(notice=line, notice_code="unread-vllm")
            return engine

    write_rows(tmp_path / "in.parquet", 24)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="none", batch_size=4)
    report = run_job(load_spec(job), engine_factory=Unread(valid=0.5), progress=False)
    assert report.passes["pass2"].rows > 0
    assert report.summary().splitlines().count(f"  note: {line}") == 1
    assert report.to_dict()["passes"]["pass1"]["notice"] == line
    assert codes(report.to_dict()["passes"]["pass1"]).count("unread-vllm") == 1

    merged = PassStats()
    merged.merge(PassStats(notice=line).to_dict())
    merged.merge(PassStats().to_dict())
    quiet = RunReport("h", 1, "out", "rej", passes={"pass1": PassStats()})
    assert merged.notice == line and "note:" not in quiet.summary()

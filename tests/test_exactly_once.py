"""Exactly once, attacked: kills at every step of the commit protocol, repeated engine deaths, odd ids, inputs that
change between runs, folders that overlap, concurrent runs, and user mistakes that must end in a message (exit 2),
not a traceback.

The engine here is the fake one (batchjson/engine/fake.py): outcomes are random, so a redone unit differs."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjson.cli import main
from batchjson.engine import EngineWrapper, WrappedEngines
from batchjson.errors import EngineError, OutputError, SpecError
from batchjson.engine.fake import FakeEngine, FakeEngines
from batchjson.job import run_job
from batchjson.spec import load_spec
from batchjson.storage import PartName, Storage
from batchjson.verify import verify_job
from helpers import ENV, HERE, assert_exactly_once, codes, ids_of, write_job, write_rows

STEPS = ["begin", "staged output", "staged rejects", "staged requeue", "committed", "published output",
         "published rejects", "published requeue"]


def rows(path: Path, ids, **columns) -> Path:
    n = len(ids)
    table = pa.table({"id": ids, "text": [f"item {i}" for i in range(n)], "source": ["s"] * n, **columns})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def run(job, **kwargs):
    kwargs.setdefault("engine_factory", FakeEngines())
    return run_job(load_spec(job), progress=False, **kwargs)


def verify_cli(job, *args):
    return CliRunner().invoke(main, ["verify", str(job), *args])


def test_kill_at_every_step_of_the_commit_protocol(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    out = tmp_path / "out"
    for step in STEPS:
        for n in (1, 3):
            p = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), step, str(n)],
                               env=ENV, capture_output=True, text=True, timeout=300)
            assert p.returncode in (0, -signal.SIGKILL), p.stderr[-2000:]
            committed = ids_of(out) + ids_of(out / "_rejects")
            assert not [k for k, v in collections.Counter(committed).items() if v > 1], f"doubled after {step}"
    final = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "none", "0"],
                           env=ENV, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    assert "exactly-once check ok" in final.stdout
    assert_exactly_once([f"r{i:05d}" for i in range(40)], out, out / "_rejects")
    result = verify_cli(job)
    assert result.exit_code == 0 and "exactly-once check ok: " in result.output, result.output


def test_a_unit_killed_after_its_record_is_finished_by_the_next_run_its_pass_2_included(tmp_path, tiny_model):
    """A run killed between a unit's commit record and the publish of its files leaves them staged (here its requeue
    file: every answer invalid). The next run, in one go, publishes them as its survey finds them and hands out the
    unit's pass 2: every row once, nothing left staged."""
    write_rows(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "committed", "1"],
                            env=ENV | {"FAKE_VALID": "0"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    [left] = [p for p in out.rglob(".*.parquet.tmp")]
    [record] = (out / "_batchjson" / "units").glob("p1-*.json")
    final = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "none", "0"],
                           env=ENV, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0 and "exactly-once check ok" in final.stdout, final.stdout + final.stderr[-2000:]
    assert_exactly_once([f"r{i:05d}" for i in range(12)], out, out / "_rejects")
    assert not list(out.rglob(".*.tmp")), left
    assert record.with_name(f"p2-{record.name[3:]}").exists()  # its requeued rows went through pass 2


def test_a_staged_copy_beside_its_published_file_is_gone_after_the_next_run(tmp_path, tiny_model):
    """On object storage a publish is a copy and a delete: a kill between them leaves the staged copy beside the
    published file. The next run's survey deletes it (a reader never reads it, but it takes space)."""
    write_rows(tmp_path / "in.parquet", 8)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    run(job, engine_factory=FakeEngines(valid=1.0))
    out = tmp_path / "out"
    part = min(out.glob("p1-*.parquet"))
    copy = part.with_name(f".{part.name}.tmp")
    copy.write_bytes(part.read_bytes())
    report = run(job)
    assert report.verified["complete"] and not copy.exists() and part.exists()


def test_kill_at_every_step_of_a_pass_2_commit_while_pass_1_is_in_flight(tmp_path, tiny_model):
    """The passes run as a pipeline: a unit's pass 2 commits while other units are still in pass 1. A kill at any
    step of such a commit loses nothing and doubles nothing; the rerun resumes each unit where it stood."""
    write_rows(tmp_path / "in.parquet", 60)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)  # 15 units
    out = tmp_path / "out"
    env = ENV | {"FAKE_DELAY": "0.002", "FAKE_VALID": "0.5"}
    for step in STEPS:
        if step == "staged requeue" or step == "published requeue":
            continue  # pass 2 re-queues nothing
        p = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), f"p2:{step}", "1"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode in (0, -signal.SIGKILL), p.stderr[-2000:]
        committed = ids_of(out) + ids_of(out / "_rejects")
        assert not [k for k, v in collections.Counter(committed).items() if v > 1], f"doubled after p2:{step}"
        if step == "begin":  # the first pass-2 commit came while pass 1 had units left
            assert p.returncode == -signal.SIGKILL
            assert len(list((out / "_batchjson" / "units").glob("p1-*.json"))) < 15
    final = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "none", "0"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    assert_exactly_once([f"r{i:05d}" for i in range(60)], out, out / "_rejects")
    assert len(list((out / "_batchjson" / "units").glob("p2-*.json"))) > 0


class DyingEngines(FakeEngines):
    """Fake engines whose first `deaths` engines die after 6 prompts each."""

    def __init__(self, deaths: int):
        super().__init__(max_in_flight=4)
        self.deaths = deaths

    def start(self, spec, decoding, speculative):
        engine = super().start(spec, decoding, speculative)
        if len(self.started) <= self.deaths:
            engine.die_after = 6
        return engine


def test_repeated_engine_deaths_drop_speculation_then_give_up(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    engines = DyingEngines(deaths=2)  # two deaths of the speculative engine: the third decodes without drafts
    report = run_job(load_spec(job), engine_factory=engines, progress=False)
    assert [s is not None for _, s in engines.started] == [True, True, False]
    assert "speculation-off" in codes(report.passes["pass1"])
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")

    write_rows(tmp_path / "more" / "in.parquet", 40)
    job = write_job(tmp_path / "more", tiny_model, tmp_path / "more" / "in.parquet", batch_size=4,
                    speculative="none")
    with pytest.raises(EngineError, match="the engine died 3 times.*rerun the same command to resume"):
        run_job(load_spec(job), engine_factory=DyingEngines(deaths=3), progress=False)


def test_float_and_bool_ids_are_one_identity(tmp_path, tiny_model):
    rows(tmp_path / "in.parquet", [1.0, 2.0, 1.0])
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    report = run(job, engine_factory=FakeEngines(valid=1.0))
    assert ids_of(tmp_path / "out") == ["1", "2"]
    rejects = pq.read_table(next((tmp_path / "out" / "_rejects").glob("*.parquet"))).to_pylist()
    assert [(r["id"], r["reason"]) for r in rejects] == [("1", "duplicate_id")]
    assert report.verified["complete"]


def test_verify_finds_a_repeated_id_in_output_and_rejects_and_an_id_moved_to_another_unit(tmp_path, tiny_model):
    """Across units verify counts only the ids the input repeats (the rest must match their own unit's rows): a
    repeated id's duplicate_id reject turned into another reason leaves it both written and rejected; an id copied
    into another unit's file is that unit's extra row."""
    rows(tmp_path / "in.parquet", ["a", "b", "a", "c"])
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=1)
    assert run(job, engine_factory=FakeEngines(valid=1.0)).verified["complete"]
    [rejects] = (tmp_path / "out" / "_rejects").glob("*.parquet")
    table = pq.read_table(rejects)
    assert table.column("reason").to_pylist() == ["duplicate_id"]
    pq.write_table(table.set_column(table.schema.get_field_index("reason"), "reason", pa.array(["json_parse"])), rejects)
    result = verify_cli(job)
    assert result.exit_code == 3 and "1 id(s) in both output and rejects (or rejected twice): 'a'" in result.output
    pq.write_table(table, rejects)
    assert verify_cli(job).exit_code == 0
    parts = sorted((tmp_path / "out").glob("p1-*.parquet"))
    first, last = pq.read_table(parts[0]), pq.read_table(parts[-1])
    pq.write_table(pa.concat_tables([last, first.cast(last.schema)]), parts[-1])
    result = verify_cli(job)
    assert result.exit_code == 3 and "holds other rows than the input (missing none; extra 'a')" in result.output


def test_glob_input_grows_by_a_file_in_a_new_folder(tmp_path, tiny_model):
    write_rows(tmp_path / "in" / "x" / "a.parquet", 10)
    job = write_job(tmp_path, tiny_model, tmp_path / "in" / "*" / "*.parquet")
    run(job)
    write_rows(tmp_path / "in" / "y" / "b.parquet", 5, start=10)
    again = run(job)
    assert again.passes["pass1"].rows == 5, "only the new file is new work"
    assert_exactly_once([f"r{i:05d}" for i in range(15)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_a_new_file_that_sorts_first_cannot_repeat_a_committed_id(tmp_path, tiny_model):
    rows(tmp_path / "in" / "b.parquet", [f"r{i}" for i in range(6)])
    job = write_job(tmp_path, tiny_model, tmp_path / "in")
    run(job, engine_factory=FakeEngines(valid=1.0))
    rows(tmp_path / "in" / "a.parquet", ["r3", "new"])
    report = run(job, engine_factory=FakeEngines(valid=1.0))
    assert sorted(ids_of(tmp_path / "out")) == sorted([f"r{i}" for i in range(6)] + ["new"])
    rejects = pq.read_table(next((tmp_path / "out" / "_rejects").glob("*.parquet"))).to_pylist()
    assert [(r["id"], r["reason"]) for r in rejects] == [("r3", "duplicate_id")]
    assert report.verified["complete"]


def test_shards_run_together_but_nothing_else_meanwhile(tmp_path):
    out = tmp_path / "out"
    shards = [Storage(out, shard=(i, 2)) for i in range(2)]
    for s in shards:
        s.claim()
    with pytest.raises(OutputError, match="another batchjson run is writing"):
        Storage(out).claim()
    with pytest.raises(OutputError, match="shard 0/2"):
        Storage(out, shard=(0, 2)).claim()
    with pytest.raises(OutputError, match="another batchjson run is writing"):
        Storage(out, shard=(0, 3)).claim()
    for s in shards:
        s.close()
    whole = Storage(out)
    whole.claim()
    with pytest.raises(OutputError, match="another batchjson run is writing"):
        Storage(out, shard=(1, 2)).claim()
    whole.close()


@pytest.mark.parametrize("rejects, ok", [("out", False), ("out/rejected", False), ("out/_rejected", True),
                                         ("elsewhere", True)])
def test_rejects_folder_must_not_be_read_as_output(tmp_path, tiny_model, rejects, ok):
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", extra=f'rejects = "{rejects}"')
    if ok:
        run(job)
        assert_exactly_once([f"r{i:05d}" for i in range(4)], tmp_path / "out", tmp_path / rejects)
    else:
        with pytest.raises(OutputError, match="rejects"):
            run(job)
        result = CliRunner().invoke(main, ["check", str(job)])
        assert result.exit_code == 2 and "rejects" in result.output


@pytest.mark.parametrize("name", ["json", "reason", "_pass", "id"])
def test_a_passthrough_column_cannot_shadow_a_written_one(tmp_path, name):
    job = write_job(tmp_path, "no-model", tmp_path / "in.parquet")
    job.write_text(job.read_text().replace('passthrough = ["source"]', f'passthrough = ["{name}"]'))
    with pytest.raises(SpecError, match=f"input.passthrough: '{name}' is also the name"):
        load_spec(job)


def test_a_deleted_output_part_is_found_and_redone(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    run(job, engine_factory=FakeEngines(valid=1.0))
    victim = sorted((tmp_path / "out").glob("p1-*.parquet"))[1]
    victim.unlink()
    result = verify_cli(job)
    assert result.exit_code == 3 and victim.name in result.output and "Run the job again" in result.output
    report = run(job, engine_factory=FakeEngines(valid=1.0))
    key = PartName.parse(victim.name).key
    assert report.passes["pass1"].rows == 4
    assert codes(report) == ["unit-redone"] and report.events[0]["text"].startswith(f"unit {key}: ")
    assert verify_cli(job).exit_code == 0
    assert_exactly_once([f"r{i:05d}" for i in range(12)], tmp_path / "out", tmp_path / "out" / "_rejects")


@pytest.mark.parametrize("replicas", [None, 2])
def test_a_unit_damaged_between_runs_is_found_beside_the_resume_and_redone(tmp_path, tiny_model, monkeypatch,
                                                                           replicas):
    """A resume with work left surveys the units it does not hand out beside its passes (survey_units' `defer`),
    not before its first prompt: a finished unit whose output file was cut short between runs is still found, once
    every unit handed out is done (the survey answers late here), uncommitted and redone; the end check passes with
    each row once, and the progress file counts the unit once. With two local replicas, started before the survey
    (job.py's `_early`), too. The units finished meanwhile are checked (UnitChecks) once the survey has answered,
    not beside it: their reads and its listings would stack into the driver's peak."""
    from batchjson.storage import survey
    from batchjson.storage.progress import add_record
    from batchjson.verify import UnitChecks

    write_rows(tmp_path / "in.parquet", 24)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    run(job, engine_factory=FakeEngines(valid=1.0))
    out, units = tmp_path / "out", tmp_path / "out" / "_batchjson" / "units"
    left, damaged = (json.loads(p.read_text()) for p in sorted(units.glob("p1-*.json"))[1:3])
    (units / f"p1-{left['key']}.json").unlink()  # a unit left to do: the resume hands it out
    (out / left["files"]["output"]).unlink()
    victim = out / damaged["files"]["output"]
    victim.write_bytes(victim.read_bytes()[:-10])
    found, check, unit_check, checked = [], survey._later, UnitChecks._check, []

    def late(*args):  # the survey answers after the unit handed out is done
        time.sleep(1.0)
        damaged, passes = check(*args)
        found.append((damaged, time.monotonic()))
        return damaged, passes

    def check_unit(self, key):
        checked.append((key, time.monotonic()))
        return unit_check(self, key)

    monkeypatch.setattr(survey, "_later", late)
    monkeypatch.setattr(UnitChecks, "_check", check_unit)
    report = run(job, engine_factory=FakeEngines(valid=1.0), replicas=replicas)
    assert len(found) == 1 and list(found[0][0]) == [damaged["key"]] and victim.name in found[0][0][damaged["key"]]
    assert {key for key, _ in checked} == {left["key"], damaged["key"]}, checked
    assert all(at > found[0][1] for _, at in checked), (found, checked)
    assert codes(report) == ["unit-redone"] and report.events[0]["text"].startswith(f"unit {damaged['key']}: ")
    assert report.passes["pass1"].rows == 8 and report.verified["complete"], report.verified
    assert verify_cli(job).exit_code == 0
    assert_exactly_once([f"r{i:05d}" for i in range(24)], out, out / "_rejects")
    passes = {}
    for path in sorted(units.glob("p[12]-*.json")):
        add_record(passes, json.loads(path.read_text()))
    progress = json.loads((out / "_batchjson" / "progress-0of1.json").read_text())
    assert progress["passes"] == passes, progress["passes"]


def test_a_unit_redone_for_a_damaged_record_is_not_taken_back_by_the_deferred_check(tmp_path, tiny_model):
    """A unit whose pass-2 commit record was cut short is redone from scratch; its pass-1 record, which the index
    answers for, is not left to the check beside the run (`Survey.later`), which would find the files the redo
    removed or rewrote and uncommit the unit a second time."""
    write_rows(tmp_path / "in.parquet", 24)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    run(job, engine_factory=FakeEngines(valid=0.5, seed=3))
    units = tmp_path / "out" / "_batchjson" / "units"
    record = sorted(units.glob("p2-*.json"))[0]
    record.write_bytes(record.read_bytes()[:30])
    report = run(job, engine_factory=FakeEngines(valid=1.0))
    assert codes(report) == ["unit-redone"] and record.name in report.events[0]["text"], report.events
    assert report.passes["pass1"].rows == 4 and report.verified["complete"], report.verified
    assert verify_cli(job).exit_code == 0


@pytest.mark.parametrize("damage", ["truncated", "not a record"])
def test_a_damaged_commit_record_is_named_and_its_unit_redone(tmp_path, tiny_model, damage):
    """A commit record cut short (or rewritten as JSON that is no record): verify names it (exit 3, not a
    traceback), and a run redoes its unit, saying why, with each row once in the end."""
    write_rows(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    run(job, engine_factory=FakeEngines(valid=1.0))
    record = sorted((tmp_path / "out" / "_batchjson" / "units").glob("p1-*.json"))[1]
    record.write_bytes(record.read_bytes()[:30] if damage == "truncated" else b"[]")
    result = verify_cli(job)
    assert result.exit_code == 3 and f"its commit record {record.name}" in result.output, result.output
    report = run(job, engine_factory=FakeEngines(valid=1.0))
    assert codes(report) == ["unit-redone"] and record.name in report.events[0]["text"], report.events
    assert report.passes["pass1"].rows == 4 and report.verified["complete"]
    assert verify_cli(job).exit_code == 0
    assert_exactly_once([f"r{i:05d}" for i in range(12)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_a_stray_part_file_fails_verify(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    run(job, engine_factory=FakeEngines(valid=1.0))
    part = next((tmp_path / "out").glob("p1-*.parquet"))
    (tmp_path / "out" / part.name.replace("00000.", "00009.")).write_bytes(part.read_bytes())
    result = verify_cli(job)
    assert result.exit_code == 3 and "no commit lists" in result.output and "Remove it" in result.output


def rows_read(folder: Path) -> int:
    """The most rows that a reader the README names reads from the folder: pyarrow.dataset (sub-folders, no _ or .
    names) or DuckDB's read_parquet('<folder>/*.parquet') (this folder only, _ and . names too)."""
    dataset = ds.dataset(folder, format="parquet").count_rows()
    files = duckdb.sql(f"select count(*) from glob('{folder}/*.parquet')").fetchall()[0][0]
    return max(dataset, duckdb.sql(f"select count(*) from read_parquet('{folder}/*.parquet')").fetchall()[0][0]
               if files else 0)


def finished_run_with_rejects(tmp_path, tiny_model):
    """A finished run of 12 rows in 3 units, with output and rejects; the job and its verdict."""
    write_rows(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    run(job, engine_factory=FakeEngines(valid=0.4, seed=7))
    verdict = verify_job(load_spec(job))
    assert verdict.complete and verdict.output_rows and verdict.reject_rows, verdict.summary()
    assert (rows_read(tmp_path / "out"), rows_read(tmp_path / "out" / "_rejects")) == \
        (verdict.output_rows, verdict.reject_rows)
    return job, verdict


@pytest.mark.parametrize("copy", ["copy-of-{part}", "backup/{part}", "backup/old/{part}.bak", "_{part}", ".{part}",
                                  "_rejects/old/{reject}"])
def test_a_copy_that_readers_read_fails_verify_wherever_it_is(tmp_path, tiny_model, copy):
    job, verdict = finished_run_with_rejects(tmp_path, tiny_model)
    out = tmp_path / "out"
    part, reject = min(out.glob("p1-*.parquet")), min((out / "_rejects").glob("rejects-*.parquet"))
    target = out / copy.format(part=part.name, reject=reject.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes((reject if "{reject}" in copy else part).read_bytes())
    folder = out / "_rejects" if "{reject}" in copy else out
    assert rows_read(folder) > (verdict.reject_rows if "{reject}" in copy else verdict.output_rows)
    result = verify_cli(job)
    assert result.exit_code == 3 and f"{target} is read by readers of the folder" in result.output, result.output
    assert "Remove it" in result.output
    report = run(job)  # the check that ends every run finds it too
    assert report.verify_failed and f"{target} is read by readers" in report.verified_summary
    target.unlink()
    assert verify_cli(job).exit_code == 0


@pytest.mark.parametrize("kind, size", [("output", 0.5), ("output", 0), ("rejects", 0.5)])
def test_a_corrupt_part_file_fails_verify_and_a_rerun_redoes_its_unit(tmp_path, tiny_model, kind, size):
    job, verdict = finished_run_with_rejects(tmp_path, tiny_model)
    folder = tmp_path / "out" / ("_rejects" if kind == "rejects" else "")
    victim = min(folder.glob("*.parquet"))
    data = victim.read_bytes()
    victim.write_bytes(data[:int(len(data) * size)])
    result = verify_cli(job)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 3 and f"{victim} does not read as Parquet" in result.output, result.output
    assert "Run the job again: it redoes the unit" in result.output
    report = run(job, engine_factory=FakeEngines(valid=0.4, seed=7))
    assert codes(report) == ["unit-redone"] and report.passes["pass1"].rows == 4
    assert report.events[0]["text"].startswith(f"unit {PartName.parse(victim.name).key}: ")
    again = verify_job(load_spec(job))
    assert again.complete and again.output_rows + again.reject_rows == 12
    assert (rows_read(tmp_path / "out"), rows_read(tmp_path / "out" / "_rejects")) == \
        (again.output_rows, again.reject_rows)
    assert_exactly_once([f"r{i:05d}" for i in range(12)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_an_input_file_rewritten_between_runs_is_refused(tmp_path, tiny_model):
    ids = [f"r{i}" for i in range(8)]
    rows(tmp_path / "in.parquet", ids)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    run(job)
    rows(tmp_path / "in.parquet", ids[::-1])  # same rows, other order: same size
    with pytest.raises(OutputError, match=r"in.parquet changed since .* ids differ.*--fresh"):
        run(job)
    result = verify_cli(job)
    assert result.exit_code == 3 and "changed since" in result.output
    rows(tmp_path / "in.parquet", ids)
    run(job)  # restored: accepted again


def test_output_inside_the_input_folder_is_refused(tmp_path, tiny_model):
    write_rows(tmp_path / "in" / "a.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in")
    with pytest.raises(OutputError, match="inside the input"):
        run(job, output=str(tmp_path / "in" / "out"))
    run(job, output=str(tmp_path / "in" / "_out"))  # skipped by the folder reader: fine


def test_output_inside_a_recursive_glob_of_the_input_is_refused(tmp_path, tiny_model):
    write_rows(tmp_path / "in" / "a.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in" / "**" / "*.parquet")
    result = CliRunner().invoke(main, ["check", str(job), "--output", str(tmp_path / "in" / "x" / "y" / "out")])
    assert result.exit_code == 2 and "is inside the input" in result.output, result.output


def test_a_failed_engine_start_does_not_claim_the_folder_for_its_spec(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")

    class Broken(FakeEngines):
        def start(self, *args):
            raise EngineError("cannot start")

    with pytest.raises(EngineError):
        run(job, engine_factory=Broken())
    job.write_text(job.read_text().replace("max_tokens = 48", "max_tokens = 40"))  # the user's fix
    assert run(job).verified["complete"]


def test_a_stop_never_starts_an_engine(tmp_path, tiny_model):
    """Ctrl-C in a terminal reaches the engine processes too: their death is the stop, not a crash."""
    write_rows(tmp_path / "in.parquet", 8)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    engines = FakeEngines()
    runner = None

    class SignalledEngine(EngineWrapper):
        def stream(self, prompts, stop=None):
            runner.stop.set()  # the signal arrived...
            yield from self.inner.stream(prompts)  # ...and the engine dies of it

    factory = WrappedEngines(engines, lambda engine: SignalledEngine(FakeEngine(die_after=2)))

    from batchjson.job import JobRun

    runner = JobRun(load_spec(job), engine_factory=factory, progress=False)
    report = runner.run()
    assert report.interrupted and len(engines.started) == 1


def test_second_ctrl_c_exits_at_once(tmp_path, tiny_model):
    """The first Ctrl-C waits for the engine to start (a minute on a big model); the second one does not."""
    write_rows(tmp_path / "in.parquet", 8)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    p = subprocess.Popen([sys.executable, str(HERE / "fake_runner.py"), str(job), str(tmp_path / "out"), "none", "0"],
                         env=ENV | {"FAKE_START_DELAY": "120", "FAKE_START_MARKER": str(tmp_path / "starting")},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    # Inside the engine start: the first prompt is rendered by then (loading the tokenizer takes seconds).
    while not (tmp_path / "starting").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "stopped at once" in err


# ----- user mistakes: a message and exit 2, never a traceback ---------------------------------------------------
def check(job):
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def test_passthrough_type_differing_between_files_is_caught_by_check(tmp_path, tiny_model):
    rows(tmp_path / "in" / "a.parquet", ["a"])
    pq.write_table(pa.table({"id": ["b"], "text": ["t"], "source": [7]}), tmp_path / "in" / "b.parquet")
    result = check(write_job(tmp_path, tiny_model, tmp_path / "in"))
    assert result.exit_code == 2 and "'source' is string in" in result.output and "b.parquet" in result.output


def test_invalid_utf8_rejects_the_row_and_names_it(tmp_path, tiny_model):
    text = pa.array([b"fine", b"\xff\xfe broken"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": ["a", "b"], "text": text, "source": ["s", "s"]}), tmp_path / "in.parquet")
    run(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"), engine_factory=FakeEngines(valid=1.0))
    assert ids_of(tmp_path / "out") == ["a"]
    (reject,) = pq.read_table(next((tmp_path / "out" / "_rejects").glob("*.parquet"))).to_pylist()
    assert reject["reason"] == "invalid_input" and "'text'" in reject["detail"] and "row 1" in reject["detail"]


def test_a_very_long_file_name_keeps_names_short(tmp_path, tiny_model):
    name = "x" * 240 + ".parquet"
    write_rows(tmp_path / "in" / name, 3)
    job = write_job(tmp_path, tiny_model, tmp_path / "in")
    assert run(job).verified["complete"]
    assert max(len(p.name) for p in (tmp_path / "out").rglob("*")) < 100


@pytest.mark.parametrize("template", ["Describe {text:d}", "Describe {text!x}", "Describe { text", "Return {\"a\": 1} for {text}"])
def test_template_mistakes_are_explained(tmp_path, template):
    write_rows(tmp_path / "in.parquet", 2)
    job = write_job(tmp_path, "no-model", tmp_path / "in.parquet")
    job.write_text(job.read_text().replace('template = "Describe: {text}"', f"template = '{template}'"))
    result = check(job)
    assert result.exit_code == 2 and "prompt.template" in result.output and "{{" in result.output, result.output


def test_output_path_that_is_a_file(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 2)
    (tmp_path / "out").write_text("not a folder")
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))])
    assert result.exit_code == 2 and "is a file" in result.output


@pytest.mark.parametrize("setting, message", [("repetition_penalty = 0.0", "repetition_penalty must be > 0"),
                                              ("frequency_penalty = 5.0", "frequency_penalty must be in"),
                                              ("top_p = 0.0", "top_p must be in")])
def test_out_of_range_sampling_values_fail_at_load(tmp_path, setting, message):
    write_rows(tmp_path / "in.parquet", 2)
    job = write_job(tmp_path, "no-model", tmp_path / "in.parquet")
    job.write_text(job.read_text().replace("[sampling]", f"[sampling]\n{setting}"))
    result = check(job)
    assert result.exit_code == 2 and message in result.output


def test_two_shards_at_once_then_verify(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 60, row_group_size=10)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=5)
    out = tmp_path / "out"
    shards = [subprocess.Popen([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "none", "0", f"{i}/2"],
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in shards:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    assert verify_cli(job).exit_code == 0
    assert_exactly_once([f"r{i:05d}" for i in range(60)], out, out / "_rejects")


def test_an_input_file_removed_after_commits_is_refused(tmp_path, tiny_model):
    write_rows(tmp_path / "in" / "a.parquet", 4)
    write_rows(tmp_path / "in" / "b.parquet", 4, start=4)
    job = write_job(tmp_path, tiny_model, tmp_path / "in")
    run(job)
    (tmp_path / "in" / "b.parquet").unlink()
    with pytest.raises(OutputError, match=r"input file b.parquet was removed.*Put it back"):
        run(job)


def test_an_empty_file_and_odd_ids(tmp_path, tiny_model):
    rows(tmp_path / "in" / "a.parquet", ["x/../y", "line\nbreak", "ünï", "a" * 500])
    rows(tmp_path / "in" / "empty.parquet", [])
    job = write_job(tmp_path, tiny_model, tmp_path / "in")
    report = run(job, engine_factory=FakeEngines(valid=1.0))
    assert report.verified["complete"] and sorted(ids_of(tmp_path / "out")) == sorted(
        ["x/../y", "line\nbreak", "ünï", "a" * 500])


def test_a_shard_killed_mid_commit_is_finished_by_its_rerun(tmp_path, tiny_model):
    write_rows(tmp_path / "in.parquet", 60, row_group_size=10)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=5)
    out = tmp_path / "out"

    def shard(i, step="none", n=0):
        return subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), step, str(n), f"{i}/2"],
                              env=ENV, capture_output=True, text=True, timeout=300)

    assert shard(0, "committed", 2).returncode == -signal.SIGKILL
    assert shard(1).returncode == 0  # the other shard finishes meanwhile; its end check sees no doubles
    assert verify_cli(job).exit_code == 3  # shard 0 is not finished
    assert shard(0).returncode == 0
    assert verify_cli(job).exit_code == 0
    assert_exactly_once([f"r{i:05d}" for i in range(60)], out, out / "_rejects")


def test_a_unit_staged_under_the_earlier_hidden_name_is_rolled_forward(tmp_path, tiny_model):
    """A run of the version before `.tmp` staged names, killed between a commit record and publishing, left
    `.p1-<unit>.parquet` (which DuckDB reads): the next open publishes it, as it did then; nothing is redone."""
    job, verdict = finished_run_with_rejects(tmp_path, tiny_model)
    victim = min((tmp_path / "out").glob("p1-*.parquet"))
    victim.rename(victim.with_name(f".{victim.name}"))
    again = verify_job(load_spec(job))
    assert again.complete, again.problems
    assert victim.exists() and not list((tmp_path / "out").glob(".*"))
    assert (rows_read(tmp_path / "out"), rows_read(tmp_path / "out" / "_rejects")) == \
        (again.output_rows, again.reject_rows)


def test_what_is_left_comes_from_the_listing_not_a_look_per_unit(tmp_path, tiny_model, monkeypatch):
    """A run finds the units each pass has left in its one listing of the records: no look at an absent record per
    unit (on object storage a HEAD and a LIST each, before the first prompt); a unit whose pass-2 record is gone is
    redone in pass 2 alone, and the folder holds each row once."""
    from batchjson.storage.location import Location

    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    absent = []
    exists, read_bytes = Location.exists, Location.read_bytes

    def record(name: str) -> bool:
        return name.startswith(("p1-", "p2-")) and name.endswith(".json")

    def looked(self):
        found = exists(self)
        if not found and record(self.name):
            absent.append(self.name)
        return found

    def read(self):
        try:
            return read_bytes(self)
        except FileNotFoundError:
            if record(self.name):
                absent.append(self.name)
            raise

    monkeypatch.setattr(Location, "exists", looked)
    monkeypatch.setattr(Location, "read_bytes", read)
    run(job, engine_factory=FakeEngines(valid=0.5, seed=3))
    assert absent == []
    record = sorted((tmp_path / "out" / "_batchjson" / "units").glob("p2-*.json"))[0]
    requeued = json.loads(record.with_name("p1-" + record.name[3:]).read_text())["rows"]["requeue"]
    record.unlink()
    report = run(job, engine_factory=FakeEngines(valid=1.0))
    assert "pass1" not in report.passes and report.passes["pass2"].rows == requeued
    assert absent == []
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")

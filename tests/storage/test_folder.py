"""The output folder's names: formatted and parsed by one type, and unchanged on disk, so that a folder written
before resumes after."""

from __future__ import annotations

import functools
import json
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchjson import api, cli
from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.spec import load_spec
from batchjson.storage import PartName, UnitName
from helpers import ENV, HERE, assert_exactly_once, record_reads, write_job, write_rows


@pytest.mark.parametrize("part, name", [
    (PartName("p1", "a-1f2e-00000-00000", "output"), "p1-a-1f2e-00000-00000.parquet"),
    (PartName("p2", "a-1f2e-00000-00000", "output"), "p2-a-1f2e-00000-00000.parquet"),
    (PartName("p1", "a-1f2e-00000-00000", "rejects"), "rejects-p1-a-1f2e-00000-00000.parquet"),
    (PartName("p2", "p1-x", "rejects"), "rejects-p2-p1-x.parquet"),
    (PartName("p1", "a-1f2e-00000-00000", "requeue"), "a-1f2e-00000-00000.parquet"),
])
def test_a_part_name_parses_back_to_itself_final_or_staged(part, name):
    assert part.file_name() == name
    assert part.staged_name() == f".{name}.tmp"
    kind = "requeue" if part.kind == "requeue" else None
    assert PartName.parse(name, kind) == part
    assert PartName.parse(part.staged_name(), kind) == part


def test_a_unit_name_is_its_commit_records_name():
    unit = UnitName("p2", "a-1f2e-00000-00003")
    assert unit.unit_id() == "p2-a-1f2e-00000-00003" and unit.file_name() == "p2-a-1f2e-00000-00003.json"
    assert UnitName.parse(unit.file_name()) == UnitName.parse(unit.unit_id()) == unit
    assert PartName("p2", unit.key, "output").unit == unit


@pytest.mark.parametrize("name", ["p3-x.parquet", "p1x.parquet", "p1-.parquet", "p1-x.json", "spec.json",
                                  "rejects-x.parquet", ".p1-x.parquet"])
def test_other_names_are_not_part_names(name):
    with pytest.raises(ValueError):
        PartName.parse(name)


def test_a_folder_written_with_todays_names_resumes(tmp_path, tiny_model):
    """The names below are written out by hand, as a folder of an earlier version holds them: one unit is committed
    but not yet published (staged files beside its record), one was never committed, one is done. The rerun
    publishes the first, redoes only the second, and every id ends up once."""
    write_rows(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    run_job(load_spec(job), progress=False, engine_factory=FakeEngines(valid=0.4, seed=7))
    out = tmp_path / "out"
    units, rejects, requeue = out / "_batchjson" / "units", out / "_rejects", out / "_batchjson" / "requeue"
    records = {p.name: json.loads(p.read_text()) for p in units.glob("*.json")}
    keys = sorted({r["key"] for r in records.values()})
    assert len(keys) == 3
    for name, record in records.items():
        stage, key = record["stage"], record["key"]
        assert name == f"{stage}-{key}.json"
        where = {"output": out / f"{stage}-{key}.parquet", "rejects": rejects / f"rejects-{stage}-{key}.parquet",
                 "requeue": requeue / f"{key}.parquet"}
        assert {kind: where[kind].name for kind in record["files"]} == record["files"]
        assert all(where[kind].exists() for kind in record["files"])

    half, gone = keys[0], keys[1]
    for stage in ("p1", "p2"):
        for path in (out / f"{stage}-{half}.parquet", rejects / f"rejects-{stage}-{half}.parquet"):
            if path.exists():
                path.rename(path.with_name(f".{path.name}.tmp"))
        (units / f"{stage}-{gone}.json").unlink(missing_ok=True)
        for path in (out / f"{stage}-{gone}.parquet", rejects / f"rejects-{stage}-{gone}.parquet"):
            path.unlink(missing_ok=True)
    (requeue / f"{gone}.parquet").unlink(missing_ok=True)

    again = run_job(load_spec(job), progress=False, engine_factory=FakeEngines(valid=0.4, seed=7))
    assert again.resumed and again.passes["pass1"].rows == 4, "only the uncommitted unit is redone"
    assert again.verified["ok"] and again.verified["complete"], again.verified
    assert not list(out.glob(".*")) and not list(rejects.glob(".*")), "the committed unit was published"
    assert_exactly_once([f"r{i:05d}" for i in range(12)], out, rejects)


def test_a_resume_reads_a_record_rewritten_after_the_index_and_survives_a_damaged_index(tmp_path, tiny_model):
    """The index (storage/index.py) stands in only for records and files unchanged since it was written."""
    write_rows(tmp_path / "in.parquet", 24)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    out = tmp_path / "out"

    def run():
        return run_job(load_spec(job), str(out), engine_factory=FakeEngines(valid=1.0), progress=False)

    assert run().verified["complete"] and (out / "_batchjson" / "index.arrows").exists()
    record = sorted((out / "_batchjson" / "units").glob("p1-*.json"))[0]
    data = json.loads(record.read_text())
    data["rows"]["output"] += 1000  # a record edited by hand (a new time in the listing): read, not the indexed one
    record.write_text(json.dumps(data))
    assert run().valid == 24 + 1000
    data["rows"]["output"] -= 1000
    record.write_text(json.dumps(data))
    (out / "_batchjson" / "index.arrows").write_text("{not the index")
    report = run()
    assert report.valid == 24 and report.verified["complete"], report.verified
    assert read_index(out / "_batchjson")["records"]


def read_index(state: Path, name: str = "index.arrows") -> dict:
    """A file of the index (an Arrow IPC file, storage/index.py) as a dict: "written", "records" (name ->
    stamp, sha256 and the record parsed) and "checked" (name -> stamp)."""
    reader = pa.ipc.open_file(pa.BufferReader((state / name).read_bytes()))
    index = {"written": reader.schema.metadata[b"written"].decode(), "records": {}, "checked": {}}
    for row in reader.read_all().to_pylist():
        stamp = [row["size"], row["mtime"]]
        if row["record"] is None:
            index["checked"][row["name"]] = stamp
        else:
            index["records"][row["name"]] = {"stamp": stamp, "sha256": row["sha256"],
                                             "record": json.loads(row["record"])}
    return index


def write_index(state: Path, index: dict, name: str = "index.arrows") -> None:
    """`read_index`'s dict written back as the index, each record as records are written (json_bytes) with the
    digest the dict gives, whatever the record now holds: an index edited by hand."""
    from batchjson.storage.index_file import Index
    from batchjson.storage.location import Location, json_bytes

    Index.write(Location.of(state / name), [(n, tuple(e["stamp"]), e["sha256"], json_bytes(e["record"]))
                                            for n, e in sorted(index["records"].items())],
                [(n, tuple(s)) for n, s in sorted(index["checked"].items())])


def cli_run(monkeypatch, job: Path, *args):
    """`batchjson run JOB` on the fake engine, as a user runs it: its exit code and output."""
    monkeypatch.setattr(cli, "run_job", functools.partial(api.run_job, engine_factory=FakeEngines(valid=0.5, seed=3)))
    return CliRunner().invoke(cli.main, ["run", str(job), *args])


def claimed_rows(output: str) -> int:
    """The rows the end check's "exactly-once check ok" line says the folder holds."""
    found = re.search(r"exactly-once check ok: (\d+) output \+ (\d+) rejected rows", output)
    assert found, output
    return int(found[1]) + int(found[2])


def forged(tmp_path: Path, tiny_model, monkeypatch, digests: bool) -> tuple[Path, Path, Path]:
    """A finished run of 48 rows in 4 units (its job and output folder) whose index's copy of a unit's commit record
    is edited to list no output file, its stamp kept (so that it still looks current), and `digests`: its digest
    recomputed, so that the index is consistent; the output file is deleted (returned)."""
    from batchjson.storage.index_file import digest
    from batchjson.storage.location import json_bytes

    write_rows(tmp_path / "in.parquet", 48)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=12)  # 4 units
    out = tmp_path / "out"
    assert cli_run(monkeypatch, job).exit_code == 0
    index = read_index(out / "_batchjson")
    entry = next(entry for name, entry in sorted(index["records"].items())
                 if name.startswith("p1-") and entry["record"]["rows"].get("output", 0) >= 2)
    record = entry["record"]
    gone = out / record["files"].pop("output")
    del record["rows"]["output"], record["sizes"]["output"]
    if digests:  # the copy has its digest, its columns their fingerprint
        entry["sha256"] = digest(json_bytes(record))
    write_index(out / "_batchjson", index)
    gone.unlink()
    return job, out, gone


def test_an_index_entry_edited_by_hand_vouches_for_nothing(tmp_path, tiny_model, monkeypatch):
    """Tried as a hostile user would (`forged`, the digest left as it was): the copy no longer matches the bytes the
    index took its digest of, so the index does not stand in for that record: the unit is read, found without its
    file, and redone, and the run claims the 48 rows it holds."""
    job, out, gone = forged(tmp_path, tiny_model, monkeypatch, digests=False)
    result = cli_run(monkeypatch, job)
    assert result.exit_code == 0, result.output
    assert claimed_rows(result.output) == 48, result.output
    assert f"{gone.name} was missing; the unit was redone" in result.output, result.output
    assert "4 units: 0 read, 4 trusted from their commit records" in result.output, result.output  # the redone one
    # checked anew
    assert_exactly_once([f"r{i:05d}" for i in range(48)], out, out / "_rejects")
    assert CliRunner().invoke(cli.main, ["verify", str(job)]).exit_code == 0


def test_an_index_rewritten_whole_with_its_digests_vouches_for_no_record(tmp_path, tiny_model, monkeypatch):
    """Tried as a hostile user would (`forged`, the digests recomputed: the index is consistent, and the resume plans
    from it). The unit's own record file still names the deleted file: the end check compares the index's copy
    with it, so it never claims the lost rows ("ok" over 48 - n). The run fails its check (exit 3, naming the
    file), and the next one redoes the unit."""
    job, out, gone = forged(tmp_path, tiny_model, monkeypatch, digests=True)
    result = cli_run(monkeypatch, job)
    assert result.exit_code == 3, result.output
    assert "exactly-once check ok" not in result.output, result.output
    assert f"{gone.name} is listed in its commit record but missing" in result.output, result.output
    again = cli_run(monkeypatch, job)
    assert again.exit_code == 0, again.output
    assert f"{gone.name} was missing; the unit was redone" in again.output, again.output
    assert claimed_rows(again.output) == 48, again.output
    assert_exactly_once([f"r{i:05d}" for i in range(48)], out, out / "_rejects")
    assert CliRunner().invoke(cli.main, ["verify", str(job)]).exit_code == 0


def rewrite_in_place(part: Path, table: pa.Table) -> None:
    """Write `table` over the Parquet file `part` at its size and modification time (its footer's metadata padded
    to the size), as a rewrite that a listing cannot tell from the file."""
    import os
    import pyarrow.parquet as pq

    size, mtime = part.stat().st_size, part.stat().st_mtime_ns
    def write(pad: int) -> int:
        with pq.ParquetWriter(part, table.schema, store_schema=False) as writer:  # no Arrow schema: a smaller file
            writer.write_table(table)
            writer.add_key_value_metadata({"pad": "x" * pad})  # the footer grows byte for byte with it
        return part.stat().st_size

    pad = size - write(0)
    while (over := write(pad) - size) > 0:  # the length's own bytes (a varint) grow with it
        pad -= over
    assert over == 0
    os.utime(part, ns=(mtime, mtime))


def test_the_end_check_says_which_units_it_did_not_read(tmp_path, tiny_model, monkeypatch):
    """Tried as a hostile user would: an output file is rewritten without one of its rows, at its size and time. A
    rerun's end check trusts the unit from its commit record and the file's unchanged stamp, without reading it, and
    says so: its summary names the units it did not read and the command that reads them, which finds the lost row
    (exit 3)."""
    import pyarrow.parquet as pq

    write_rows(tmp_path / "in.parquet", 48)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=12)  # 4 units
    out = tmp_path / "out"
    assert cli_run(monkeypatch, job).exit_code == 0
    part = next(p for p in sorted(out.glob("p1-*.parquet")) if pq.read_metadata(p).num_rows >= 2)
    table = pq.read_table(part)
    lost = table.column("id")[0].as_py()
    rewrite_in_place(part, table.slice(1))

    again = cli_run(monkeypatch, job)
    assert again.exit_code == 0, again.output
    assert re.search(r"\(4 units: 0 read, 4 trusted from their commit records, not re-read \(the check of "
                     r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC read them, and their files' sizes and times are "
                     r"unchanged\); `batchjson verify` reads them\)", again.output), again.output
    proof = CliRunner().invoke(cli.main, ["verify", str(job)])
    assert proof.exit_code == 3 and repr(lost) in proof.output, proof.output


def test_the_end_check_says_how_many_units_it_took_from_the_index(tmp_path, tiny_model, monkeypatch):
    """The end check counts a unit unchanged since a check read it (as it committed, or the last passing check of
    the folder) from its record, without reading its files; the summary, the report and `batchjson verify` (which
    reads everything) say which it did."""
    write_rows(tmp_path / "in.parquet", 48)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=12)
    out = tmp_path / "out"
    first = cli_run(monkeypatch, job)
    assert first.exit_code == 0 and "each input row once (4 units: 0 read, 4 trusted from their commit records, not " \
        "re-read (this run's check read them as they committed" in first.output, first.output
    again = cli_run(monkeypatch, job)
    assert again.exit_code == 0, again.output
    assert claimed_rows(again.output) == 48
    assert re.search(r"each input row once \(4 units: 0 read, 4 trusted from their commit records, not re-read "
                     r"\(the check of \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC read them, and their files' sizes and "
                     r"times are unchanged\); `batchjson verify` reads them\)", again.output), again.output
    verified = json.loads((out / "_report.json").read_text())["verified"]
    assert (verified["read"], verified["trusted"]) == (0, 4), verified
    proof = CliRunner().invoke(cli.main, ["verify", str(job)])
    assert proof.exit_code == 0 and "each input row once (4 units, all read)" in proof.output, proof.output


def files_below(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file below `folder`: its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("refusal", ["input overwritten", "spec changed", "if_exists fail"])
def test_a_refused_run_touches_nothing(tmp_path, tiny_model, monkeypatch, refusal):
    """A run that refuses (exit 2, saying why) writes and deletes nothing in the folder: not the index, not the
    input fingerprints, not the spec. Every refusal is decided before the first write."""
    src = write_rows(tmp_path / "in.parquet", 24)
    job = write_job(tmp_path, tiny_model, src, batch_size=8)
    out = tmp_path / "out"
    assert cli_run(monkeypatch, job).exit_code == 0
    assert (out / "_batchjson" / "index.arrows").exists()
    before = files_below(out)
    if refusal == "input overwritten":
        write_rows(src, 24, start=100)
        said = f"input file {src.name} changed since {out} began"
    elif refusal == "spec changed":
        job.write_text(job.read_text().replace("Describe:", "Summarize:"))
        said = f"{out} holds a run of a different spec"
    else:
        job.write_text(job.read_text().replace("[output]", '[output]\nif_exists = "fail"'))
        said = f"{out} already holds a run"
    result = cli_run(monkeypatch, job)
    assert result.exit_code == 2 and said in result.output, result.output
    after = files_below(out)
    assert sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name)) == []


def test_the_index_is_read_a_batch_at_a_time_as_the_records_bytes(tmp_path):
    """Index.read keeps each record as the bytes its file holds (not parsed: 1.29 GiB of driver at 100M rows), from
    the index and its parts, the later file's entry over the earlier's; a copy edited vouches for nothing, a stamp
    not the indexed one neither, a part file that does not read as one is left out, and an earlier version's files
    (JSON) are not read but named to be replaced, as the parts are."""
    from batchjson.storage.index_file import Index, digest
    from batchjson.storage.location import Location, json_bytes

    records = {f"p1-u{k}.json": json_bytes({"stage": "p1", "key": f"u{k}", "files": {"output": f"p1-u{k}.parquet"},
                                            "rows": {"output": k}}) for k in range(4)}
    stamps = {name: (100 + k, 7_000 + k) for k, name in enumerate(records)}
    state = Location.of(tmp_path)
    entries = [(n, stamps[n], digest(d), d) for n, d in records.items()]
    old = json_bytes({"stage": "p1", "key": "u3", "files": {}, "rows": {}})  # before its unit was redone
    Index.write(state / "index.arrows", entries[:3] + [("p1-u3.json", (1, 1), digest(old), old)],
                [("p1-u0.parquet", (5, 6))])
    Index.write(state / "index-part-000001.arrows", entries[3:], [("p1-u0.parquet", (5, 8))])
    (tmp_path / "index-part-000002.arrows").write_bytes(b"not the index")
    (tmp_path / "index.json.gz").write_bytes(b"\x1f\x8b an earlier version's")
    (tmp_path / "index-part-000003.json.gz").write_bytes(b"\x1f\x8b an earlier version's")

    def found(index: Index, listed: dict) -> dict:
        return {n: index.record(n, s) for n, s in listed.items() if index.record(n, s)}

    index = Index.read(state)
    assert found(index, stamps) == {n: (digest(d), d) for n, d in records.items()}
    assert index.checked("p1-u0.parquet", (5, 8)) and not index.checked("p1-u0.parquet", (5, 6)) and index.written
    index.vouch_files([("p1-u0.parquet", (5, 9))])  # a check of this run's: newer than the index's
    assert index.checked("p1-u0.parquet", (5, 9)) and not index.checked("p1-u0.parquet", (5, 8))
    assert index.replaced == ["index.json.gz", "index-part-000001.arrows", "index-part-000002.arrows",
                              "index-part-000003.json.gz"] and index.next_part == 4
    assert found(index, {**stamps, "p1-u2.json": (1, 1)}).keys() == stamps.keys() - {"p1-u2.json"}
    whole = read_index(tmp_path)
    whole["records"]["p1-u1.json"]["record"]["rows"]["output"] = 9  # edited, its digest kept
    write_index(tmp_path, whole)
    assert found(Index.read(state), stamps).keys() == {"p1-u0.json", "p1-u2.json", "p1-u3.json"}


def test_a_killed_run_leaves_its_records_folded_for_its_resume(tmp_path, tiny_model, monkeypatch):
    """A run folds the records it has read or written into parts of the index as it goes (every job.FOLD_MIN):
    killed midway (SIGKILL), it leaves them, and its resume reads only the records written after the last part
    before its end check, not each record (two requests each on object storage); the end check reads each record
    file once, to compare the index's copies with; the resume's passing check replaces the parts with one index, and
    the folder holds each row once."""
    from batchjson.storage import Commits

    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=2)  # 20 units
    out, state = tmp_path / "out", tmp_path / "out" / "_batchjson"
    killed = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "committed", "15"],
                            env=ENV | {"FAKE_FOLD_MIN": "4"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    records = list((state / "units").glob("p[12]-*.json"))
    parts = sorted(state.glob("index-part-*.arrows"))
    assert len(records) == 15 and len(parts) == 3, (records, parts)
    read, before_check, trusted = record_reads(monkeypatch), [], Commits.trusted
    monkeypatch.setattr(Commits, "trusted", lambda commits: before_check.extend(read) or trusted(commits))
    report = run_job(load_spec(job), str(out), engine_factory=FakeEngines(valid=0.6), progress=False)
    assert report.resumed and report.verified["complete"], report.verified
    assert len(before_check) <= 3, before_check  # the records written after the last part (12 of 15 folded)
    assert sorted(read) == sorted(set(read)) == sorted(r.name for r in records), read  # each once
    assert (state / "index.arrows").exists() and not list(state.glob("index-part-*"))
    assert_exactly_once([f"r{i:05d}" for i in range(40)], out, out / "_rejects")


def test_a_resume_reads_again_only_the_units_its_killed_run_did_not_check(tmp_path, tiny_model):
    """A run checks each unit as it finishes it (verify.py's UnitChecks) and folds what it vouched for into the parts
    of the index; killed, its resume's end check reads only the units not checked before the kill (the last ones),
    where it read every unit the killed run committed before (294 of a 334 s resume at 100 million rows)."""
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=2)  # 20 units
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "committed", "20"],
                            env=ENV | {"FAKE_FOLD_MIN": "4", "FAKE_DELAY": "0.05"}, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    committed = len(list((out / "_batchjson" / "units").glob("p1-*.json")))  # units of pass 1, finished or not
    report = run_job(load_spec(job), str(out), engine_factory=FakeEngines(valid=0.6), progress=False)
    assert report.resumed and report.verified["complete"], report.verified
    assert report.verified["trusted"] >= 5 and report.verified["read"] < committed, (committed, report.verified)
    assert_exactly_once([f"r{i:05d}" for i in range(40)], out, out / "_rejects")


def test_units_committed_by_replicas_are_checked_as_they_commit(tmp_path, tiny_model):
    """Local replicas commit units in their own processes: the driver checks each as it is finished all the same,
    and its end check reads none of them again."""
    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)  # 10 units
    report = run_job(load_spec(job), str(tmp_path / "out"), engine_factory=FakeEngines(valid=0.6), progress=False,
                     replicas=2)
    assert report.verified["complete"] and (report.verified["read"], report.verified["trusted"]) == (0, 10), \
        report.verified
    assert_exactly_once([f"r{i:05d}" for i in range(40)], tmp_path / "out", tmp_path / "out" / "_rejects")


def test_a_resume_looks_each_record_up_once_to_plan(tmp_path, tiny_model, monkeypatch):
    """Before the first prompt a resume parses each commit record the index does not answer for once (the damage
    check, what pass 2 has left and its rows, the progress file's tally: storage/survey.py), and none that it answers
    for; it looked a unit waiting for pass 2 up four times once, which at 100 million rows (195,320 records on the
    shelves) kept its first prompt at 21 s. Killed before any part of the index was written, every record is
    parsed, once."""
    from batchjson.storage import Commits

    write_rows(tmp_path / "in.parquet", 40)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)  # 10 units
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(out), "p2:begin", "1"],
                            env=ENV | {"FAKE_VALID": "0.3"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    looks, at_start, load = [], [], Commits.load

    def counted(self, name):
        looks.append(name)
        return load(self, name)

    class Marked(FakeEngines):
        def start(self, *args):
            at_start.append(list(looks)) if not at_start else None
            return super().start(*args)

    monkeypatch.setattr(Commits, "load", counted)
    report = run_job(load_spec(job), str(out), engine_factory=Marked(valid=0.6), progress=False)
    assert report.resumed and report.verified["complete"] and at_start, report.verified
    counts = Counter(at_start[0])
    assert counts and max(counts.values()) == 1, counts


def test_a_run_whose_state_outgrows_memory_resumes_and_checks_as_one_that_fits(tmp_path, tiny_model, monkeypatch):
    """With the shelves' bound forced down to 2 KB (a job of tens of millions of rows at the default), every shelf
    of the run moves to SQLite: the run, a resume with a unit's part deleted by hand, a resume with nothing left
    and `batchjson verify` answer as with everything in memory."""
    from batchjson.storage import shelf

    monkeypatch.setattr(shelf, "LIMIT", 2_000)
    ids = [f"r{i:05d}" for i in range(48)]
    write_rows(tmp_path / "in.parquet", 48)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)  # 12 units
    out = tmp_path / "out"
    first = cli_run(monkeypatch, job)
    assert first.exit_code == 0 and claimed_rows(first.output) == 48, first.output
    gone = sorted(out.glob("p1-*.parquet"))[3]
    gone.unlink()
    again = cli_run(monkeypatch, job)
    assert again.exit_code == 0 and f"{gone.name} was missing; the unit was redone" in again.output, again.output
    assert "12 units: 0 read, 12 trusted from their commit records" in again.output, again.output  # the redone one
    # checked anew
    last = cli_run(monkeypatch, job)
    assert last.exit_code == 0 and "12 units: 0 read, 12 trusted from their commit records, not re-read (the " \
        "check of" in last.output, last.output
    assert_exactly_once(ids, out, out / "_rejects")
    assert CliRunner().invoke(cli.main, ["verify", str(job)]).exit_code == 0


@pytest.mark.parametrize("limit", [1 << 20, 2_000])
def test_a_shelf_keeps_values_by_name_off_the_heap(limit):
    """The Shelf (storage/shelf.py) answers as a dict does, values of one column or several, pages included, in
    memory and once it has moved to SQLite past its limit (2,000 bytes: midway through the first update)."""
    from batchjson.storage import shelf

    one, two = shelf.Shelf(limit=limit), shelf.Shelf(2, limit=limit)
    assert one.get("x") is None and "x" not in one and len(one) == 0 and list(one.items()) == []
    names = [f"n{k:05d}" for k in range(shelf.PAGE * 2 + 3)]
    one.update((n, n.encode()) for n in names)
    assert one.spilled == (limit < 1 << 20)
    one["n00001"] = b"again"
    two["a"] = (1, 2 ** 62)
    assert one["n00001"] == b"again" and one.get("n00002") == b"n00002" and len(one) == len(names)
    assert [n for n, _ in one.items()] == names and two.get("a") == (1, 2 ** 62) and list(two.items()) == [("a", (1, 2 ** 62))]
    assert one.pop("n00003") == b"n00003" and "n00003" not in one and one.pop("n00003", 7) == 7
    with pytest.raises(KeyError):
        one["missing"]
    one.clear()
    assert len(one) == 0 and not one.spilled


def test_a_later_run_removes_the_temporary_files_of_a_killed_one(tmp_path, tiny_model, monkeypatch):
    """Files a killed run was writing (`.tmp-<pid>-<name>`) go at the next run of the folder; a file of a process
    alive here (a `batchjson cancel` writing its marker) stays."""
    job = write_job(tmp_path, tiny_model, write_rows(tmp_path / "in.parquet", 16), batch_size=8)
    out = tmp_path / "out"
    assert cli_run(monkeypatch, job).exit_code == 0
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        left = [out / "_batchjson" / f".tmp-{gone.pid}-index.arrows",
                out / "_batchjson" / "units" / f".tmp-{gone.pid}-p2-a-00000.json",
                out / f".tmp-{gone.pid}-_report.json"]
        writing = out / "_batchjson" / f".tmp-{alive.pid}-cancel.json"
        for path in [*left, writing]:
            path.write_text("{")
        assert cli_run(monkeypatch, job).exit_code == 0
        assert [p.name for p in left if p.exists()] == [] and writing.exists()
    finally:
        alive.kill()


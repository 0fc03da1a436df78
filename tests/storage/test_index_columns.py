"""A resume plans from the index's columns (storage/index_file.py, survey.py): the records it answers for are not
read, and what it cannot vouch for is read as without it: a record written after its last part, a record or a part
file changed since, a part file deleted, a column edited by hand."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.spec import load_spec
from batchjson.storage import Storage
from batchjson.storage.index_file import INDEX, PLANNED, SCHEMA, Index, digest, fingerprint, planned
from batchjson.storage.location import Location, json_bytes
from batchjson.storage.progress import add_record
from batchjson.storage.survey import survey_units
from helpers import assert_exactly_once, record_reads, write_job, write_rows


@pytest.fixture
def finished(tmp_path, tiny_model) -> tuple[Path, Path]:
    """A finished run of 12 units (both passes), its index written: the job and its output folder."""
    write_rows(tmp_path / "in.parquet", 48)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4)
    report = run_job(load_spec(job), str(tmp_path / "out"), engine_factory=FakeEngines(valid=0.5, seed=3),
                     progress=False)
    assert report.verified["complete"] and (tmp_path / "out" / "_batchjson" / INDEX).exists()
    return job, tmp_path / "out"


def survey(out: Path, monkeypatch) -> tuple:
    """survey_units of the folder as a resume runs it (the index read, then the survey): the survey and the
    names of the record files it read."""
    read_bytes = Location.read_bytes
    read = record_reads(monkeypatch)
    storage = Storage(out)
    storage.commits.read_index()
    keys = sorted({json.loads(p.read_text())["key"] for p in (out / "_batchjson" / "units").glob("p1-*.json")})
    found = survey_units(storage.commits, keys, "id")
    monkeypatch.setattr(Location, "read_bytes", read_bytes)
    return found, read


def tallied(out: Path, but: set[str] = frozenset()) -> dict:
    """progress.py's tally of the folder's records, parsed one by one (the units `but` left out)."""
    passes = {}
    for path in sorted((out / "_batchjson" / "units").glob("p[12]-*.json")):
        record = json.loads(path.read_text())
        if record["key"] not in but:
            add_record(passes, record)
    return passes


def test_a_resume_plans_from_the_columns_without_reading_a_record(finished, monkeypatch):
    """Every record answered for by the index: none read, and the survey finds what parsing each record finds (no
    damage, what pass 2 has left, the progress file's tally)."""
    _, out = finished
    found, read = survey(out, monkeypatch)
    assert read == [] and found.damaged == {} and found.second == {}
    assert found.passes == tallied(out) and found.passes["p1"]["units"] == 12, found.passes


def test_what_the_columns_cannot_vouch_for_is_read(finished, monkeypatch):
    """A record written after the index (its entry gone from it), a record rewritten since (another stamp), a part
    file truncated (its size not the record's), a part file deleted by hand: the first two are read, the last two
    named damaged; the rest answered from the columns."""
    job, out = finished
    state, units = out / "_batchjson", out / "_batchjson" / "units"
    records = {p.name: json.loads(p.read_text()) for p in units.glob("p1-*.json")}
    names = sorted(records, key=lambda n: "output" in records[n]["files"])[-4:]  # four with an output file
    index = Location.of(state / INDEX)
    table = pa.ipc.open_file(pa.BufferReader(index.read_bytes())).read_all()
    rows = [r for r in table.to_pylist() if r["record"] is not None and r["name"] != names[0]]
    checked = [(r["name"], (r["size"], r["mtime"])) for r in table.to_pylist() if r["record"] is None]
    Index.write(index, [(r["name"], (r["size"], r["mtime"]), r["sha256"], r["record"]) for r in rows], checked)
    rewritten = units / names[1]
    rewritten.write_bytes(rewritten.read_bytes() + b"\n")  # the same record, another size: its entry is stale
    truncated = out / records[names[2]]["files"]["output"]
    truncated.write_bytes(truncated.read_bytes()[:-10])
    gone = out / records[names[3]]["files"]["output"]
    gone.unlink()

    found, read = survey(out, monkeypatch)
    assert sorted(read) == sorted(names[:2]), read
    key = {n: records[n]["key"] for n in names}
    assert found.damaged == {
        key[names[2]]: f"{truncated.name} held {truncated.stat().st_size} bytes, not the "
                       f"{truncated.stat().st_size + 10} its commit record lists",
        key[names[3]]: f"{gone.name} was missing"}, found.damaged
    assert found.passes == tallied(out, {key[names[2]], key[names[3]]})

    report = run_job(load_spec(job), str(out), engine_factory=FakeEngines(valid=0.5, seed=3), progress=False)
    assert report.verified["complete"], report.verified
    assert_exactly_once([f"r{i:05d}" for i in range(48)], out, out / "_rejects")


def test_a_column_edited_by_hand_vouches_for_nothing(finished, monkeypatch):
    """Tried as a hostile user would: a unit's row in the index's planning columns says its output file holds
    another size (the file truncated to it), with every record's bytes and digest left as they were. The batch no
    longer has its fingerprint, so no record of it is planned from the columns: each is read, and the truncated
    file found."""
    _, out = finished
    index = Location.of(out / "_batchjson" / INDEX)
    table = pa.ipc.open_file(pa.BufferReader(index.read_bytes())).read_all()
    rows = table.to_pylist()
    victim = next(r for r in rows if r["record"] is not None and r["size_output"])
    victim["size_output"] -= 10
    part = out / json.loads(victim["record"])["files"]["output"]
    part.write_bytes(part.read_bytes()[:-10])
    edited = pa.Table.from_pylist(rows, schema=SCHEMA)
    records = edited.filter(pa.compute.is_valid(edited["record"]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, SCHEMA) as writer:  # the fingerprint of the batch as it was written
        batch = records.combine_chunks().to_batches()[0]
        writer.write_batch(batch, custom_metadata={"rows": "records", "fingerprint": fingerprint(
            pa.Table.from_pylist(table.filter(pa.compute.is_valid(table["record"])).to_pylist(), schema=SCHEMA)
            .combine_chunks().to_batches()[0])})
    index.write_bytes(sink.getvalue().to_pybytes())

    found, read = survey(out, monkeypatch)
    assert len(read) == records.num_rows, read  # none planned from the edited batch
    key = json.loads(victim["record"])["key"]
    assert list(found.damaged) == [key] and "held" in found.damaged[key], found.damaged


def test_a_record_the_columns_cannot_say_is_read(tmp_path):
    """`planned` answers only for a record whose bytes have its digest and that names its files as this version
    does; anything else is left to its bytes (read and parsed)."""
    record = {"stage": "p1", "key": "u1", "files": {"output": "p1-u1.parquet", "requeue": "u1.parquet"},
              "rows": {"output": 3, "requeue": 1}, "sizes": {"output": 100, "requeue": 50}, "file": "in_0",
              "reasons": {"b": 1, "a": 2}}
    data = json_bytes(record)
    assert planned("p1-u1.json", data, digest(data)) == ("in_0", 5, 3, 0, 1, 100, None, 50, '{"a":2,"b":1}')
    assert planned("p1-u1.json", data, digest(data + b" ")) is None  # not the bytes of its digest
    assert planned("p1-u2.json", data, digest(data)) is None  # not its name
    odd = json_bytes(record | {"files": {"output": "elsewhere.parquet"}})
    assert planned("p1-u1.json", odd, digest(odd)) is None
    assert planned("p1-u1.json", b"{", digest(b"{")) is None
    assert len(PLANNED) == 3 + len(planned("p1-u1.json", data, digest(data)))


def test_an_index_of_the_version_before_is_not_read_but_replaced(finished, monkeypatch):
    """The version before wrote the index as an Arrow IPC stream of the records' bytes (no planning columns): it does
    not read as this version's, so its records are read, each once, and the run's passing check writes the index
    afresh, which the next resume plans from."""
    job, out = finished
    index = Location.of(out / "_batchjson" / INDEX)
    table = pa.ipc.open_file(pa.BufferReader(index.read_bytes())).read_all().select(
        ["name", "size", "mtime", "sha256", "record"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    index.write_bytes(sink.getvalue().to_pybytes())
    found, read = survey(out, monkeypatch)
    units = sorted(p.name for p in (out / "_batchjson" / "units").glob("p[12]-*.json"))
    assert sorted(read) == units and found.damaged == {} and found.passes == tallied(out)
    report = run_job(load_spec(job), str(out), engine_factory=FakeEngines(valid=0.5, seed=3), progress=False)
    assert report.verified["complete"], report.verified
    found, read = survey(out, monkeypatch)
    assert read == [] and found.passes == tallied(out)


def test_a_fresh_run_lists_nothing_beside_the_index(finished, monkeypatch):
    """A --fresh run clears the folder: the listings a resume takes on a thread beside the index's read
    (`Commits.read_index`) would be thrown away, so it takes none there; a resume does."""
    from batchjson.storage import listings

    job, out = finished
    threads, listed = [], listings.list_folder

    def counted(folder, *args):
        threads.append(threading.current_thread().name)
        return listed(folder, *args)

    monkeypatch.setattr(listings, "list_folder", counted)
    report = run_job(load_spec(job), str(out), fresh=True, engine_factory=FakeEngines(valid=0.5, seed=3),
                     progress=False)
    assert not report.resumed and report.verified["complete"], report.verified
    assert threads and not any(t.startswith("batchjson-listing") for t in threads), threads
    threads.clear()
    report = run_job(load_spec(job), str(out), engine_factory=FakeEngines(valid=0.5, seed=3), progress=False)
    assert report.resumed and any(t.startswith("batchjson-listing") for t in threads), threads


def test_a_record_in_two_files_of_the_index_is_planned_from_the_later(tmp_path):
    """A record in two parts of the index (rewritten after the first was written): the later part's row is planned
    from, and each other record's row stays its own (the rows were once taken by the wrong positions: the earlier
    row was kept)."""
    from batchjson.storage.index_file import part_name

    def written(key: str, size: int) -> tuple:
        record = {"stage": "p1", "key": key, "files": {"output": f"p1-{key}.parquet"}, "rows": {"output": 4},
                  "sizes": {"output": size}, "file": "in_0"}
        data = json_bytes(record)
        return f"p1-{key}.json", (len(data), size), digest(data), data

    state = Location.of(str(tmp_path))
    Index.write(state / part_name(1), [written("u1", 100), written("u2", 200), written("u3", 300)])
    Index.write(state / part_name(2), [written("u2", 222)])
    rows = {r["name"]: r["size_output"] for r in Index.read(state).planned.to_pylist()}
    assert rows == {"p1-u1.json": 100, "p1-u2.json": 222, "p1-u3.json": 300}, rows


@pytest.mark.parametrize("checked", [None, 2])
def test_a_deferred_survey_reads_now_only_the_records_of_pass_2s_units(finished, monkeypatch, checked):
    """`survey(defer=True)`, as a run takes it: nothing is listed with a stat, the output and rejects folders not at
    all (what a killed run left staged there is published as `later` finds it), and only the records of the units
    waiting for pass 2 (a requeue file, pass 1 committed, pass 2 not) are read, from their files, not the index. One
    whose requeue file was cut short is found before anything is handed out, the other is handed to pass 2 and
    tallied. A finished unit whose output file was cut short is left to `later` (beside the run), which names it
    and tallies the other records from the index, read by none; the index's files are read only then, not before
    anything is handed out. `checked`: the files looked at 2 records at a time (`CHECKED`), the same answers."""
    from batchjson.storage import listings, survey
    from batchjson.storage.index_file import Index

    if checked:
        monkeypatch.setattr(survey, "CHECKED", checked)

    _, out = finished
    units = out / "_batchjson" / "units"
    records = {p.name: json.loads(p.read_text()) for p in units.glob("p1-*.json")}
    waiting, fine = [r for r in records.values() if "requeue" in r["files"]][:2]
    done = next(r for r in records.values() if "output" in r["files"] and r["key"] not in (waiting["key"], fine["key"]))
    for unit in (waiting, fine):
        second = json.loads((units / f"p2-{unit['key']}.json").read_text())
        (units / f"p2-{unit['key']}.json").unlink()
        for kind, name in second["files"].items():
            (out / ("_rejects" if kind == "rejects" else "") / name).unlink()
    requeue = out / "_batchjson" / "requeue" / waiting["files"]["requeue"]
    requeue.write_bytes(requeue.read_bytes()[:-10])
    output = out / done["files"]["output"]
    output.write_bytes(output.read_bytes()[:-10])

    stated, listed = [], listings.list_folder

    def counted(folder, stat=True):
        stated.append((Path(folder.path).name, stat))
        return listed(folder, stat)

    monkeypatch.setattr(listings, "list_folder", counted)
    indexed, index_read = [], Index._read

    def counted_index(index, files):
        indexed.append(files)
        return index_read(index, files)

    monkeypatch.setattr(Index, "_read", counted_index)
    storage = Storage(out)
    storage.commits.read_index()
    keys = sorted(r["key"] for r in records.values())
    read = record_reads(monkeypatch)
    found = survey_units(storage.commits, keys, "id", defer=True)
    assert [f for f in stated if f[1]] == [], stated  # nothing listed with a stat
    assert sorted({name for name, _ in stated}) == ["requeue", "units"], stated  # the part folders beside the run
    assert indexed == []  # the index's files are read beside the run
    assert sorted(read) == sorted(f"p1-{unit['key']}.json" for unit in (waiting, fine)), read
    assert list(found.damaged) == [waiting["key"]] and requeue.name in found.damaged[waiting["key"]], found.damaged
    assert found.second == {fine["key"]: fine["rows"]["requeue"]}
    passes = {}
    add_record(passes, fine)
    assert found.passes == passes, found.passes
    damaged, passes = found.later()
    assert len(indexed) == 1 and indexed[0], indexed
    assert sorted(read) == sorted(f"p1-{unit['key']}.json" for unit in (waiting, fine)), read
    assert damaged == {done["key"]: f"{output.name} held {output.stat().st_size} bytes, not the "
                                    f"{output.stat().st_size + 10} its commit record lists"}
    assert passes == tallied(out, {waiting["key"], fine["key"], done["key"]}), passes

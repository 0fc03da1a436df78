"""The resume's survey: of a run's units, the committed ones that are damaged, what pass 2 has left, and the others'
records tallied, from one listing of each folder and the index's columns.

A damaged unit has a file its record lists that is gone (deleted by hand), does not read as Parquet (truncated,
emptied, overwritten) or holds another number of rows. Cheap, as every start runs it: one listing of each folder,
whose sizes are compared with those the records keep (`sizes`, written at commit); a file whose size differs is
damaged. A file not under its final name (its publish is under way, or it is gone) and any file of a record older
than `sizes` are read as verify reads them (the id column), so what verify finds unreadable a rerun redoes. `verify`
reads every file.

Planned from columns (index_file.py): the index's rows for the records listed with the indexed stamp answer for
them, compared with the folders' listings as Arrow tables; only a record they do not answer for (written after the
index's last part, or rewritten since) is read and parsed. The folders' sizes and the index's columns are held for
the survey only: the stamps the end check compares (`RunIndex.trusted`) are listed again then. Compared by look-ups
of names (`pc.index_in`), not Acero joins: at 100 million rows (killed at 99%) the planning's peak was 458-464 MiB
with joins, 324-356 with look-ups, and the resume's 497-505 and 362-394.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from batchjson.storage import listings
from batchjson.storage.commits import Commits, DamagedRecord
from batchjson.storage.index_file import BITS, PLANNED, SCHEMA, planning_columns
from batchjson.storage.location import Location, Unreadable
from batchjson.storage.names import (KINDS, STAGED, Kind, Stage, UnitName, keys_of, of_stage, part_names_of,
                                     records_of, requeued_keys_of, stages_of, staged, staged_of, unit_ids_of)
from batchjson.storage.progress import add_reasons, empty_tally

PLANNED_SCHEMA = SCHEMA.empty_table().select(PLANNED).schema  # the index's planning columns
CHECKED = 32768  # the records whose files `_check_sizes` looks at together
LISTED_PAGE = 1000  # the keys one request of an object store's listing answers (S3's page)


@dataclass
class Survey:
    """What a run's start finds of its units (`survey_units`)."""

    damaged: dict[str, str] = field(default_factory=dict)
    """Unit -> what is wrong with it: the run redoes it."""
    second: dict[str, int] = field(default_factory=dict)
    """Unit -> the rows it has waiting for pass 2, whose pass 2 is not committed."""
    passes: dict = field(default_factory=dict)
    """The records of the units that are not damaged, tallied by pass (progress.py `add_record`): the progress
    file's counts at the start (those `later` surveys join when it answers)."""
    later: Callable[[], tuple[dict[str, str], dict]] | None = None
    """The survey of the committed units that no pass hands out (`survey_units`' `defer`), to be run beside the
    run: their `damaged` and `passes`. None when every unit was surveyed already."""


def survey_units(commits: Commits, keys: list[str], id_column: str, defer: bool = False) -> Survey:
    """Of these units, the committed ones that are damaged (`Survey.damaged`), the rows each of the others has
    waiting for pass 2 while its pass 2 is not committed (`Survey.second`), and the others' records tallied
    (`Survey.passes`). Once they are surveyed, the index's copies of the records answer (`Index.answer`).

    `defer`: only the units pass 2 hands out are surveyed now, from their records, read (not the index): those with
    a requeue file whose pass 1 is committed and whose pass 2 is not, each of their files looked at (a stat; on
    object storage, where a look is a request, each part folder listed instead once they are more than a listing's
    pages). The other committed units are surveyed by `Survey.later`, which the run calls beside its passes (job.py
    redoes what it finds damaged, and adds their tally to the progress file's): it lists the records with their
    stamps, by which the index answers for them, and the part folders. At 100 million rows these listings (585,000
    files, a stat each), the index's answers and their tally took 1.5-2 s of the resume's way to its first prompt;
    on object storage the index's parts and the records after its last part are requests too (BENCHMARKS.md, "A
    resume after a kill at 99%")."""
    index = commits.index.files
    names = commits.listed_records["name"]  # the records of these units (names only: all the survey takes of them)
    of_keys = pc.is_in(keys_of(names), value_set=pa.array(keys, pa.string()))
    mine = names if pc.all(of_keys).as_py() else names.filter(of_keys)  # else another shard's records too
    found, flaws, parsed = Survey(), {}, {}  # flaws: key -> (where, what); parsed: name -> record read now
    if defer:  # pass 2's units now, from their records; the rest beside the run
        held = requeued_keys_of(commits.listings.take(commits.folders["requeue"], stat=False)["name"])
        first, second = (keys_of(mine.filter(of_stage(mine, stage))) for stage in Stage)
        held = held.filter(pc.and_(pc.is_in(held, value_set=first), pc.invert(pc.is_in(held, value_set=second))))
        records = _read_records(commits, UnitName.unit_ids(Stage.FIRST, held.to_pylist()), parsed, flaws)
        # a look per file, unless on object storage the looks would be more requests than a listing's pages
        look = commits.units.local or records.num_rows <= max(1, len(names) // LISTED_PAGE)
        for kind, folder in commits.folders.items():
            _check_sizes(commits, kind, records, parsed, flaws, id_column,
                         folder if look else commits.listings.take(folder))
        done = pa.array([*records["key"].to_pylist(), *flaws], pa.string())
        rest = mine.filter(pc.invert(pc.is_in(keys_of(mine), value_set=done)))
        if len(rest):
            found.later = lambda: _later(commits, rest, parsed, id_column)
    else:
        index.start()  # its files read beside the listings
        if commits.units.local:  # the stamps the index's entries answer by (`committed` lists names)
            index.listed(records_of(commits.listings.take(commits.units)))
        records = _answered(commits, mine, parsed, flaws)
        for kind, folder in commits.folders.items():  # each listing taken once, not held past its look
            _check_sizes(commits, kind, records, parsed, flaws, id_column, commits.listings.take(folder))
    commits.listings.clear()
    if found.later is None:
        index.answer()
    found.damaged = _worst(flaws)
    records = _without(records, found.damaged)
    waiting = records.filter(pc.and_(pc.equal(records["stage"], Stage.FIRST.value), pc.not_equal(pc.bit_wise_and(
        records["kinds"], BITS["requeue"]), 0)))
    second = names.filter(of_stage(names, Stage.SECOND))  # the units whose pass 2 is committed
    waiting = waiting.filter(pc.invert(pc.is_in(waiting["key"], value_set=keys_of(second))))
    found.passes = _tally(records)
    found.second = dict(zip(waiting["key"].to_pylist(), waiting["rows_requeue"].to_pylist()))
    del records, waiting
    # The survey's tables go back to the system, not kept by Arrow's allocator under the run's own memory (and
    # `later`'s listings) after: at 100 million rows the driver's peak is at the start since `later`.
    pa.default_memory_pool().release_unused()
    return found


def _later(commits: Commits, names: pa.Array, parsed: dict, id_column: str) -> tuple[dict[str, str], dict]:
    """`Survey.later`: of these records (the start's, of the units no pass hands out), the damaged units and the
    others' records tallied, from the records listed now with their stamps (the index's answers), one listing of
    each part folder with a stat of each file, and the records the index does not answer for, read. On a thread of
    its own beside the run: it changes nothing in the folder, and what it reads no pass touches."""
    flaws, release, index = {}, pa.default_memory_pool().release_unused, commits.index.files
    index.start()  # its files read beside the records' listing, not before the first prompt
    index.listed(records_of(listings.list_folder(commits.units)))  # the stamps the index's entries answer by
    records = _answered(commits, names, parsed, flaws)
    for kind, folder in commits.folders.items():
        _check_sizes(commits, kind, records, parsed, flaws, id_column, listings.list_folder(folder))
        release()  # each folder's look handed back before the next is listed, not piled on it
    damaged = _worst(flaws)
    passes = _tally(_without(records, damaged))
    index.answer()
    del records
    # What the listings took goes back to the system rather than staying with Arrow's allocator through the run
    # (its end check is the driver's peak: 406-408 MiB at 100 million rows with it kept, BENCHMARKS.md).
    pa.default_memory_pool().release_unused()
    return damaged, passes


def _answered(commits: Commits, names: pa.Array, parsed: dict, flaws: dict) -> pa.Table:
    """The planning columns of these records, with their pass and unit (`stage`, `key`): the index's rows where it
    answers for them (listed with the indexed stamp), else read now (`_read_records`). The index's columns go after
    (`drop_planned`)."""
    index = commits.index.files
    answers = index.answers(names)
    index.drop_planned()  # its columns are not held longer
    pa.default_memory_pool().release_unused()  # nor kept by Arrow's allocator under what follows
    unanswered = pc.filter(names, pc.invert(pc.is_in(names, value_set=answers["name"])))
    read = _read_records(commits, unit_ids_of(unanswered).to_pylist(), parsed, flaws)
    return pa.concat_tables([_keyed(answers), read])


def _read_records(commits: Commits, units: Iterable[str], parsed: dict, flaws: dict) -> pa.Table:
    """The planning columns of these units' records ("p1-<unit>"), with `stage` and `key`, each read now (or taken
    from `parsed`) and kept in `parsed`; one that does not read as a record is a flaw of its unit, one gone since it
    was listed is left out."""
    rows = []
    for unit in units:
        name_of = UnitName.parse(unit)
        name = name_of.file_name()
        try:
            record = parsed[name] if name in parsed else commits.load(name)
        except FileNotFoundError:
            continue  # gone since it was listed
        except DamagedRecord as e:
            flaws.setdefault(name_of.key, []).append(((list(Stage).index(name_of.stage), -1), str(e)))
            continue
        parsed[name] = record
        rows.append(dict(zip(PLANNED, (name, 0, 0, *planning_columns(record)))))
    return _keyed(pa.Table.from_pylist(rows, schema=PLANNED_SCHEMA))


def used(commits: Commits, files: set[str]) -> Counter:
    """The committed units of pass 1 of each of these input files (their tags), from the index's columns where they
    answer (`survey_units`), else from the records."""
    records = commits.listed_records
    names = records.filter(of_stage(records["name"], Stage.FIRST))["name"]
    answers = commits.index.files.answers()
    answers = answers.filter(pc.is_in(answers["name"], value_set=names))
    used = Counter({tag: n for tag, n in zip(*(c.to_pylist() for c in pc.value_counts(answers["file"]).flatten()))
                    if tag in files})
    for name in pc.filter(names, pc.invert(pc.is_in(names, value_set=answers["name"]))).to_pylist():
        try:
            record = commits.load(name)
        except (FileNotFoundError, DamagedRecord):
            continue
        if record.get("file") in files:
            used[record["file"]] += 1
    return used


def _check_sizes(commits: Commits, kind: Kind, records: pa.Table, parsed: dict, flaws: dict, id_column: str,
                 listing: pa.Table | Location) -> None:
    """The survey's look at the files of one kind that the records list: each listed with the size its record
    keeps, or read (`_flaw`) where it is not listed under its final name or its record keeps no size. `listing`:
    the folder's listing, or the folder, whose files of these records are each looked at (a stat). Looked at 32,768
    records at a time: at 100 million rows (193,547 records) the output files' look at them all took 55 MiB of
    Arrow's memory beside the run, 32,768 at a time 26 (most of it the listing's look-up)."""
    if isinstance(listing, Location):
        mine = _having(kind, records)
        listing = listings.stat_files(listing, part_names_of(kind, mine["stage"], mine["key"]).to_pylist())
    staged_left = listing["name"].filter(pc.ends_with(listing["name"], STAGED))  # none unless a run was killed
    for start in range(0, records.num_rows, CHECKED):
        _check_slice(commits, kind, records.slice(start, CHECKED), parsed, flaws, id_column, listing, staged_left)


def _check_slice(commits: Commits, kind: Kind, records: pa.Table, parsed: dict, flaws: dict, id_column: str,
                 listing: pa.Table, staged_left: pa.ChunkedArray) -> None:
    """`_check_sizes` of some of the records, against the folder's whole listing (`staged_left`: its staged
    names)."""
    mine = _having(kind, records.select(["name", "stage", "key", "kinds", f"rows_{kind}", f"size_{kind}"]))
    file = part_names_of(kind, mine["stage"], mine["key"])
    # each file's size as listed, null where it is not: looked up by name, not joined (index_file.py's `as_listed`)
    seen = listing["size"].take(pc.index_in(file, value_set=listing["name"]))
    files = mine.append_column("file", file).append_column("seen", seen)
    kept = files[f"size_{kind}"]
    differ = files.filter(pc.and_(pc.and_(pc.is_valid(kept), pc.is_valid(seen)), pc.not_equal(kept, seen)))
    unknown = files.filter(pc.or_(pc.is_null(kept), pc.is_null(seen)))
    if len(staged_left):  # a staged copy beside its published file: a kill between a publish's copy and delete
        published = files.filter(pc.is_valid(seen))["file"]
        for name in published.filter(pc.is_in(staged_of(published), value_set=staged_left)).to_pylist():
            (commits.folders[kind] / staged(name)).unlink(missing_ok=True)
    order = KINDS.index(kind)
    for row in differ.to_pylist():
        record = parsed.get(row["name"])
        name = record["files"][kind] if record else row["file"]  # as the record names it
        flaws.setdefault(row["key"], []).append((
            (list(Stage).index(row["stage"]), order),
            f"{name} held {row['seen']} bytes, not the {row[f'size_{kind}']} its commit record lists"))
    for row in unknown.to_pylist():
        record = parsed.get(row["name"]) or {"stage": row["stage"], "key": row["key"],
                                             "files": {kind: row["file"]}, "rows": {kind: row[f"rows_{kind}"]}}
        flaw = _flaw(commits, record, kind, id_column)
        if flaw:
            flaws.setdefault(row["key"], []).append(((list(Stage).index(row["stage"]), order), flaw))


def _flaw(commits: Commits, record: dict, kind: Kind, id_column: str) -> str:
    """What is wrong with a committed file the survey did not find listed with its size: "" if nothing. One not
    under its final name is published first where a killed run left it staged (`Commits.publish_left`)."""
    name, rows = record["files"][kind], record["rows"][kind]
    path = commits.part(record["stage"], record["key"], kind)
    try:
        try:
            found = path.read_parquet([id_column]).num_rows
        except FileNotFoundError:
            if commits.publish_left(path):
                commits.after(f"published {kind}", record["stage"])
            found = path.read_parquet([id_column]).num_rows
    except FileNotFoundError:
        return f"{name} was missing"
    except Unreadable as e:
        return str(e)
    return "" if found == rows else f"{name} held {found} rows, not the {rows} its commit record lists"


def _keyed(records: pa.Table) -> pa.Table:
    """The index's planning columns of these records, with each one's pass (`stage`, "p1") and unit (`key`)."""
    return records.append_column("stage", stages_of(records["name"])).append_column("key", keys_of(records["name"]))


def _having(kind: Kind, records: pa.Table) -> pa.Table:
    """These records (`_keyed`), those that list a file of this kind."""
    return records.filter(pc.not_equal(pc.bit_wise_and(records["kinds"], BITS[kind]), 0))


def _without(records: pa.Table, damaged: dict[str, str]) -> pa.Table:
    """These records (`_keyed`), but those of the damaged units."""
    if not damaged:
        return records
    return records.filter(pc.invert(pc.is_in(records["key"], value_set=pa.array(list(damaged), pa.string()))))


def _worst(flaws: dict) -> dict[str, str]:
    """Unit -> what is wrong with it, of its flaws (place, what) the first by place (its pass, then kind)."""
    return {key: min(found)[1] for key, found in sorted(flaws.items())}


def _tally(records: pa.Table) -> dict:
    """`add_record`'s tally (progress.py) of these rows of the records' columns, by pass, as arrays: the reasons
    are JSON, each distinct one parsed once."""
    passes = {}
    for stage in sorted(set(records["stage"].to_pylist())):
        mine = records.filter(pc.equal(records["stage"], stage))
        tally = passes[stage] = empty_tally()
        tally["units"] = mine.num_rows
        for kind in KINDS:
            tally[kind] = pc.sum(mine[f"rows_{kind}"]).as_py() or 0
        tally["requeued_units"] = pc.sum(pc.greater(mine["rows_requeue"], 0).cast(pa.int64())).as_py() or 0
        counts = pc.value_counts(mine["reasons"])
        for text, n in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()):
            add_reasons(tally, orjson.loads(text or "{}"), n)
    return passes

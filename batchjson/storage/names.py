"""The names of a run's files: a unit's part files and commit records, formatted and parsed in one place.

After dlt's `ParsedLoadJobFileName` (dlt/common/storages/load_package.py): a frozen value with `file_name()` and
`parse(name)`, so a name is built and read back by the same code. The survey and the index handle names by the
hundred thousand as Arrow arrays: their vector forms (`unit_ids_of`, `keys_of`, `part_names_of`, ...) are here too,
beside the scalar ones they must agree with. The names are the on-disk format of every output
folder written so far; a folder written before resumes only while they stay as they are:

    p1-<unit>.parquet, p2-<unit>.parquet                  valid rows of a pass (the output folder)
    rejects-p1-<unit>.parquet, rejects-p2-<unit>.parquet  rejected rows with their reason (the rejects folder)
    <unit>.parquet                                        pass-1 failures waiting for pass 2 (the requeue folder)
    p1-<unit>.json, p2-<unit>.json                        commit records (the units folder)
    .<part>.tmp                                           a part file staged before its record (see commits.py)
    spec.json                                             the job spec, in the run state folder (SPEC)
    scan.json                                             the input scan kept for the next run, there too (SCAN)
    _report.json, _report-<I>of<N>.json                   the run report, of the whole folder or of a shard
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc

from batchjson.records import Stage

Kind = Literal["output", "rejects", "requeue"]
KINDS: tuple[Kind, ...] = ("output", "rejects", "requeue")  # the kinds of part files, in the order a survey names flaws
STAGE_KINDS: dict[Stage, tuple[Kind, ...]] = {Stage.FIRST: KINDS, Stage.SECOND: ("output", "rejects")}  # only pass 1
# requeues
STAGES: tuple[Stage, ...] = tuple(Stage)
STAGED = ".tmp"  # a staged file's suffix (after a leading dot)
PARQUET, JSON = ".parquet", ".json"
REJECTS = "rejects-"
RECORDS = "p[12]-*.json"  # the commit records' names, as a glob (`is_record`)
SPEC = "spec.json"  # the run state's copy of the job spec: what marks a folder as a batchjson run's
SCAN = "scan.json"  # the run state's input scan, kept for the next run (Storage.keep_scan)


def report_name(shard: tuple[int, int]) -> str:
    """The run report's file name in the output folder: the whole folder's, or one shard's of a layout."""
    i, n = shard
    return "_report.json" if n == 1 else f"_report-{i}of{n}.json"


@dataclass(frozen=True, slots=True)
class UnitName:
    """One unit of one pass: the name of its commit record, and its id in the set of committed units."""

    stage: Stage
    key: str

    def unit_id(self) -> str:
        """"p1-<unit>": how the folder's listing of commit records names this unit."""
        return f"{self.stage}-{self.key}"

    def file_name(self) -> str:
        return f"{self.unit_id()}{JSON}"

    @staticmethod
    def unit_ids(stage: Stage, keys: Iterable[str]) -> Iterator[str]:
        """`unit_id` of each of these units of one pass, without an object made for each (97,660 of them took 0.15 s
        of a 100M-row resume's way to its first prompt; the pass formatted once, not for each: 0.03 s, 0.01)."""
        prefix = f"{stage}-"
        return (prefix + key for key in keys)

    @staticmethod
    def is_record(name: str) -> bool:
        """Whether `name` is a commit record's file name (`records_of` for a listing)."""
        return fnmatchcase(name, RECORDS)

    @classmethod
    def parse(cls, name: str) -> UnitName:
        """A record's file name ("p1-<unit>.json") or a unit id ("p1-<unit>"); ValueError for anything else."""
        stem = name.removesuffix(JSON)
        stage, dash, key = stem[:2], stem[2:3], stem[3:]
        if stage not in STAGES or dash != "-" or not key:
            raise ValueError(f"not a unit's name: {name!r}")
        return cls(Stage(stage), key)


@dataclass(frozen=True, slots=True)
class PartName:
    """One part file of a unit: which pass wrote it, for which unit, and of which kind (the folder it goes to)."""

    stage: Stage
    key: str
    kind: Kind

    def file_name(self) -> str:
        if self.kind == "requeue":  # only pass 1 requeues, so the unit alone names it
            return f"{self.key}{PARQUET}"
        unit = UnitName(self.stage, self.key).unit_id()
        return f"{REJECTS}{unit}{PARQUET}" if self.kind == "rejects" else f"{unit}{PARQUET}"

    def staged_name(self) -> str:
        """The hidden name the file is written under before its unit's record exists."""
        return staged(self.file_name())

    @property
    def unit(self) -> UnitName:
        return UnitName(self.stage, self.key)

    @classmethod
    def parse(cls, name: str, kind: Kind | None = None) -> PartName:
        """A part file's name, final or staged. `kind`: "requeue" for a name in the requeue folder, which the name
        alone does not tell from an output file; otherwise the name says output or rejects. ValueError for a name
        that is neither."""
        name = unstaged(name)
        if not name.endswith(PARQUET):
            raise ValueError(f"not a part file's name: {name!r}")
        stem = name[:-len(PARQUET)]
        if kind == "requeue":
            if not stem:
                raise ValueError(f"not a part file's name: {name!r}")
            return cls("p1", stem, "requeue")
        found: Kind = "rejects" if stem.startswith(REJECTS) else "output"
        if kind is not None and kind != found:
            raise ValueError(f"not a name of {kind} part: {name!r}")
        try:
            unit = UnitName.parse(stem.removeprefix(REJECTS))
        except ValueError:
            raise ValueError(f"not a part file's name: {name!r}") from None
        return cls(unit.stage, unit.key, found)


def staged(name: str) -> str:
    """".<name>.tmp": dataset readers skip a leading dot, DuckDB's '*.parquet' globs the suffix."""
    return f".{name}{STAGED}"


def is_staged(name: str) -> bool:
    """Whether `name` is a part file's staged name (`staged`)."""
    return name.startswith(".") and name.endswith(f"{PARQUET}{STAGED}")


def legacy_staged(name: str) -> str:
    """".<name>": a part file staged by a version before STAGED (DuckDB's '*.parquet' reads it)."""
    return f".{name}"


def is_legacy_staged(name: str) -> bool:
    """Whether `name` is a part file's name as a version before STAGED staged it (`legacy_staged`)."""
    return name.startswith(".") and name.endswith(PARQUET)


def legacy_unstaged(name: str) -> str:
    """The final name of a part file a version before STAGED staged (`legacy_staged`)."""
    return name[1:]


def unstaged(name: str) -> str:
    """The final name of a staged one (a final name unchanged)."""
    if name.startswith(".") and name.endswith(STAGED):
        return name[1:-len(STAGED)]
    return name


# ----- the vector forms: the same names as Arrow arrays, for listings of a folder's hundreds of thousands ---------
def records_of(listed: pa.Table) -> pa.Table:
    """The rows of a folder's listing (`name`, ...) that are commit records (`UnitName.is_record`)."""
    return listed.filter(pc.match_substring_regex(listed["name"], r"^p[12]-.*\.json$"))


def unit_ids_of(records: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """`UnitName.unit_id` of each record's file name ("p1-<unit>.json" -> "p1-<unit>")."""
    return pc.utf8_slice_codeunits(records, 0, -len(JSON))


def stages_of(records: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """The pass ("p1", "p2") of each record's file name."""
    return pc.utf8_slice_codeunits(records, 0, 2)


def of_stage(records: pa.Array | pa.ChunkedArray, stage: Stage) -> pa.Array | pa.ChunkedArray:
    """Which of these records' file names (or unit ids) are of this pass, as a mask."""
    return pc.starts_with(records, f"{stage}-")


def keys_of(records: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """The unit (`UnitName.key`) of each record's file name."""
    return pc.utf8_slice_codeunits(records, 3, -len(JSON))


def part_names_of(kind: Kind, stages: pa.ChunkedArray, keys: pa.ChunkedArray) -> pa.ChunkedArray:
    """`PartName.file_name` of each unit (its pass and key) for files of this kind."""
    unit = pc.binary_join_element_wise(stages, keys, "-")
    return (pc.binary_join_element_wise(unit, PARQUET, "") if kind == "output" else
            pc.binary_join_element_wise(REJECTS, unit, PARQUET, "") if kind == "rejects" else
            pc.binary_join_element_wise(keys, PARQUET, ""))


def staged_of(names: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """`staged` of each name."""
    return pc.binary_join_element_wise(".", names, STAGED, "")


def requeued_keys_of(names: pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """The units whose requeue file is among the requeue folder's `names`, under its final name or staged (by this
    version, ".<name>.tmp", or by one before STAGED, ".<name>"): each once."""
    hidden = pc.starts_with(names, ".")
    if pc.any(hidden).as_py():
        unstaged_names = pc.replace_substring_regex(names.filter(hidden), rf"^\.(.*?)({re.escape(STAGED)})?$", r"\1")
        names = pc.unique(pa.chunked_array([*names.filter(pc.invert(hidden)).chunks, *unstaged_names.chunks]))
    return pc.utf8_slice_codeunits(names.filter(pc.ends_with(names, PARQUET)), 0, -len(PARQUET))

"""The output folder: its layout, its claim, resume and swap, and the input fingerprints.

Every path of a run and of its run state is built here, from the names of storage/'s other modules: the file names
(parts, commit records, the spec, the kept scan, the report) are names.py's (`PartName`, `UnitName`, `report_name`),
the unit commits commits.py's (`Commits`, this folder's `commits`), the progress files and the cancel marker
progress.py's, the locks and leases locks.py's. Nothing outside storage/ builds or parses these names: the rest of
batchjson asks a `Storage` (ends.output_folder) for the path. The layout of an output folder OUT (rejects in
OUT/_rejects unless output.rejects says otherwise):

    OUT/p1-<unit>.parquet, OUT/p2-<unit>.parquet          valid rows of pass 1 and pass 2
    REJECTS/rejects-p1-<unit>.parquet, rejects-p2-...     rejected rows with their reason
    OUT/_report.json (_report-IofN.json for a shard)      the run report
    OUT/_batchjson/spec.json                              the spec the folder belongs to
    OUT/_batchjson/inputs/<file>.json                     each input file's fingerprint
    OUT/_batchjson/units/p1-<unit>.json, p2-<unit>.json   commit records: a unit's files, rows and reasons
    OUT/_batchjson/requeue/<unit>.parquet                 pass-1 failures waiting for pass 2
    OUT/_batchjson/scan.json                              the input's fingerprints and repeated ids, for a resume
    OUT/_batchjson/index.arrows, index-part-<N>.arrows    the records folded into a few files (Arrow IPC), for a
                                                          cheap resume (index.py)
    OUT/_batchjson/progress-<I>of<N>.json, cancel.json    what `batchjson status` reads, `batchjson cancel` (progress.py)
    OUT/_batchjson/lock-of<N>, lock-<I>of<N>              locks (a local folder)
    OUT/_batchjson/lease-<I>of<N>-<owner>.json            leases (object storage)

OUT may be a local folder or an object-storage prefix (s3://bucket/out, gs://...; see location.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from batchjson.errors import InputError, OutputError, ResumeConflict, StorageFull, is_full
from batchjson.storage import survey
from batchjson.storage.commits import Commits
from batchjson.storage.location import Location, glob_match, temporary_pid, writing
from batchjson.storage.locks import HELD, Lease, lock_folder, release
from batchjson.storage.names import PARQUET, SCAN, SPEC, PartName, Stage, report_name, staged

STATE = "_batchjson"  # leading underscore: Parquet dataset readers (pyarrow, DuckDB, Polars) skip it


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def _changed(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints of one input file. The modification time or ETag (`stamp`) counts only
    for generated ids, which nothing but the file's place vouches for; with an id column, the ids' digest does."""
    keys = ("size", "rows", "footer", "ids") + (("stamp",) if new.get("ids") == "generated" else ())
    return [k for k in keys if old.get(k) != new.get(k)]


def _alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (this process does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def hidden_below(inner: Location, outer: Location) -> bool | None:
    """None if `inner` is not inside `outer`; else whether a name on the way starts with _ or . (which dataset
    readers skip)."""
    parts = inner.parts_below(outer)
    return None if parts is None else any(p.startswith(("_", ".")) for p in parts)


class Storage:
    """The output folder of one job (one shard of it): layout, locks and run state; its unit commits are `commits`."""

    def __init__(self, output: str | Path | Location, rejects: str | Path | Location | None = None,
                 shard: tuple[int, int] = (0, 1)):
        self.output = Location.of(output)
        self.rejects = Location.of(rejects) if rejects else self.output / "_rejects"
        self.shard = shard
        self.state = self.output / STATE
        self.units = self.state / "units"
        self.inputs = self.state / "inputs"
        self.requeue_dir = self.state / "requeue"
        self.spec_file = self.state / SPEC  # written when a run claims the folder: the folder holds a batchjson run
        self.scan_file = self.state / SCAN
        self._locks: list = []
        self._lease: Lease | None = None
        self.commits = Commits({"output": self.output, "rejects": self.rejects, "requeue": self.requeue_dir},
                               self.units, self.state, guard=self._check_claim)

    # ----- where things go -------------------------------------------------------------------------------------
    def check_paths(self, input_path: str | None = None) -> None:
        """Refuse layouts that would mix or lose rows, before anything is written."""
        out, rej = self.output, self.rejects
        out.check_bucket()
        rej.check_bucket()
        if out.is_file():
            raise OutputError(f"the output path {out} is a file. Point output.path (or --output) at a folder.")
        if rej.parts_below(out) == ():
            raise OutputError(f"output.rejects is the output folder {out}: rejected rows would be read as output. "
                              "Leave output.rejects out (rejects go to <output>/_rejects) or choose another folder.")
        if hidden_below(rej, out) is False:
            raise OutputError(f"output.rejects {rej} is inside the output folder under a name that dataset readers "
                              f"take for output rows. Name it with a leading underscore (e.g. {out / '_rejects'}).")
        if out.parts_below(rej) is not None:
            raise OutputError(f"the output folder {out} is inside output.rejects {rej}. Choose separate folders.")
        if input_path:
            # Compared as locations (normalized, a URI's ?options aside), never as the strings the user wrote.
            source = Location.of(input_path, InputError)
            pattern = any(c in source.path for c in "*?[")
            for name, folder in (("output folder", out), ("output.rejects folder", rej)):
                if pattern:  # a file this run would write there, matched against the glob as glob.glob would
                    probe = folder.normal().split("/") + [PartName(Stage.FIRST, "x", "output").file_name()]
                    hit = folder.scheme == source.scheme and glob_match(probe, source.normal().split("/"))
                else:
                    hit = source.is_dir() and hidden_below(folder, source) is False
                if hit:
                    raise OutputError(f"the {name} {folder} is inside the input {input_path}: its part files would be "
                                      "read back as input on the next run. Choose a folder outside the input.")

    def report_path(self) -> Location:
        return self.output / report_name(self.shard)

    # ----- claiming the folder ---------------------------------------------------------------------------------
    def open(self, spec_hash: str, fingerprint: dict, if_exists: str = "resume", fresh: bool = False,
             inputs: dict[str, dict] | None = None) -> bool:
        """Claim the folder for this spec and, given the input files' fingerprints (`inputs`), check them against the
        committed units' (`check_inputs`); returns True when it resumes an earlier run. Every refusal comes before
        the first write or delete in the run state: a refused run leaves the folder as it found it."""
        i, n = self.shard
        if n > 1 and (fresh or if_exists != "resume"):
            raise OutputError(f'--fresh and output.if_exists = "{if_exists}" cannot be used with --shard: shards '
                              f"share {self.output}. Clear the folder once before starting the shards, and run them "
                              'with output.if_exists = "resume".')
        spec_file = self.spec_file
        if not spec_file.exists() and any(not name.startswith(("_", ".")) for name in self.output.names()):
            raise OutputError(f"{self.output} is not empty and holds no batchjson run. Choose an empty or new folder.")
        for d in (self.output, self.state, self.units, self.inputs, self.requeue_dir, self.rejects):
            try:
                d.mkdir()
            except OSError as e:
                if is_full(e):
                    raise StorageFull.at(d, e) from None
                raise OutputError(f"cannot create {d}: {e.strerror}. Check the path and permissions.") from None
        self.claim()
        start_over = fresh or if_exists == "overwrite"
        self.commits.read_index(prefetch=not start_over)  # the folders a run clears are not listed for it
        existing = spec_file.exists()
        if existing and start_over:
            self._clear()
            existing = False
        elif existing and if_exists == "fail":
            raise OutputError(f"{self.output} already holds a run (output.if_exists = \"fail\"). Choose another "
                              "--output, or pass --fresh to start over.")
        elif existing:
            old = spec_file.read_json()
            if old["hash"] != spec_hash and self.commits.committed():
                changes = _diff(old["spec"], json.loads(json.dumps(fingerprint, default=str)))
                raise ResumeConflict(f"{self.output} holds a run of a different spec (changed: {'; '.join(changes[:5])}). "
                                     "Rerun with --fresh to discard it and start over, or choose another --output.")
        known = self._compare_inputs(inputs) if inputs is not None else {}
        # No refusal after this line: the run goes on, and only from here does it write or delete.
        if self._locks:
            self._remove_temporaries()
        if not existing or spec_file.read_json()["hash"] != spec_hash:
            # Until a unit commits, the folder belongs to no spec: a corrected rerun after a failed start is welcome.
            with writing(spec_file):
                spec_file.write_json({"hash": spec_hash, "spec": fingerprint})
        if inputs is not None:
            self._write_inputs(inputs, known)
        return existing and bool(self.commits.committed())

    def claim(self) -> None:
        """Lock the folder: shards of one job (same N) run together, anything else waits its turn. A local folder
        takes flock locks, object storage a lease (locks.py says how each is safe)."""
        if self._locks or self._lease:
            return
        busy = (f"another batchjson run is writing to {self.output} right now. Wait for it to finish, or choose "
                "another --output.")
        if not self.state.local:
            self.state.mkdir()
            lease = Lease(self.state, self.shard)
            lease.acquire(busy)
            self._lease = lease
            return
        self._locks = lock_folder(Path(self.state.path), self.shard, busy)

    def _remove_temporaries(self) -> None:
        """Remove the temporary files a killed run left in a local folder (location.write_json's
        `.tmp-<pid>-<name>`: the run state's, its records', the report's). Only a run that holds the whole folder
        does, as its locks say: no other run may write there then, though a `batchjson cancel` may, so a file of a process alive on this host
        (or of this one) stays. A shard leaves them to the next run of the whole folder."""
        if self.shard[1] != 1:
            return
        for folder in (self.state, self.units, self.inputs, self.output):
            for name in folder.names():
                pid = temporary_pid(name)
                if pid is not None and not _alive(pid):
                    (folder / name).unlink(missing_ok=True)

    def _check_claim(self) -> None:
        """Raise if this run lost the folder (on object storage, its lease): no unit may commit then."""
        if self._lease:
            self._lease.check()

    def close(self) -> str:
        """Release the folder. Returns a note for the user when a lease stays behind (Lease.release), else ""."""
        release(self._locks)
        lease, self._lease = self._lease, None
        return lease.release() if lease else ""

    def _clear(self) -> None:
        for folder in (self.output, self.rejects):
            for p in folder.glob(f"*{PARQUET}") + folder.glob(staged(f"*{PARQUET}")):
                p.unlink(missing_ok=True)
        for name in self.state.names():
            if not name.startswith(HELD):
                p = self.state / name
                p.rmtree() if p.is_dir() else p.unlink(missing_ok=True)
        for d in (self.units, self.inputs, self.requeue_dir):
            d.mkdir()
        self.commits.forget()

    def swap_in(self, new: Location) -> None:
        """Make the finished run folder `new` (rejects in its _rejects) this output folder, in place of whatever
        this folder holds; `new` is gone afterwards. The folder is claimed meanwhile, so no run writes to it.

        Locally, two renames: this folder to a hidden sibling, then `new` into place. Between them the folder is
        absent; readers never see old and new rows together. Object storage has no renames: this folder's objects
        are deleted, then `new`'s are copied in, and deleted. A reader meanwhile sees part of the old folder or
        part of the new one, never rows of both, never a row twice; the report goes first and comes back last, so
        it is absent for the whole swap. Part files go before the run state and come after it, so a kill
        midway leaves commit records whose files are missing, never a file no record lists: a run on the folder
        redoes those units."""
        self.claim()
        try:
            if self.output.local:
                old = new.with_name(f"{new.name}.old")
                if old.exists():  # a killed swap's
                    old.rmtree()
                self.output.move(old)  # claim() made sure it exists
                new.move(self.output)
                old.rmtree()
                return
            report, state = self.report_path().name, f"{STATE}/"
            for below in sorted(self.output.tree(), key=lambda b: (b != report, b.startswith(state))):
                if self.output / below != self._lease.file:
                    (self.output / below).unlink(missing_ok=True)
            copied = [b for b in new.tree() if not b.startswith(f"{state}lease-")]
            for below in sorted(copied, key=lambda b: (b == report, not b.startswith(state))):
                (new / below).copy(self.output / below)
            new.rmtree()
        finally:
            self.close()

    # ----- input fingerprints ----------------------------------------------------------------------------------
    def check_inputs(self, fingerprints: dict[str, dict], write: bool = True) -> list[str]:
        """Compare the input with the one committed units came from; returns the tags of new files.

        New files are added work. A file that changed or disappeared is refused when units from it are committed
        (their rows could no longer be matched to the input); otherwise its fingerprint is simply replaced."""
        known = self._compare_inputs(fingerprints)
        if write:
            self._write_inputs(fingerprints, known)
        return [t for t in fingerprints if t not in known]

    def _compare_inputs(self, fingerprints: dict[str, dict]) -> dict[str, dict]:
        """`check_inputs`' refusals, writing nothing; returns the fingerprints the folder holds (tag -> fingerprint)."""
        known = {p.name[:-5]: p.read_json() for p in self.inputs.glob("*.json")}
        gone = {tag for tag, old in known.items() if (new := fingerprints.get(tag)) is None or _changed(old, new)}
        # the committed units of each file that changed or went: the records are read only when one did
        used = survey.used(self.commits, gone) if gone else {}
        for tag, old in known.items():
            new = fingerprints.get(tag)
            if not used.get(tag):
                continue
            if new is None:
                raise OutputError(f"input file {old['path']} was removed, but {used[tag]} unit(s) of it are committed in "
                                  f"{self.output}. Put it back, or start over with --fresh (or another --output).")
            generated = (" Its rows' ids are generated from their place in it (input.generate_ids), so any change "
                         "to it, even one that keeps its rows (a copy that does not keep the modification time), "
                         "counts." if new.get("ids") == "generated" else "")
            raise OutputError(f"input file {new['path']} changed since {self.output} began ({', '.join(_changed(old, new))} "
                              f"differ), and {used[tag]} unit(s) of it are committed: their rows would be lost or "
                              f"written twice.{generated} Restore the file, or start over with --fresh (or another "
                              "--output); to add rows, add a new file instead of rewriting one.")
        return known

    def _write_inputs(self, fingerprints: dict[str, dict], known: dict[str, dict]) -> None:
        """Keep the fingerprints of this run's input files in place of those the folder held (`known`)."""
        for tag, new in fingerprints.items():
            if known.get(tag) != new:
                with writing(self.inputs / f"{tag}.json"):
                    (self.inputs / f"{tag}.json").write_json(new)
        for tag in set(known) - set(fingerprints):
            (self.inputs / f"{tag}.json").unlink(missing_ok=True)

    def kept_scan(self) -> dict | None:
        """The input scan a run kept (`keep_scan`), or None; read before the folder is claimed, writing nothing."""
        try:
            return self.scan_file.read_json()
        except (FileNotFoundError, NotADirectoryError, ValueError):  # none kept, or no folder there (the claim says)
            return None

    def keep_scan(self, scan: dict) -> None:
        """Keep the input scan (fingerprints and repeated ids) for the next run: when its input is unchanged, it
        reads no id to know them again. One file, written whole, so its fingerprints and ids always agree."""
        with writing(self.scan_file):
            self.scan_file.write_json(scan)

    def write_report(self, data: dict) -> None:
        with writing(self.report_path()):
            self.report_path().write_json(data)

"""What the run in an output folder is doing, read from the folder alone (`batchjson status`), and the way to stop
it from anywhere (`batchjson cancel`).

Status takes no lock or lease and writes nothing: it lists the run state once and reads the progress files
(storage/progress.py, one per shard), the leases on object storage, and the report of an ended run, a handful of
requests whatever the number of units. Whether a run still holds the folder: on object storage, an unexpired lease
of the progress file's host and pid; locally, whether that pid is alive (on this host; another host's is not
checked). A run whose file says "running" with no holder died without ending (SIGKILL, a lost machine): a rerun
resumes it.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

from pyarrow import fs

from batchjson.ends import output_folder
from batchjson.errors import OutputError
from batchjson.records import Stage
from batchjson.spec import JobSpec
from batchjson.storage import STATE, Location, Storage
from batchjson.storage.locks import LEASE
from batchjson.storage.names import SPEC
from batchjson.storage.progress import (RATE_WINDOW, add_record, add_tallies, empty_tally, finished, progress_files,
                                        rate, write_cancel)


@dataclass
class Status:
    """The folder's run as its files say now; `summary()` is what `batchjson status` prints, `to_dict()` its --json."""

    output: str
    state: str
    """"running", "ended", "died" (its file says running, but no process holds the folder) or "unknown" (a folder
    written before progress files: counts from its commit records)."""
    outcome: str = ""
    """How an ended run ended (storage/progress.py's Outcome), "; " between shards that ended otherwise."""
    detail: str = ""
    rows: int = 0
    units: int | None = None
    passes: dict = field(default_factory=dict)
    """Per pass ("p1", "p2"): units committed, rows by kind (output, rejects, requeue) and rejects by reason."""
    runs: list = field(default_factory=list)
    """Each shard's run: id, host, pid, shard, started, deadline, updated, and whether it holds the folder."""
    rows_per_s: float | None = None
    """Rows finished (output or rejects) per second over the last RATE_WINDOW seconds, all shards."""
    report: dict = field(default_factory=dict)

    @property
    def valid(self) -> int:
        return sum(t["output"] for t in self.passes.values())

    @property
    def rejected(self) -> int:
        return sum(t["rejects"] for t in self.passes.values())

    @property
    def left(self) -> int:
        return max(0, self.rows - finished(self.passes))

    @property
    def eta_s(self) -> float | None:
        if self.state != "running" or not self.rows_per_s:
            return None
        return round(self.left / self.rows_per_s, 1)

    def to_dict(self) -> dict:
        return asdict(self) | {"valid": self.valid, "rejected": self.rejected, "left": self.left, "eta_s": self.eta_s}

    def summary(self) -> str:
        now = time.time()
        head = f"{self.output}: {self.state}" + (f" ({self.outcome})" if self.outcome else "")
        lines = [head + (f": {self.detail}" if self.detail else "")]
        held = {True: "holds the folder", False: "gone", None: "on another host: not checked"}
        for run in self.runs:
            if run["state"] == "ended":
                lines.append(f"  run {run['id']} (shard {run['shard']}): pid {run['pid']} on {run['host']}, ended "
                             f"{_ago(now - run['updated'])} ago after {_ago(run['updated'] - run['started'])}")
                continue
            lines.append(f"  run {run['id']} (shard {run['shard']}): pid {run['pid']} on {run['host']}, started "
                         f"{_ago(now - run['started'])} ago, progress written {_ago(now - run['updated'])} ago; "
                         f"{held[run['alive']]}")
        lines.append(f"  rows: {self.rows} in, {self.valid} valid, {self.rejected} rejected, {self.left} left")
        sent = self.passes.get("p1", empty_tally())["requeued_units"]
        for stage, t in sorted(({"p1": empty_tally()} | self.passes).items()):
            of = self.units if stage == "p1" else sent
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(t["reasons"].items(), key=lambda kv: -kv[1]))
            again = f", {t['requeue']} to pass 2" if t["requeue"] else ""
            lines.append(f"  {Stage(stage).label}: {t['units']}{'' if of is None else f'/{of}'} units, {t['output']} valid, "
                         f"{t['rejects']} rejected{again}" + (f" ({reasons})" if reasons else ""))
        if self.state == "running":
            rate = f"{self.rows_per_s:.2f} rows/s over the last {RATE_WINDOW / 60:.0f} min" if self.rows_per_s \
                else "no rows finished yet in the last minutes"
            eta = f"; ETA {_ago(self.eta_s)} ({_clock(now + self.eta_s)})" if self.eta_s is not None else ""
            lines.append(f"  rate: {rate}{eta}")
        deadlines = sorted({r["deadline"] for r in self.runs if r.get("deadline")})
        if deadlines and self.state == "running":
            when = (f"in {_ago(deadlines[0] - now)}" if deadlines[0] > now else
                    "passed: the units in flight are finished and committed, then the run ends")
            lines.append(f"  deadline: {_clock(deadlines[0])} ({when})")
        if self.report:
            lines.append(f"  report: {self.report['valid']} valid, {self.report['rejected']} rejected "
                         f"({self.report['reject_rate']:.1%}); verified: {self.report['verified']}")
        return "\n".join(lines)


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _clock(at: float) -> str:
    try:
        return datetime.fromtimestamp(at).strftime("%H:%M")
    except (OverflowError, ValueError, OSError, TypeError):  # a moment no clock shows (an older run's deadline)
        return f"{at!r} (not a time)"


def folder_of(job: JobSpec | None, output: str | None) -> tuple[Storage, dict[str, fs.FileInfo]]:
    """The output folder status and cancel look at (--output, else the job's output.path), a batchjson run's, and
    the files of its run state: one listing."""
    storage = output_folder(job, output)
    folder = storage.output
    try:
        files = {i.base_name: i for i in storage.state.files()}
        if not files and not folder.is_dir():
            raise OutputError(f"{folder} is not a folder: nothing has run there. Check --output (or output.path).")
    except OSError as e:
        raise OutputError(f"cannot read {folder}: {e.strerror or e}. Check the path and permissions.") from None
    if SPEC not in files:
        raise OutputError(f"{folder} holds no batchjson run (no {STATE}/{SPEC}). Check --output (or output.path).")
    return storage, files


def status_job(job: JobSpec | None = None, output: str | None = None) -> Status:
    """What the run in `output` (default: the job's output.path) is doing or how it ended, from its folder alone:
    takes no lock or lease, so it is safe beside a running run and from another machine. An OutputError when the
    folder cannot be read or holds no batchjson run."""
    storage, listed = folder_of(job, output)
    state = storage.state
    files = progress_files(state, list(listed))
    if not files:
        return _from_records(storage)
    status, now = Status(str(storage.output), "ended"), time.time()
    leases = _leases(state, listed) if not state.local else None
    rates, outcomes, details = [], [], []
    for f in files:
        p = f.read_json()
        alive = _alive(p["run"], leases) if p["state"] == "running" else False
        run = p["run"] | {"updated": p["updated"], "state": p["state"], "alive": alive}
        status.runs.append(run)
        status.rows += p["rows"]
        status.units = (status.units or 0) + p["units"]
        add_tallies(status.passes, p["passes"])
        if p["state"] == "running":
            status.state = "running" if run["alive"] is not False else "died"
            rates.append(rate(p["samples"], now) or 0.0)
        else:
            outcomes.append(p["outcome"])
            details.append(p["detail"])
    if status.state == "died":
        status.detail = "its process is gone without ending (killed?); run the job again to resume"
    elif status.state == "ended":
        status.outcome = "; ".join(dict.fromkeys(outcomes))
        status.detail = "; ".join(d for d in dict.fromkeys(details) if d)
        layout = int(status.runs[0]["shard"].split("/")[1])
        status.report = _report(output_folder(job, output, (0, layout)))
    status.rows_per_s = round(sum(rates), 3) if any(rates) else None
    return status


def _alive(run: dict, leases: list[dict] | None) -> bool | None:
    """Whether the run's process still holds the folder: its lease (object storage), or its pid (this host)."""
    if leases is not None:
        return any(lease.get("host") == run["host"] and lease.get("pid") == run["pid"] for lease in leases)
    if run["host"] != socket.gethostname():
        return None
    try:
        os.kill(run["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _leases(state: Location, listed: dict[str, fs.FileInfo]) -> list[dict]:
    """The unexpired leases of the folder (storage/locks.py) among the files `listed`, by the store's clock."""
    found = []
    for info in listed.values():
        if not info.base_name.startswith(LEASE):
            continue
        try:
            lease = (state / info.base_name).read_json()
        except (FileNotFoundError, ValueError):
            continue  # released meanwhile
        age = time.time() - info.mtime.timestamp() if info.mtime else 0.0
        if age < float(lease.get("expiry_s", 90)):
            found.append(lease)
    return found


def _report(storage: Storage) -> dict:
    """What the ended run's report says of its rows and its exactly-once check (shard 0's, for shards)."""
    path = storage.report_path()
    try:
        r = path.read_json()
    except (FileNotFoundError, ValueError):
        return {}
    ok = r.get("verified", {}).get("ok")
    return {"valid": r.get("valid", 0), "rejected": r.get("rejected", 0), "reject_rate": r.get("reject_rate", 0),
            "verified": "ok" if ok else "not proven" if ok is False else "not run", "file": str(path)}


def _from_records(storage: Storage) -> Status:
    """A folder written before progress files: its commit records counted (a read of each), its input's rows."""
    status = Status(str(storage.output), "unknown", detail="no progress file (written by an earlier batchjson): "
                    "counts are its commit records'")
    for record in sorted(storage.units.glob("p[12]-*.json")):
        add_record(status.passes, record.read_json())
    status.rows = sum(p.read_json().get("rows", 0) for p in storage.inputs.glob("*.json"))
    status.report = _report(storage)
    return status


def cancel_job(job: JobSpec | None = None, output: str | None = None) -> str:
    """Ask the run in `output` to stop as SIGTERM stops it (finished units committed, a rerun resumes): a marker
    that names the runs holding the folder now, which they look for every few seconds. Returns what was done. An
    OutputError when no run holds the folder (a marker then would stop nothing)."""
    status = status_job(job, output)
    runs = [r for r in status.runs if r["alive"] is not False and status.state == "running"]
    if not runs:
        raise OutputError(f"no batchjson run is writing to {status.output} ({status.state}"
                          f"{': ' + status.outcome if status.outcome else ''}): nothing to cancel.")
    write_cancel(output_folder(job, output).state, [r["id"] for r in runs], socket.gethostname(), os.getpid())
    named = ", ".join(f"{r['id']} (pid {r['pid']} on {r['host']})" for r in runs)
    return (f"cancel requested for run {named}: it stops within a few seconds, at its next engine step; finished "
            "units stay committed, and running the job again resumes.")
